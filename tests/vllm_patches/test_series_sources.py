# SPDX-License-Identifier: Apache-2.0
"""The patch series and the vLLM glue it points at (turboquant_core/vllm/) agree: every name the series imports or
names by dotted path is defined there, and every glue module is reached from the series. Read from the sources
(ast), so this runs without vLLM."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERIES_DIR = REPO / "vllm_patches" / "v0.26.0"
GLUE = REPO / "turboquant_core" / "vllm"

FROM_IMPORT = re.compile(r"from turboquant_core\.vllm\.(\w+) import (\([^)]*\)|[\w, ]+)")
DOTTED = re.compile(r"[\"']turboquant_core\.vllm\.(\w+)\.(\w+)[\"']")


def added_lines() -> list[tuple[str, str]]:
    """(patch name, line) for every line the series adds."""
    names = [n.strip() for n in (SERIES_DIR / "series").read_text().splitlines() if n.strip() and n[0] != "#"]
    out = []
    for name in names:
        for line in (SERIES_DIR / name).read_text().splitlines():
            if line.startswith("+") and not line.startswith("+++"):
                out.append((name, line[1:]))
    return out


def references() -> list[tuple[str, str, str]]:
    """(patch, module, name) for every turboquant_core.vllm name the series imports or names as a path."""
    refs, added = [], {}
    for patch, line in added_lines():
        added.setdefault(patch, []).append(line)
    for patch, lines in added.items():
        text = "\n".join(lines)  # a parenthesized import spans lines
        for module, names in FROM_IMPORT.findall(text):
            refs += [(patch, module, n.strip()) for n in names.strip("()").split(",") if n.strip()]
        refs += [(patch, module, name) for module, name in DOTTED.findall(text)]
    return sorted(set(refs))


def top_level_names(module: str) -> set[str]:
    tree = ast.parse((GLUE / f"{module}.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def glue_imports(module: str) -> set[str]:
    """Sibling glue modules that ``module`` imports (``from .x import ...``)."""
    tree = ast.parse((GLUE / f"{module}.py").read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}


def test_the_series_refers_to_the_glue():
    refs = references()
    # The backend (registry), the sliding-window spec and the warm-up are reached from vLLM through the series.
    assert {(m, n) for _, m, n in refs} >= {("backend", "TQAttentionBackend"), ("spec", "TQSlidingWindowSpec"),
                                            ("warmup", "warmup_tq_attention")}


@pytest.mark.parametrize("patch,module,name", references())
def test_every_name_the_series_uses_is_defined_in_the_sources(patch, module, name):
    path = GLUE / f"{module}.py"
    assert path.is_file(), f"{patch} imports turboquant_core.vllm.{module}, which has no source file {path}"
    assert name in top_level_names(module), f"{patch} uses turboquant_core.vllm.{module}.{name}, not defined there"


def test_every_glue_module_is_reached_from_the_series():
    reached = {m for _, m, _ in references()}
    frontier = set(reached)
    while frontier:
        frontier = set().union(*(glue_imports(m) for m in frontier)) - reached
        reached |= frontier
    modules = {p.stem for p in GLUE.glob("*.py")} - {"__init__"}
    assert modules - reached == set(), "glue modules that no patch reaches: dead code or a missing patch hunk"


def test_the_series_adds_no_vllm_source_files():
    # New vLLM-side code lives in turboquant_core/vllm as ordinary source; the series only edits vLLM's own files.
    created = []
    for name in (SERIES_DIR / "series").read_text().split():
        if name.endswith(".patch"):
            text = (SERIES_DIR / name).read_text()
            created += re.findall(r"^--- /dev/null\n\+\+\+ b/(\S+)", text, re.M)
    assert created == []

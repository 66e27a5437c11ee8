# SPDX-License-Identifier: Apache-2.0
"""Stored results and the documents that cite them agree: every result folder the docs or the sources name is in the
tree or listed in benchmarks/results/INDEX.md (which names the commit that holds it), and every folder in the tree is
listed there."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "benchmarks" / "results" / "INDEX.md"
# A result folder as docs and sources write it: benchmarks/results/<run>[/<study>] or eval/results/<model>/<run>,
# or a dated run name on its own (benchmarks/README.md's history, relative to benchmarks/results/).
FULL = re.compile(r"\b((?:benchmarks/results/[\w.-]+(?:/(?:key-research))?)|(?:eval/results/[\w.-]+/[\w.*-]+))")
DATED = re.compile(r"`(20\d\d-\d\d-\d\d-[\w.-]+)/`")


def citing_files() -> list[Path]:
    docs = [p for p in REPO.glob("**/*.md") if not p.is_relative_to(REPO / "benchmarks" / "results")
            and not any(part.startswith(".") or part in ("build", "node_modules") for part in p.relative_to(REPO).parts)
            and not p.is_relative_to(REPO / "eval" / "results" / "smollm2-135m-instruct")
            and not p.is_relative_to(REPO / "eval" / "results" / "gemma-3-270m")]
    sources = [p for d in ("turboquant_core", "eval", "scripts", "benchmarks", "tests")
               for p in (REPO / d).glob("**/*.py") if "results" not in p.relative_to(REPO).parts]
    return sorted(docs + sources)


def indexed() -> set[str]:
    return {m.rstrip("/") for m in re.findall(r"^\| [\d-]+ \| `([^`]+)`", INDEX.read_text(), re.M)}


def cited() -> list[tuple[str, str]]:
    out = set()
    for path in citing_files():
        text = path.read_text(errors="replace")
        rel = str(path.relative_to(REPO))
        out |= {(rel, m.rstrip("/.")) for m in FULL.findall(text) if not m.endswith("INDEX.md")}
        if path == REPO / "benchmarks" / "README.md":
            out |= {(rel, f"benchmarks/results/{m}") for m in DATED.findall(text)}
    return sorted(out)


@pytest.mark.parametrize("where,folder", cited())
def test_every_cited_result_is_in_the_tree_or_the_index(where, folder):
    if "*" in folder:  # a glob over runs: some run it names must be listed
        pattern = re.compile(re.escape(folder).replace(r"\*", ".*"))
        assert any(pattern.fullmatch(f) for f in indexed()), f"{where} names {folder}: no listed run matches"
        return
    in_tree = (REPO / folder).exists()
    in_index = folder in indexed() or any(f.startswith(folder + "/") or folder.startswith(f + "/")
                                          for f in indexed())
    assert in_tree or in_index, f"{where} names {folder}, which is neither in the tree nor in {INDEX.name}"


def test_every_stored_run_is_in_the_index():
    stored = [str(p.relative_to(REPO)) for p in (REPO / "benchmarks" / "results").iterdir() if p.is_dir()]
    stored += [str(p.relative_to(REPO)) for p in (REPO / "eval" / "results").glob("*/*") if p.is_dir()]
    assert stored, "no stored results found"
    missing = sorted(set(stored) - indexed())
    assert missing == [], f"result folders missing from {INDEX.name}: {missing}"

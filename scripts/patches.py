# SPDX-License-Identifier: Apache-2.0
"""Apply, check, revert or inspect the fork's patch series on a vLLM tree.

    python scripts/patches.py apply|check|revert|status [--target DIR | --installed]
                              [--series vllm_patches/v0.26.0/series]

``--target DIR``: a directory that contains the ``vllm`` package (a source checkout root or a
site-packages directory). ``--installed``: the directory holding the importable ``vllm``
package, found without importing it. The series directory is named after the vLLM version it
patches (``v0.26.0``); the target must be exactly that version.

Patches are unified diffs with paths relative to the directory that contains ``vllm/``
(``--- a/vllm/...``, ``+++ b/vllm/...``, ``/dev/null`` for new or deleted files); the lines
before the first ``---`` are a free-text header. Application is pure Python: every hunk must
match its context exactly (no fuzz; a hunk may sit at another line than the header says),
the whole series is applied in memory first, and only then are the files written, each
atomically, with the originals kept to roll back if a write fails: a tree is never left
half-patched. A marker file ``vllm/_aither_tq_patches.txt`` records the applied series.

Exit status: 0 done (or nothing to do), 1 the series does not apply / the tree is partially
patched or modified, 2 bad arguments or wrong vLLM version.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "vllm/_aither_tq_patches.txt"
DEFAULT_SERIES = Path(__file__).resolve().parent.parent / "vllm_patches" / "v0.26.0" / "series"
NO_NEWLINE = "\\ No newline at end of file"


class PatchError(Exception):
    """The series cannot be applied or reverted as asked (exit status 1)."""


class UsageError(Exception):
    """Bad arguments, missing files or a wrong vLLM version (exit status 2)."""


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------


@dataclass
class Hunk:
    old_start: int  # 1-based line of the first old line (0 for an empty old side)
    old: list[str]  # old-side lines, each with its line ending ("" ending when none)
    new: list[str]

    def reversed(self) -> Hunk:
        return Hunk(self.old_start, self.new, self.old)


@dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    def reversed(self) -> FilePatch:
        return FilePatch(self.new_path, self.old_path, [h.reversed() for h in self.hunks])


@dataclass
class Patch:
    name: str
    header: str
    files: list[FilePatch]
    sha256: str

    def reversed(self) -> Patch:
        return Patch(self.name, self.header, [f.reversed() for f in reversed(self.files)], self.sha256)


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _diff_path(raw: str, prefix: str, where: str) -> str | None:
    raw = raw.split("\t", 1)[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith(prefix):
        raw = raw[len(prefix):]
    parts = Path(raw).parts
    if raw.startswith("/") or ".." in parts or not parts or parts[0] != "vllm":
        raise UsageError(f"{where}: path {raw!r} must be relative and inside vllm/")
    return raw


def parse_patch(text: str, name: str) -> Patch:
    """Parse one unified diff (with a free-text header before the first ``---``)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    header = "\n".join(lines[:i])
    files: list[FilePatch] = []
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1  # text between file sections (e.g. "diff --git" lines) is ignored
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise UsageError(f"{name}:{i + 1}: '---' line not followed by '+++'")
        fp = FilePatch(_diff_path(line[4:], "a/", f"{name}:{i + 1}"),
                       _diff_path(lines[i + 1][4:], "b/", f"{name}:{i + 2}"))
        if fp.old_path is None and fp.new_path is None:
            raise UsageError(f"{name}:{i + 1}: both sides are /dev/null")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise UsageError(f"{name}:{i + 1}: malformed hunk header {lines[i]!r}")
            old_n = int(m.group(2)) if m.group(2) is not None else 1
            new_n = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(1)), [], [])
            i += 1
            seen_old = seen_new = 0
            last: list[list[str]] = []
            while seen_old < old_n or seen_new < new_n or (i < len(lines) and lines[i] == NO_NEWLINE):
                if i >= len(lines):
                    raise UsageError(f"{name}: hunk at line {hunk.old_start} of {fp.path} is truncated")
                body = lines[i]
                if body == NO_NEWLINE:
                    for side in last:  # the previous line has no line ending
                        side[-1] = side[-1][:-1]
                    i += 1
                    continue
                tag, content = (body[0], body[1:]) if body else (" ", "")
                if tag == " ":
                    hunk.old.append(content + "\n")
                    hunk.new.append(content + "\n")
                    last = [hunk.old, hunk.new]
                    seen_old += 1
                    seen_new += 1
                elif tag == "-":
                    hunk.old.append(content + "\n")
                    last = [hunk.old]
                    seen_old += 1
                elif tag == "+":
                    hunk.new.append(content + "\n")
                    last = [hunk.new]
                    seen_new += 1
                else:
                    raise UsageError(f"{name}:{i + 1}: unexpected line in hunk: {body!r}")
                i += 1
            if seen_old != old_n or seen_new != new_n:
                raise UsageError(f"{name}: hunk at line {hunk.old_start} of {fp.path} has wrong line counts")
            fp.hunks.append(hunk)
        files.append(fp)
    if not files:
        raise UsageError(f"{name}: no file changes found")
    return Patch(name, header, files, hashlib.sha256(text.encode()).hexdigest())


def read_series(series_file: Path) -> list[Patch]:
    if not series_file.is_file():
        raise UsageError(f"series file not found: {series_file}")
    patches = []
    for raw in series_file.read_text().splitlines():
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        path = series_file.parent / entry
        if not path.is_file():
            raise UsageError(f"{series_file}: patch {entry!r} not found in {series_file.parent}")
        patches.append(parse_patch(path.read_text(), entry))
    if not patches:
        raise UsageError(f"{series_file} lists no patches")
    return patches


# ----------------------------------------------------------------------------------------------
# Target and version
# ----------------------------------------------------------------------------------------------


def installed_target() -> Path:
    """Directory containing the importable ``vllm`` package, without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no importable 'vllm' package in this Python environment "
                         f"({sys.executable}); install vllm or pass --target DIR")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def expected_version(series_file: Path) -> str:
    name = series_file.resolve().parent.name
    if not re.fullmatch(r"v\d+(\.\d+)*\S*", name):
        raise UsageError(f"series directory {series_file.parent} is not named after a vLLM version (e.g. v0.26.0)")
    return name[1:]


def _strip_local(version: str) -> str:
    return version.split("+", 1)[0]


def detect_version(target: Path) -> tuple[str, str]:
    """(version, where it was read) of the vLLM tree in ``target``."""
    version_py = target / "vllm" / "_version.py"
    if version_py.is_file():
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_py.read_text())
        if m:
            return m.group(1), str(version_py)
    for meta in sorted(target.glob("vllm-*.dist-info/METADATA")):
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
        if m:
            return m.group(1), str(meta)
    if (target / ".git").exists():
        try:
            tag = subprocess.run(["git", "-C", str(target), "describe", "--tags", "--exact-match"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            tag = None
        if tag is not None and tag.returncode == 0 and tag.stdout.strip():
            return tag.stdout.strip().lstrip("v"), "git tag"
    raise UsageError(
        f"cannot tell the vLLM version of {target}: no vllm/_version.py, no vllm-*.dist-info/METADATA "
        "and no exact git tag (build or install the checkout once so vllm/_version.py exists)")


def check_target(target: Path, series_file: Path) -> str:
    if not (target / "vllm").is_dir():
        raise UsageError(f"{target} does not contain a 'vllm' package directory")
    want = expected_version(series_file)
    found, where = detect_version(target)
    if _strip_local(found) != want:
        other = series_file.resolve().parent.parent / f"v{_strip_local(found)}"
        hint = (f"use {other / 'series'}" if (other / "series").is_file()
                else f"no series exists for it ({other} is missing)")
        raise UsageError(f"{target} has vLLM {found} (read from {where}), but the series in "
                         f"{series_file.parent} is for vLLM {want}; {hint}")
    return found


# ----------------------------------------------------------------------------------------------
# In-memory application
# ----------------------------------------------------------------------------------------------


class Tree:
    """Files of a target as read from disk, plus pending in-memory changes."""

    def __init__(self, root: Path):
        self.root = root
        self.original: dict[str, str | None] = {}  # rel path -> disk content (None: absent)
        self.current: dict[str, str | None] = {}

    def read(self, rel: str) -> str | None:
        if rel not in self.current:
            path = self.root / rel
            content = None
            if path.is_file():
                with open(path, encoding="utf-8", newline="") as f:
                    content = f.read()
            self.original[rel] = content
            self.current[rel] = content
        return self.current[rel]

    def changed(self) -> dict[str, str | None]:
        return {p: c for p, c in self.current.items() if c != self.original[p]}


def _find_block(lines: list[str], block: list[str], expected: int, start: int) -> int:
    """Index where ``block`` occurs in ``lines`` at or after ``start``, nearest to ``expected``; -1 if none."""
    n = len(block)
    candidates = range(start, len(lines) - n + 1)
    for idx in sorted(candidates, key=lambda k: (abs(k - expected), k)):
        if lines[idx:idx + n] == block:
            return idx
    return -1


def apply_file_patch(content: str | None, fp: FilePatch, where: str) -> str | None:
    """Result of applying ``fp`` to ``content``; raises PatchError when a hunk does not match."""
    if fp.old_path is None:
        created = "".join(line for h in fp.hunks for line in h.new)
        # An identical file is accepted: reinstalling vllm over a patched tree leaves the
        # files the series added (they are not in vllm's RECORD) behind.
        if content is not None and content != created:
            raise PatchError(f"{where}: {fp.path} should be created but already exists with other content")
        return created
    if content is None:
        raise PatchError(f"{where}: {fp.path} does not exist")
    lines = content.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for k, hunk in enumerate(fp.hunks, 1):
        expected = max(hunk.old_start - 1, 0) if hunk.old else hunk.old_start
        idx = _find_block(lines, hunk.old, expected, pos)
        if idx < 0:
            first = hunk.old[0].rstrip("\n") if hunk.old else ""
            raise PatchError(f"{where}: hunk {k} of {fp.path} (line {hunk.old_start}, starting {first!r}) "
                             "does not match the file")
        out.extend(lines[pos:idx])
        out.extend(hunk.new)
        pos = idx + len(hunk.old)
    out.extend(lines[pos:])
    result = "".join(out)
    if fp.new_path is None:
        if result:
            raise PatchError(f"{where}: {fp.path} should be deleted but has content the patch does not remove")
        return None
    return result


def apply_series(tree: Tree, patches: list[Patch], reverse: bool = False) -> None:
    seq = [p.reversed() for p in reversed(patches)] if reverse else patches
    for patch in seq:
        for fp in patch.files:
            tree.current[fp.path] = apply_file_patch(tree.read(fp.path), fp, patch.name)


def marker_text(series_file: Path, patches: list[Patch], version: str) -> str:
    lines = ["# vLLM patch series applied by scripts/patches.py; `revert` removes this file.",
             f"series: {series_file.resolve().parent.name}", f"vllm_version: {version}"]
    lines += [f"{p.name} sha256={p.sha256}" for p in patches]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _write_atomic(path: Path, content: str, mode: int | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(content)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _set_file(root: Path, rel: str, content: str | None, mode: int | None) -> None:
    path = root / rel
    if content is None:
        if path.exists():
            path.unlink()
    else:
        _write_atomic(path, content, mode)


def _drop_pycache(root: Path, rel: str) -> None:
    path = root / rel
    if path.suffix != ".py":
        return
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        try:
            pyc.unlink()
        except FileNotFoundError:
            pass


def commit(tree: Tree, changes: dict[str, str | None]) -> None:
    """Write ``changes``; on any failure restore every file already written, then re-raise."""
    done: list[str] = []
    modes = {}
    for rel in changes:
        path = tree.root / rel
        modes[rel] = path.stat().st_mode & 0o7777 if path.exists() else None
    try:
        for rel, content in changes.items():
            _set_file(tree.root, rel, content, modes[rel])
            done.append(rel)
    except BaseException:
        for rel in reversed(done):
            _set_file(tree.root, rel, tree.original[rel], modes[rel])
        raise
    for rel in changes:
        _drop_pycache(tree.root, rel)


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


@dataclass
class State:
    kind: str  # "not applied" | "applied" | "partial"
    details: list[str]
    marker: str | None


def _hunk_state(content: str | None, fp: FilePatch) -> list[str]:
    """Per hunk: 'old' (unpatched text present), 'new' (patched text present), or 'neither'."""
    if fp.old_path is None or fp.new_path is None:  # created / deleted file
        exists = content is not None
        created = fp.old_path is None
        if not exists:
            return ["old" if created else "new"]
        try:
            same = apply_file_patch(None, fp, "") == content if created else False
        except PatchError:
            same = False
        return ["new" if same else ("neither" if created else "old")]
    if content is None:
        return ["neither"] * len(fp.hunks)
    lines = content.splitlines(keepends=True)
    out = []
    for h in fp.hunks:
        has_old = _find_block(lines, h.old, 0, 0) >= 0
        has_new = _find_block(lines, h.new, 0, 0) >= 0
        out.append("old" if has_old and not has_new else "new" if has_new and not has_old
                   else "both" if has_old else "neither")
    return out


def series_state(target: Path, patches: list[Patch]) -> State:
    forward, backward = Tree(target), Tree(target)
    marker = forward.read(MARKER)
    fwd_err = bwd_err = None
    try:
        apply_series(forward, patches)
    except PatchError as e:
        fwd_err = str(e)
    try:
        apply_series(backward, patches, reverse=True)
    except PatchError as e:
        bwd_err = str(e)
    if bwd_err is None and (fwd_err is not None or marker is not None):
        note = [] if marker else ["no marker file: patched by something other than scripts/patches.py?"]
        return State("applied", note, marker)
    if fwd_err is None:
        # A marker without the patched contents is left over from reinstalling vllm.
        return State("not applied", [f"stale {MARKER} (vllm reinstalled?); apply rewrites it"] if marker else [],
                     marker)
    details = []
    if marker is not None:
        details.append(f"marker {MARKER} present")
    disk = Tree(target)
    for patch in patches:
        states = [s for fp in patch.files for s in _hunk_state(disk.read(fp.path), fp)]
        if all(s in ("new", "both") for s in states):
            summary = "applied"
        elif all(s in ("old", "both") for s in states):
            summary = "not applied"
        else:
            counts = {k: states.count(k) for k in ("old", "new", "neither", "both") if states.count(k)}
            summary = "mixed: " + ", ".join(f"{v} hunk(s) {k}" for k, v in counts.items())
        details.append(f"{patch.name}: {summary}")
    details.append(f"apply would fail: {fwd_err}")
    details.append(f"revert would fail: {bwd_err}")
    return State("partial", details, marker)


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------


def run(command: str, target: Path, series_file: Path, out=print) -> int:
    version = check_target(target, series_file)
    patches = read_series(series_file)
    state = series_state(target, patches)
    label = f"{series_file.resolve().parent.name} series ({len(patches)} patches) on {target}"
    if command == "status":
        if state.kind == "partial":
            out(f"partially applied or modified: {label}")
            for d in state.details:
                out(f"  {d}")
            return 1
        out(f"{state.kind}: {label}")
        for d in state.details:
            out(f"  {d}")
        return 0
    if state.kind == "partial":
        out(f"cannot {command}: tree is partially applied or modified: {label}")
        for d in state.details:
            out(f"  {d}")
        return 1
    if command in ("apply", "check"):
        if state.kind == "applied":
            out(f"already applied: {label}; nothing to do")
            return 0
        tree = Tree(target)
        apply_series(tree, patches)  # verified clean by series_state; raises if the disk changed since
        num_files = len(tree.changed())
        tree.read(MARKER)
        tree.current[MARKER] = marker_text(series_file, patches, version)
        if command == "check":
            out(f"applies cleanly: {label} ({num_files} files would change)")
            return 0
        commit(tree, tree.changed())
        out(f"applied: {label} ({num_files} files changed)")
        return 0
    if command == "revert":
        if state.kind == "not applied":
            out(f"not applied: {label}; nothing to revert")
            return 0
        tree = Tree(target)
        apply_series(tree, patches, reverse=True)
        tree.read(MARKER)
        tree.current[MARKER] = None
        changes = tree.changed()
        commit(tree, changes)
        out(f"reverted: {label}")
        return 0
    raise UsageError(f"unknown command {command!r}")


COMMANDS = {  # name: what it does, one line each in --help
    "status": "say whether the series is applied, not applied, or partially applied or modified (exit 1); "
              "changes nothing",
    "check": "test that the series would apply cleanly (exit 1 if not); changes nothing",
    "apply": "apply the whole series, every file or none, and write the marker file " + MARKER,
    "revert": "undo an applied series and remove the marker file",
}
EXIT_STATUS = """exit status: 0 done (or nothing to do), 1 the series does not apply or the tree is partially
patched or modified, 2 bad arguments or a vLLM version the series is not for.

examples:
  python scripts/patches.py status --installed
  python scripts/patches.py check --target ~/src/vllm
  python scripts/patches.py apply --target .venv/lib/python3.12/site-packages"""


def _add_options(parser: argparse.ArgumentParser, with_defaults: bool) -> None:
    # Given on the main parser (before the command) or on a command's parser (after it): only the main parser
    # sets defaults, so an option given before the command is not reset by the command's parser.
    unset = {} if with_defaults else {"default": argparse.SUPPRESS}
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", type=Path, metavar="DIR", **unset,
                       help="the directory that contains the vllm package directory (vllm/): the root of a vLLM "
                            "source checkout, or a site-packages directory (default: the one holding the vllm this "
                            "Python imports, as --installed)")
    where.add_argument("--installed", action="store_true", **unset,
                       help="target the vllm package importable by this Python, found without importing it "
                            "(the default)")
    parser.add_argument("--series", type=Path, metavar="FILE", default=DEFAULT_SERIES if with_defaults
                        else argparse.SUPPRESS,
                        help="series file listing the patches in order; the name of its directory is the vLLM "
                             f"version the target must have (default: {DEFAULT_SERIES})")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python scripts/patches.py", description=__doc__.split("\n\n")[0],
                                 epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(ap, with_defaults=True)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, what in COMMANDS.items():
        p = sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".", epilog=EXIT_STATUS,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_options(p, with_defaults=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        target = args.target.resolve() if args.target else installed_target()
        return run(args.command, target, args.series)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

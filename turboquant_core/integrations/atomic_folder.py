# SPDX-License-Identifier: Apache-2.0
"""Writing a folder all at once: the converters (``gguf_convert``, ``quantize_checkpoint``) fill a temporary
folder beside the destination and rename it into place at the end, so a reader never sees half a model and a
failure leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on a clean exit it replaces ``dest`` (an existing one
    is moved aside, then removed, after the rename), on an exception it is removed and ``dest`` is untouched."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = dest.with_name(dest.name + ".old")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures and capability checks.

Without a CUDA device the Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be
set before any ``@triton.jit`` function is created, i.e. before a kernel module is imported, which
is why it happens here at import time (pytest imports this file before any test module).
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped when no CUDA device is present."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    """Where tensors for kernel tests live: 'cuda' when present, else 'cpu' (Triton interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def has_cuda() -> bool:
    return HAS_CUDA


@pytest.fixture(scope="session")
def folder_tensors():
    """folder -> {name: tensor} of every safetensors shard in it (a checkpoint as written)."""
    from safetensors import safe_open

    def read(folder):
        out = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    return read


@pytest.fixture(scope="session")
def folder_digest():
    """folder -> {file name: sha256} of its files: equal before and after means a converter only read it."""
    import hashlib

    return lambda folder: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

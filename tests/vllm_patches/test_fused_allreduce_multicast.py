# SPDX-License-Identifier: Apache-2.0
"""Patch 0012 without a GPU: vLLM's FlashInfer all-reduce workspaces (``get_fi_ar_workspace``,
``get_fi_ar_quant_workspace``) when the mnnvl workspace comes back without an NVLink multicast address.

vLLM's own functions run; FlashInfer's ``create_allreduce_fusion_workspace`` is replaced by a stand-in that hands back
workspaces with or without a multicast address (torch symmetric memory sets it to 0 where multicast is unavailable,
which a machine without GPUs cannot produce), and records what was created and destroyed. Without multicast the
fusion stays off for good: no trtllm fallback, no second attempt, the workspace destroyed. With multicast, a
creation error (the PCIe case vLLM already falls back from) or an explicit backend, vLLM behaves as before. Runs only
where a patched vLLM imports; skips otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture
def fiar(monkeypatch):
    """The patched module with a stand-in FlashInfer, one node, clean workspace state; ``.made`` lists
    (backend, multicast address or None) per creation, ``.destroyed`` the backends destroyed."""
    from test_config_layer import _patched_imports

    (mod,) = _patched_imports("its FlashInfer all-reduce module", "vllm.distributed.device_communicators."
                              "flashinfer_all_reduce")
    if not hasattr(mod, "_fi_ar_no_multicast"):
        pytest.skip("vLLM here is not patched by 0012-fused-allreduce-needs-multicast")
    made, destroyed = [], []
    mode = {"mnnvl": "no-multicast"}

    def create(*, backend, **_):
        if backend == "mnnvl" and mode["mnnvl"] == "raises":
            made.append((backend, None))
            raise RuntimeError("[SymmDeviceMemory] Device does not support multicasting.")
        mc = {"no-multicast": 0, "multicast": 0x7F0000000000, "unknown": None}[mode["mnnvl"]] if backend == "mnnvl" \
            else None
        made.append((backend, mc))
        ws = SimpleNamespace(backend=backend, destroy=lambda: destroyed.append(backend))
        if mc is not None:
            ws.mc_ptr = mc
        return ws

    monkeypatch.setattr(mod, "flashinfer_comm", SimpleNamespace(create_allreduce_fusion_workspace=create),
                        raising=False)
    monkeypatch.setattr(mod, "TorchDistBackend", lambda group: SimpleNamespace(group=group), raising=False)
    monkeypatch.setattr(mod, "get_node_count", lambda: 1)
    monkeypatch.setattr(mod, "_fi_ar_workspace", None)
    monkeypatch.setattr(mod, "_fi_ar_quant_workspace", None)
    monkeypatch.setattr(mod, "_fi_ar_no_multicast", False)
    monkeypatch.delenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", raising=False)
    return SimpleNamespace(mod=mod, made=made, destroyed=destroyed, mode=mode)


def _workspace(fiar, quant=False):
    import torch

    get = fiar.mod.get_fi_ar_quant_workspace if quant else fiar.mod.get_fi_ar_workspace
    return get(world_size=2, rank=0, max_token_num=1024, hidden_dim=4096, dtype=torch.bfloat16, group=None)


def test_no_multicast_keeps_the_fusion_off_for_good(fiar):
    assert _workspace(fiar) is None
    assert fiar.made == [("mnnvl", 0)], "created once, and not moved to trtllm"
    assert fiar.destroyed == ["mnnvl"]
    # Later callers (the quant patterns, the Gemma fused norm on every forward) neither retry nor fall back.
    assert _workspace(fiar) is None and _workspace(fiar, quant=True) is None
    assert fiar.made == [("mnnvl", 0)]


def test_with_multicast_the_mnnvl_workspace_is_kept(fiar):
    fiar.mode["mnnvl"] = "multicast"
    ws = _workspace(fiar)
    assert ws is not None and ws.backend == "mnnvl" and ws.mc_ptr != 0
    assert _workspace(fiar, quant=True) is ws  # the quant patterns share it, as before
    assert fiar.made == [("mnnvl", 0x7F0000000000)] and fiar.destroyed == []


def test_a_workspace_that_does_not_say_is_kept(fiar):
    fiar.mode["mnnvl"] = "unknown"  # a FlashInfer whose mnnvl workspace has no mc_ptr attribute
    ws = _workspace(fiar)
    assert ws is not None and ws.backend == "mnnvl" and fiar.destroyed == []


def test_a_failed_mnnvl_creation_still_falls_back_to_trtllm(fiar):
    fiar.mode["mnnvl"] = "raises"
    ws = _workspace(fiar)
    assert ws is not None and ws.backend == "trtllm"
    assert [b for b, _ in fiar.made] == ["mnnvl", "trtllm"]


def test_an_explicit_trtllm_backend_is_used_as_asked(fiar, monkeypatch):
    monkeypatch.setenv("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "trtllm")
    ws = _workspace(fiar)
    assert ws is not None and ws.backend == "trtllm" and fiar.made == [("trtllm", None)]

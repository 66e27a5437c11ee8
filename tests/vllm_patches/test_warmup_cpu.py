# SPDX-License-Identifier: Apache-2.0
"""The start-up steps that compile vLLM's Triton fused-MoE kernel for the steps past the CUDA graphs
(turboquant_core/vllm/warmup.py ``warmup_moe_eager_steps``, patch 0013), without a GPU: which token counts run, from
vLLM's own tile-config choice (its default configs, or a tuned table of its own). That the counts leave no variant to
compile while serving is the GPU test's (``test_jit_while_serving_gpu.py``, the MLA model, whatever its cache). Runs
only where a patched vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# DeepSeek-V2-Lite's routed experts: 64 of them, top 6, hidden 2048, expert width 1408
DSV2_W13, DSV2_W2, DSV2_TOP_K, DSV2_E = (64, 2816, 2048), (64, 2048, 1408), 6, 64
# Qwen3-30B-A3B's: 128, top 8, hidden 2048, width 768 (vLLM ships a tuned table for it on H200)
QWEN_W13, QWEN_W2, QWEN_TOP_K, QWEN_E = (128, 1536, 2048), (128, 2048, 768), 8, 128


@pytest.fixture(scope="module")
def moe():
    from test_config_layer import _patched_imports

    warmup, fused_moe = _patched_imports("the MoE warm-up", "turboquant_core.vllm.warmup",
                                         "vllm.model_executor.layers.fused_moe.fused_moe")
    return SimpleNamespace(warmup=warmup, fm=fused_moe)


def _configs_on(moe, monkeypatch, device: str, w13, w2, top_k):
    """vLLM's tile config by token count, as on a GPU of that name (its tuned table where one exists)."""
    monkeypatch.setattr(moe.fm, "get_device_name_as_file_name", lambda: device)
    moe.fm.get_moe_configs.cache_clear()
    return lambda m: moe.fm.try_get_optimal_moe_config(w13, w2, top_k, None, m)


def _variants(moe, config_for, top_k, num_experts, counts) -> set:
    return {moe.warmup.fused_moe_variant(m, config_for(m), top_k, num_experts) for m in counts}


def test_the_specialization_follows_the_routed_and_padded_rows(moe):
    """513 tokens of top 6 route 3,078 rows (not a multiple of 16), padded 3,078 + 64 x 127 = 11,206 (neither); 520
    route 3,120 rows, padded 11,248: both multiples of 16. 2 tokens (12 routed rows, 4 x 12 <= 64 experts) take the
    naive block assignment, 12 x 16 rows per block config of 16."""
    v = moe.warmup.fused_moe_variant
    cfg = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128}
    assert v(513, cfg, 6, 64)[1:] == ((False, False),) * 3
    assert v(520, cfg, 6, 64)[1:] == ((True, False),) * 3
    assert v(2, {"BLOCK_SIZE_M": 16}, 6, 64)[1:] == ((False, False), (True, False), (True, False))


def test_default_configs_past_the_graphs_take_two_steps(moe, monkeypatch):
    """No tuned table for DeepSeek-V2-Lite on H100: past 512 tokens every step picks the same config, and the token
    count's residue picks one of two specializations; 513 and 520 reach both. With every step eager (no mixed-batch
    graphs), each smaller config adds its own."""
    config_for = _configs_on(moe, monkeypatch, "NVIDIA_H100_80GB_HBM3", DSV2_W13, DSV2_W2, DSV2_TOP_K)
    counts = moe.warmup.eager_moe_token_counts(config_for, DSV2_TOP_K, DSV2_E, range(513, 8193))
    assert counts == [513, 520]
    every = moe.warmup.eager_moe_token_counts(config_for, DSV2_TOP_K, DSV2_E, range(1, 8193))
    assert every[:1] == [1] and every[-2:] == [513, 520] and len(every) < 20
    for lo, hi, got in ((513, 8193, counts), (1, 8193, every)):
        reached = _variants(moe, config_for, DSV2_TOP_K, DSV2_E, range(lo, hi))
        assert _variants(moe, config_for, DSV2_TOP_K, DSV2_E, got) == reached
        assert len(got) == len(reached)  # one step per variant


def test_a_tuned_table_takes_a_step_per_config_and_specialization(moe, monkeypatch):
    """vLLM's tuned table for the Qwen3-30B-A3B shape on H200: the buckets past 512 tokens (closest key: 512, 1024,
    1536, ...) hold 3 distinct configs, each reached by counts of both specializations (top 8: odd or even)."""
    config_for = _configs_on(moe, monkeypatch, "NVIDIA_H200", QWEN_W13, QWEN_W2, QWEN_TOP_K)
    assert moe.fm.get_moe_configs(QWEN_E, QWEN_W2[2], None) is not None
    counts = moe.warmup.eager_moe_token_counts(config_for, QWEN_TOP_K, QWEN_E, range(513, 8193))
    assert counts == [513, 514, 769, 770, 1281, 1282]
    reached = _variants(moe, config_for, QWEN_TOP_K, QWEN_E, range(513, 8193))
    assert _variants(moe, config_for, QWEN_TOP_K, QWEN_E, counts) == reached


def _runner(layers: dict, *, enforce_eager=False, mixed_graphs=True, max_capture=512, max_tokens=8192):
    from vllm.config import CUDAGraphMode

    mode = CUDAGraphMode.FULL_AND_PIECEWISE if mixed_graphs else CUDAGraphMode.FULL_DECODE_ONLY
    runs = []
    runner = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers, static_all_moe_layers=list(layers),
                                           cudagraph_mode=mode, max_cudagraph_capture_size=max_capture),
        model_config=SimpleNamespace(dtype=torch.bfloat16, enforce_eager=enforce_eager),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_tokens),
        _dummy_run=lambda n, **kw: runs.append((n, kw["cudagraph_runtime_mode"])),
    )
    return runner, runs


def _moe_layer(experts, w13=DSV2_W13, w2=DSV2_W2, top_k=DSV2_TOP_K, num_experts=DSV2_E):
    """A MoE layer as vLLM's runner registers it (``MoERunner.routed_experts``), weights on the meta device."""
    routed = SimpleNamespace(
        quant_method=SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts)),
        moe_config=SimpleNamespace(experts_per_token=top_k, num_experts=num_experts),
        w13_weight=torch.empty(w13, device="meta"), w2_weight=torch.empty(w2, device="meta"))
    return SimpleNamespace(routed_experts=routed)


def _triton_experts():
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    experts = object.__new__(TritonExperts)  # what the warm-up reads of it: its quantization config
    experts.quant_config = FUSED_MOE_UNQUANTIZED_CONFIG
    return experts


def test_the_warmup_runs_eager_steps_for_triton_experts_only(moe, monkeypatch):
    """Patch 0013's call: the 26 MoE layers of one shape take the two eager steps past the graphs once; without
    mixed-batch graphs (or eager), every count from 1 is a candidate; MoE layers of another kernel, and dense
    models, take none."""
    from vllm.config import CUDAGraphMode

    monkeypatch.setattr(moe.fm, "get_device_name_as_file_name", lambda: "NVIDIA_H100_80GB_HBM3")
    moe.fm.get_moe_configs.cache_clear()
    experts = _triton_experts()
    layers = {f"model.layers.{i}.mlp.experts": _moe_layer(experts) for i in range(1, 27)}

    runner, runs = _runner(layers)
    assert moe.warmup.warmup_moe_eager_steps(runner) == [513, 520]
    assert runs == [(513, CUDAGraphMode.NONE), (520, CUDAGraphMode.NONE)]

    for kw in (dict(enforce_eager=True), dict(mixed_graphs=False)):
        runner, runs = _runner(layers, **kw)
        counts = moe.warmup.warmup_moe_eager_steps(runner)
        assert counts[0] == 1 and counts[-2:] == [513, 520] and [n for n, _ in runs] == counts

    other = {"model.layers.1.mlp.experts": _moe_layer(SimpleNamespace(quant_config=experts.quant_config))}
    for layers in (other, {}):
        runner, runs = _runner(layers)
        assert moe.warmup.warmup_moe_eager_steps(runner) == [] and runs == []

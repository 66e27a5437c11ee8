# SPDX-License-Identifier: Apache-2.0
"""No kernel compiles while serving (GPU, slow): after an engine's start-up, requests of every shape the scheduler
makes (a single decode, a prefill past the CUDA-graph sizes, ragged prefill beside decode, one long prompt) launch
only kernels the start-up compiled. A kernel compiled on a request's path holds that request (and the batch with it)
for as long as the compile takes, once per engine.

vLLM's JIT monitor (``jit_monitor_verbose``: every compile, with its constexprs and signature) logs each Triton
compile after the warm-up; the engine's log must hold none. Dummy weights at the Qwen3-8B shape, CUDA graphs on, each
engine in its own process (``test_stock_failures_gpu``'s runner).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_stock_failures_gpu import (
    CONFIGS,
    _assert_finite,
    _random_prompts,
    _tokens,
    engine,  # noqa: F401  (the module-scoped runner fixture, shared)
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

COMPILED = re.compile(r"JIT compilation during inference: .*")

# Steps of at most 1,024 tokens: the long prompts prefill in chunks over their own cached context, beside the short
# ones' decode.
MAX_STEP_TOKENS = 1024
PHASES = [
    dict(name="one decode", prompts=_random_prompts(1, (16,)), max_tokens=8, ignore_eos=True),
    # 8 x 300 prompt tokens: steps of 1,024 tokens, past the largest CUDA-graph size, so they run eagerly
    dict(name="eager prefill", prompts=_random_prompts(2, (300,) * 8), max_tokens=8, ignore_eos=True),
    dict(name="ragged", prompts=_random_prompts(3, (17, 129, 700, 1200, 33)), max_tokens=24, ignore_eos=True),
    dict(name="long", prompts=_random_prompts(4, (3000,)), max_tokens=8, ignore_eos=True),
]


@pytest.mark.parametrize("kv_cache_dtype, quantization", [
    ("auto", None),
    ("turboquant_k3v4_nc", None),
    ("turboquant_4bit_nc", None),
    ("auto", "tq4"),
    ("turboquant_k3v4_nc", "tq4"),
])
def test_no_kernel_compiles_while_serving(engine, kv_cache_dtype, quantization):
    engine_kwargs = dict(jit_monitor_verbose=True, **(dict(quantization=quantization) if quantization else {}))
    got = engine(model=str(CONFIGS / "qwen3-8b"), dummy=True, kv_cache_dtype=kv_cache_dtype, max_model_len=4096,
                 max_num_batched_tokens=MAX_STEP_TOKENS, enforce_eager=False, gpu_memory_utilization=0.5,
                 engine_kwargs=engine_kwargs, phases=PHASES)
    _assert_finite(got)
    assert [[len(t) for t in _tokens(got, i)] for i in range(len(PHASES))] == [[8], [8] * 8, [24] * 5, [8]]
    compiled = COMPILED.findall(Path(got["log"]).read_text())
    assert not compiled, f"{len(compiled)} kernel(s) compiled while serving:\n" + "\n".join(c[:600] for c in compiled)


@pytest.mark.parametrize("kv_cache_dtype", ["turboquant_k3v4_nc", "turboquant_4bit_nc", "auto"])
def test_no_kernel_compiles_while_serving_an_mla_model(engine, kv_cache_dtype):
    """The DeepSeek-V2-Lite shape (MLA: TURBOQUANT_MLA, or vLLM's own backend with a bf16 cache) through the same
    phases: the eager prefill continues chunked prompts beside new ones, the step that runs vLLM's context mask of its
    chunked-context prefill, which the warm-up compiles with any cache (patch 0007); and steps past the CUDA graphs
    pick vLLM's fused-MoE kernel variant by their token count, which the warm-up's eager steps compile (patch 0013)."""
    got = engine(model=str(CONFIGS / "deepseek-v2-lite"), dummy=True, kv_cache_dtype=kv_cache_dtype,
                 max_model_len=4096, max_num_batched_tokens=MAX_STEP_TOKENS, enforce_eager=False,
                 gpu_memory_utilization=0.6, engine_kwargs=dict(jit_monitor_verbose=True), phases=PHASES)
    _assert_finite(got)
    assert [[len(t) for t in _tokens(got, i)] for i in range(len(PHASES))] == [[8], [8] * 8, [24] * 5, [8]]
    compiled = COMPILED.findall(Path(got["log"]).read_text())
    assert not compiled, f"{len(compiled)} kernel(s) compiled while serving:\n" + "\n".join(c[:600] for c in compiled)

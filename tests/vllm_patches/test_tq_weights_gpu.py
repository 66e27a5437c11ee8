# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weights served by vLLM on a GPU (patch 0010, turboquant_core/vllm/quant_config.py), each engine in its
own process (test_stock_failures_gpu.py's runner):

- SmolLM2 (TQ_TEST_MODEL) with ``--quantization tq4`` and ``tq3``, CUDA graphs on: finite logprobs; the mean
  prompt-logprob gap to bf16 smaller for tq4 than for tq3 and far from noise (the quality floors are eval/'s);
  greedy agreement over the first 8 tokens reported;
- the same model written by ``tq quantize --bits 4`` and served as stored: the same tokens as the online tq4 engine
  (the same bytes);
- the Qwen3-8B shape with dummy weights, tq4 with and without the k3v4 KV cache: finite, 16 tokens per prompt; and
  with ``--tq-weights-lm-head``: finite, the model smaller by the head's bf16 bytes less its tq4 bytes;
- the Qwen3-30B-A3B shape (128 experts, top-8) with dummy weights, tq4 (the experts through
  turboquant_core/vllm/moe_method.py): finite, 16 tokens per prompt.
"""

from __future__ import annotations

import math

import pytest
from test_stock_failures_gpu import (
    CONFIGS,
    _assert_finite,
    _n_agree,
    _outputs,
    _random_prompts,
    _tokens,
    engine,  # noqa: F401  (the module-scoped runner fixture, shared)
)
from test_tq_serving_gpu import _model, _prompts

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


MAX_PROMPT_GAP = 3.0  # nats per prompt token against bf16: far from a model that still reads the text


def _prompt_gap(got: dict, ref: dict) -> float:
    """Mean over prompt tokens of bf16's logprob minus ours (nats; positive: ours less sure of the text)."""
    gaps = [r - g for a, b in zip(_outputs(got), _outputs(ref))
            for g, r in zip(a["prompt_logprobs"][1:], b["prompt_logprobs"][1:]) if g is not None and r is not None]
    return sum(gaps) / max(len(gaps), 1)


def _common(model: str) -> dict:
    phases = [dict(name="greedy", prompts=_prompts(60), max_tokens=24, prompt_logprobs=1)]
    return dict(model=model, max_model_len=4096, enforce_eager=False, phases=phases)


def test_smollm2_with_tq_weights(engine):
    common = _common(_model())
    ref = engine(kv_cache_dtype="auto", **common)
    gaps = {}
    for fmt in ("tq4", "tq3"):
        got = engine(kv_cache_dtype="auto", engine_kwargs=dict(quantization=fmt), **common)
        _assert_finite(got)
        agree = _n_agree(_tokens(got), _tokens(ref), 8)
        gaps[fmt] = _prompt_gap(got, ref)
        print(f"{fmt}: {agree}/{len(_tokens(ref))} prompts agree with bf16 over 8 tokens; prompt logprob gap "
              f"{gaps[fmt]:+.4f} nats/token")
    # Every weight moves, so greedy continuations part at near-ties (reported, not asserted). The quality floors
    # are eval/'s (WikiText-2 perplexity with round-to-nearest controls); here: the model moved, tq4 less than tq3,
    # and neither into noise (random weights are several nats per token away).
    assert all(math.isfinite(g) for g in gaps.values()), gaps
    assert 0 <= gaps["tq4"] < gaps["tq3"] < MAX_PROMPT_GAP, gaps


def test_a_tq_quantize_checkpoint_serves_as_stored(engine, tmp_path):
    from turboquant_core.integrations.quantize_checkpoint import quantize_checkpoint

    model = _model()
    stored = quantize_checkpoint(model, tmp_path / "smollm2-tq4", "tq4", progress=False).dest
    online = engine(kv_cache_dtype="auto", engine_kwargs=dict(quantization="tq4"), **_common(model))
    got = engine(kv_cache_dtype="auto", **_common(str(stored)))
    _assert_finite(got)
    assert _tokens(got) == _tokens(online)


@pytest.mark.parametrize("kv", ["auto", "turboquant_k3v4_nc"])
def test_qwen3_8b_shape_with_tq4_weights(engine, kv):
    phases = [dict(name="greedy", prompts=_random_prompts(3, (16, 300, 1200)), max_tokens=16, ignore_eos=True)]
    got = engine(model=str(CONFIGS / "qwen3-8b"), dummy=True, kv_cache_dtype=kv, max_model_len=2048,
                 enforce_eager=False, gpu_memory_utilization=0.5, engine_kwargs=dict(quantization="tq4"),
                 phases=phases)
    _assert_finite(got)
    assert all(len(t) == 16 for t in _tokens(got))


def test_qwen3_8b_shape_with_its_output_head_encoded_too(engine):
    """--tq-weights-lm-head: the output head (151,936 x 4,096, not tied) is encoded with the linear layers; the
    engine serves finite logprobs with CUDA graphs, and the model takes about 0.85 GiB less (1.16 GiB of bf16 head
    against its tq4 bytes) than with tq4 alone, as vLLM reports it after loading."""
    import re
    from pathlib import Path

    phases = [dict(name="greedy", prompts=_random_prompts(6, (16, 300)), max_tokens=16, ignore_eos=True)]
    common = dict(model=str(CONFIGS / "qwen3-8b"), dummy=True, kv_cache_dtype="auto", max_model_len=2048,
                  enforce_eager=False, gpu_memory_utilization=0.5, phases=phases)
    gib = {}
    for head in (False, True):
        got = engine(engine_kwargs=dict(quantization="tq4", tq_weights_lm_head=head), **common)
        _assert_finite(got)
        assert all(len(t) == 16 for t in _tokens(got))
        gib[head] = float(re.search(r"Model loading took ([\d.]+) GiB", Path(got["log"]).read_text()).group(1))
    assert 0.75 < gib[False] - gib[True] < 0.95, gib


def test_qwen3_30b_a3b_shape_with_tq4_experts(engine):
    """Every linear layer and the 48 layers' experts (128 each, top-8) encoded at load, CUDA graphs on. The dummy
    bf16 weights exist whole on the GPU before they are encoded (about 57 GiB: an 80 GB GPU to itself), then take
    about a quarter of that."""
    phases = [dict(name="greedy", prompts=_random_prompts(5, (16, 300, 1200)), max_tokens=16, ignore_eos=True)]
    got = engine(model=str(CONFIGS / "qwen3-30b-a3b"), dummy=True, kv_cache_dtype="auto", max_model_len=2048,
                 enforce_eager=False, gpu_memory_utilization=0.5, engine_kwargs=dict(quantization="tq4"),
                 phases=phases)
    _assert_finite(got)
    assert all(len(t) == 16 for t in _tokens(got))

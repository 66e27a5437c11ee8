# SPDX-License-Identifier: Apache-2.0
"""End-to-end generation through the patched vLLM with TurboQuant KV caches (GPU, slow).

Set TQ_TEST_MODEL to a local Hugging Face model directory (a small instruct model, e.g. a
Qwen3 or Llama checkpoint; TQ_TEST_SLIDING_MODEL optionally to a Gemma 3 text model). Each
configuration runs in its own process (one engine per process frees the GPU reliably) with a fixed
2 GiB KV pool (no memory profiling, which other engines on the same GPU would disturb), so several
test groups can share one GPU; this file doubles as that process's entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PASSKEY = "73918"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _prompts(num_filler: int) -> list[str]:
    needle = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
    haystack = FILLER * (num_filler // 2) + needle + FILLER * (num_filler - num_filler // 2)
    return [
        "The capital of France is",
        "Write a haiku about the sea:",
        "List the first five prime numbers:",
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        + haystack + "What is the pass key? The pass key is",
    ]


def _passkey_prompts(n: int, num_filler: int) -> tuple[list[str], list[str]]:
    """n needle prompts of the same shape, each with its own pass key."""
    keys = [str(10007 + 7919 * i) for i in range(n)]
    prompts = []
    for i, key in enumerate(keys):
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        cut = (i * 3) % num_filler  # needles at different depths
        prompts.append("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                       + FILLER * cut + needle + FILLER * (num_filler - cut) + "What is the pass key? The pass key is")
    return prompts, keys


def _generate(config: dict) -> dict:
    """Entry point of the child process: build an engine, generate greedily, return tokens."""
    from vllm import LLM, SamplingParams

    if config.get("prompt_set") == "passkeys":
        prompts, keys = _passkey_prompts(config.get("num_prompts", 8), config.get("num_filler", 16))
    else:
        prompts, keys = _prompts(config.get("num_filler", 60)), []
    extra = {}
    max_tokens = config.get("max_tokens", 24)
    if config.get("pool_fraction"):
        # A KV pool smaller than all requests need at once (prompts + their outputs): the scheduler has to
        # preempt running requests and recompute them later.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(config["model"])
        need = sum(len(tok(p).input_ids) + max_tokens for p in prompts)
        block = config.get("block_size", 16)
        extra["num_gpu_blocks_override"] = max(config.get("max_model_len", 8192) // block + 1,
                                               int(config["pool_fraction"] * need) // block)
    if config.get("block_size"):
        extra["block_size"] = config["block_size"]
    llm = LLM(model=config["model"], kv_cache_dtype=config["kv_cache_dtype"],
              max_model_len=config.get("max_model_len", 8192), enforce_eager=config.get("enforce_eager", False),
              enable_prefix_caching=config.get("prefix_caching", True),
              max_num_batched_tokens=config.get("max_num_batched_tokens"), gpu_memory_utilization=0.12, seed=0,
              kv_cache_memory_bytes=2 << 30, disable_log_stats=False, **config.get("engine_kwargs", {}), **extra)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "texts": [o.outputs[0].text for o in outputs], "keys": keys,
              "num_gpu_blocks_override": extra.get("num_gpu_blocks_override"),
              "turboquant": str(llm.llm_engine.vllm_config.cache_config.turboquant)}
    if config.get("repeat"):  # second pass: every prompt is now a prefix-cache hit
        again = llm.generate(prompts, params)
        result["tokens_again"] = [list(o.outputs[0].token_ids) for o in again]
    from vllm.v1.metrics.reader import Counter

    result["preemptions"] = sum(m.value for m in llm.get_metrics()
                                if isinstance(m, Counter) and m.name == "vllm:num_preemptions")
    return result


def run_config(tmp_path: Path, **config) -> dict:
    out = tmp_path / f"result-{abs(hash(json.dumps(config, sort_keys=True)))}.json"
    env = {**os.environ}
    if "v2_runner" in config:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if config["v2_runner"] else "0"
    res = subprocess.run([sys.executable, __file__, json.dumps(config), str(out)], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, f"{config}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return json.loads(out.read_text())


def _model(var: str = "TQ_TEST_MODEL") -> str:
    path = os.environ.get(var)
    if not path:
        pytest.skip(f"set {var} to a local model directory")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return path


def _agree(a: list[int], b: list[int], n: int) -> bool:
    return a[:n] == b[:n]


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return run_config(tmp_path_factory.mktemp("bf16"), model=_model(), kv_cache_dtype="auto", num_filler=60)


@pytest.mark.parametrize("dtype", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                                   "turboquant_3p5bit_nc", "turboquant_2bit_nc"])
def test_greedy_close_to_bf16(bf16, tmp_path, dtype):
    got = run_config(tmp_path, model=_model(), kv_cache_dtype=dtype, num_filler=60)
    # Short factual prompts: the first tokens match bf16 for the 3.5+ bit formats.
    n_agree = sum(_agree(a, b, 4) for a, b in zip(got["tokens"][:3], bf16["tokens"][:3]))
    if dtype != "turboquant_2bit_nc":
        assert n_agree >= 2, (got["texts"], bf16["texts"])
    # Passkey retrieval holds from 3 bits up; at 2 bits this 135M model loses it (eval/results NIAH: 0-10 %),
    # so there the check is only that decoding stays non-degenerate.
    if PASSKEY in bf16["texts"][3] and dtype != "turboquant_2bit_nc":
        assert PASSKEY in got["texts"][3], got["texts"][3]
    for toks in got["tokens"]:
        assert len(set(toks)) > 2, f"degenerate output {toks}"


@pytest.mark.parametrize("v2_runner", [False, True])
def test_chunked_prefill_prefix_cache_and_cuda_graphs(tmp_path, v2_runner):
    """Long prompt in 256-token chunks (cached context through the compressed kernel), then the
    same prompts again as prefix-cache hits; CUDA graphs against eager."""
    model = _model()
    common = dict(model=model, kv_cache_dtype="turboquant_k3v4_nc", num_filler=120, v2_runner=v2_runner)
    graphs = run_config(tmp_path, max_num_batched_tokens=256, repeat=True, **common)
    eager = run_config(tmp_path, max_num_batched_tokens=256, enforce_eager=True, prefix_caching=False, **common)
    whole = run_config(tmp_path, max_num_batched_tokens=8192, prefix_caching=False, **common)
    assert PASSKEY in graphs["texts"][3] or PASSKEY not in whole["texts"][3], graphs["texts"][3]
    # Same cache contents, same kernels: graph replay and eager agree.
    assert sum(_agree(a, b, 16) for a, b in zip(graphs["tokens"], eager["tokens"])) >= 3
    # A prefix-cache hit reads the same compressed pages a chunked prefill wrote.
    assert sum(_agree(a, b, 16) for a, b in zip(graphs["tokens"], graphs["tokens_again"])) >= 3
    # Whole-prompt prefill attends the long prompt in bf16, the chunked one reads earlier chunks from
    # the compressed pages, and the batches differ (vLLM's GEMMs are not batch-invariant): greedy paths
    # may part after a few tokens. Half the prompts still agree over 8 tokens (2 of 4 on an H100, SmolLM2,
    # both model runners); a broken context path fails the pass-key check above first.
    assert sum(_agree(a, b, 8) for a, b in zip(graphs["tokens"], whole["tokens"])) >= 2


@pytest.mark.parametrize("dtype", ["turboquant_k3v4_nc", "turboquant_3p5bit_nc"])
def test_preemption_and_recompute(tmp_path, dtype):
    """A KV pool too small for every request at once: running requests are preempted, their compressed
    pages freed, and later recomputed into new pages. Greedy outputs match a run with room for all."""
    model = _model()
    common = dict(model=model, kv_cache_dtype=dtype, prompt_set="passkeys", num_prompts=8, num_filler=16,
                  max_tokens=96, max_model_len=1024, block_size=16, prefix_caching=False, enforce_eager=True)
    roomy = run_config(tmp_path, **common)
    tight = run_config(tmp_path, pool_fraction=0.55, **common)
    assert roomy["preemptions"] == 0
    assert tight["preemptions"] > 0, tight["num_gpu_blocks_override"]
    # Tokens generated before a preemption are kept; after the recompute, decode reads pages holding the
    # same bytes (the store is deterministic), so the outputs agree up to the rare token that the
    # recompute's prefill (fresh tokens in bf16) and the decode kernel round differently.
    agree = sum(_agree(a, b, 48) for a, b in zip(tight["tokens"], roomy["tokens"]))
    assert agree >= len(roomy["tokens"]) - 1, (tight["texts"], roomy["texts"])
    for key, got, ref in zip(roomy["keys"], tight["texts"], roomy["texts"]):
        if key in ref:
            assert key in got, (key, got)
    for toks in tight["tokens"]:
        assert len(set(toks)) > 2, f"degenerate output {toks}"


def test_tq_options_reach_the_engine(tmp_path):
    """--tq-* options as vllm.LLM keyword arguments land in the engine's CacheConfig.turboquant; with key centering
    and smoothing off the model still answers."""
    got = run_config(tmp_path, model=_model(), kv_cache_dtype="turboquant_k3v4_nc", num_filler=20, max_tokens=8,
                     enforce_eager=True, engine_kwargs=dict(tq_key_centering=False, tq_key_smoothing="off",
                                                            tq_attention_workspace_mb=16))
    assert got["turboquant"] == ("TQConfig(key_centering=False, key_smoothing='off', boundary_layers=0, "
                                 "attention_workspace_mb=16)")
    assert "Paris" in got["texts"][0], got["texts"][0]


def test_sliding_window_model(tmp_path):
    """Gemma 3 style model: sliding layers get TurboQuant pages and their own windows."""
    model = _model("TQ_TEST_SLIDING_MODEL")
    ref = run_config(tmp_path, model=model, kv_cache_dtype="auto", num_filler=120, max_num_batched_tokens=512)
    got = run_config(tmp_path, model=model, kv_cache_dtype="turboquant_4bit_nc", num_filler=120,
                     max_num_batched_tokens=512)
    assert sum(_agree(a, b, 4) for a, b in zip(got["tokens"][:3], ref["tokens"][:3])) >= 2, (got["texts"],
                                                                                               ref["texts"])
    for toks in got["tokens"]:
        assert len(set(toks)) > 2, f"degenerate output {toks}"


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_generate(json.loads(sys.argv[1]))))

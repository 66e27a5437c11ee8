# SPDX-License-Identifier: Apache-2.0
"""An MLA model served end to end with TurboQuant latent caches (GPU, slow): the DeepSeek-V2-Lite shape
(benchmarks/configs/deepseek-v2-lite: 27 layers, kv_lora_rank 512, qk_rope_head_dim 64, MoE) with dummy weights,
vLLM's TURBOQUANT_MLA backend, CUDA graphs on, a fixed 2 GiB KV pool, chunked prefill (prompts longer than a step)
and prefix-cache hits (every prompt again); preemption with recompute in a pool too small for all requests; and ngram
speculative decoding, whose verification steps decode several query tokens per request from the latent pages.

Each configuration runs in its own process (one engine per process frees the GPU reliably); this file doubles as that
process's entry point. Needs a CUDA device; the model needs no download (load_format="dummy", token-id prompts).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "deepseek-v2-lite"
PROMPT_LENS = [12, 40, 100, 300, 700, 1500, 2600, 3500]
POOL_BYTES = 2 << 30
NUM_LAYERS = 27
MAX_TOKENS = 16


def _generate(config: dict) -> dict:
    """Entry point of the child process: build an engine, generate greedily twice (the second pass hits the prefix
    cache), return tokens, their logprobs and the KV pool."""
    import random

    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    period = config.get("prompt_period")  # prompts of one short random pattern repeated: ngram drafts from them
    prompts = []
    for n in config.get("prompt_lens", PROMPT_LENS):
        pattern = [rng.randrange(1000, 30000) for _ in range(period or n)]
        prompts.append({"prompt_token_ids": (pattern * (n // len(pattern) + 1))[:n]})
    extra = {}
    if config.get("num_gpu_blocks"):  # a pool too small for every request at once: the scheduler preempts
        extra = dict(num_gpu_blocks_override=config["num_gpu_blocks"], block_size=16)
    else:
        extra = dict(kv_cache_memory_bytes=POOL_BYTES)
    llm = LLM(model=str(MODEL), load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype=config["kv_cache_dtype"],
              max_model_len=4096, max_num_batched_tokens=1024, enable_prefix_caching=config.get("prefix_caching", True),
              seed=0, enforce_eager=config.get("enforce_eager", False), gpu_memory_utilization=0.9,
              disable_log_stats=False, speculative_config=config.get("speculative_config"), **extra)
    max_tokens = config.get("max_tokens", MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        return tokens, logprobs

    tokens, logprobs = run()
    tokens_again, logprobs_again = run() if config.get("repeat", True) else (None, None)
    cache = llm.llm_engine.vllm_config.cache_config
    from vllm.v1.metrics.reader import Counter

    counters = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            counters[m.name] = counters.get(m.name, 0) + m.value
    return dict(tokens=tokens, logprobs=logprobs, tokens_again=tokens_again, logprobs_again=logprobs_again,
                num_gpu_blocks=cache.num_gpu_blocks, block_size=cache.block_size,
                preemptions=counters.get("vllm:num_preemptions", 0), counters=counters)


def run_config(tmp_path: Path, **config) -> tuple[dict, str]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path / f"result-{abs(hash(json.dumps(config, sort_keys=True)))}.json"
    res = subprocess.run([sys.executable, __file__, json.dumps(config), str(out)], env=dict(os.environ),
                         capture_output=True, text=True, timeout=1800)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{config}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    assert out.is_file(), f"{config}: the child process exited 0 without writing {out.name}\n{log[-3000:]}"
    return json.loads(out.read_text()), log


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return run_config(tmp_path_factory.mktemp("bf16"), kv_cache_dtype="auto")


@pytest.mark.parametrize("dtype", ["turboquant_k3v4_nc", "turboquant_4bit_nc"])
def test_mla_model_serves_from_turboquant_latent_pages(bf16, tmp_path, dtype):
    from turboquant_core.formats import mla_format

    got, log = run_config(tmp_path, kv_cache_dtype=dtype)
    ref, ref_log = bf16
    # vLLM chose our MLA backend, compiled its kernels at start-up and captured CUDA graphs
    assert re.search(r"TURBOQUANT_MLA", log), log[-3000:]
    assert "TurboQuant MLA attention:" in log and "TurboQuant attention: " in log  # (the warm-up's line)
    assert re.search(r"Graph capturing finished", log), log[-3000:]
    # The pool holds what the format table says: 2 GiB / (27 layers x bytes per token), whole blocks
    per_token = mla_format(dtype).bytes_per_token()
    want = POOL_BYTES // (NUM_LAYERS * per_token * got["block_size"]) * got["block_size"]
    have = got["num_gpu_blocks"] * got["block_size"]
    assert abs(have - want) <= 0.02 * want, (have, want)
    bf16_tokens = ref["num_gpu_blocks"] * ref["block_size"]
    assert have / bf16_tokens >= 3.5 if dtype == "turboquant_k3v4_nc" else have / bf16_tokens >= 2.5
    # Every generated token has a finite log-probability, first pass (chunked prefill: prompts past 1024 tokens
    # attend to their earlier chunks through the TurboQuant gather) and second (prefix-cache hits)
    for lps in got["logprobs"] + got["logprobs_again"]:
        assert len(lps) == MAX_TOKENS and all(math.isfinite(v) for v in lps), lps
    # Greedy agreement with bf16 on the same dummy weights, reported (not a floor)
    agree = [_agreeing_prefix(a, b) for a, b in zip(got["tokens"], ref["tokens"])]
    print(f"{dtype}: tokens agreeing with bf16 per prompt (of {MAX_TOKENS}): {agree}; "
          f"KV tokens {have} vs bf16 {bf16_tokens} ({have / bf16_tokens:.2f}x)")


def test_preemption_recomputes_into_new_latent_pages(tmp_path):
    """A pool too small for the eight requests at once: eight 300-token prompts all start (152 blocks of 16), then
    grow by 512 tokens each (408 blocks in all) in the smallest pool vLLM accepts for a 4096-token model (257
    blocks), so running requests are preempted, their pages freed, and recomputed later into other pages. Greedy
    tokens agree with a run that has room for all: the store is deterministic, so recomputed pages hold the same
    bytes."""
    common = dict(kv_cache_dtype="turboquant_k3v4_nc", prompt_lens=[300] * 8, max_tokens=512, prefix_caching=False,
                  repeat=False, enforce_eager=True)
    roomy, _ = run_config(tmp_path, **common)
    tight, _ = run_config(tmp_path, num_gpu_blocks=4096 // 16 + 1, **common)
    assert roomy["preemptions"] == 0 and tight["preemptions"] > 0, (roomy["preemptions"], tight["preemptions"])
    agree = sum(_agreeing_prefix(a, b) >= 48 for a, b in zip(tight["tokens"], roomy["tokens"]))
    assert agree >= 7, [_agreeing_prefix(a, b) for a, b in zip(tight["tokens"], roomy["tokens"])]
    for lps in tight["logprobs"]:
        assert all(math.isfinite(v) for v in lps)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_ngram_verification_decodes_several_query_tokens_from_latent_pages(tmp_path):
    """ngram speculative decoding on the MLA model: each verification step decodes the requests' 1 + 3 query tokens
    from the latent pages (one causal row per token) instead of vLLM's chunked-context prefill. Prompts repeat a short
    pattern, so drafts are proposed from the first step on. Greedy tokens agree with the same cache without
    speculation (verification is exact: a draft token is kept only where it is the greedy one)."""
    common = dict(kv_cache_dtype="turboquant_k3v4_nc", prompt_lens=[48, 200, 700, 1500] * 2, prompt_period=8,
                  max_tokens=32, repeat=False)
    plain, _ = run_config(tmp_path, **common)
    spec, log = run_config(tmp_path, speculative_config=NGRAM, **common)
    assert re.search(r"TURBOQUANT_MLA", log), log[-3000:]
    drafts = spec["counters"].get("vllm:spec_decode_num_draft_tokens", 0)
    assert drafts > 0, spec["counters"]  # verification steps ran
    for lps in spec["logprobs"]:
        assert len(lps) == 32 and all(math.isfinite(v) for v in lps), lps
    agree = [_agreeing_prefix(a, b) for a, b in zip(spec["tokens"], plain["tokens"])]
    print(f"ngram: {drafts} draft tokens, {spec['counters'].get('vllm:spec_decode_num_accepted_tokens', 0)} "
          f"accepted; tokens agreeing with the run without speculation (of 32): {agree}")
    assert sum(a == 32 for a in agree) >= 7, agree


def test_context_mask_warmup_compiles_what_chunked_prefill_steps_launch():
    """vLLM's chunked-context prefill masks the context chunks of the prefills that have none (a step that continues
    a chunked prompt beside new ones) with a Triton kernel of its own. The MLA backend's warm-up compiles its variants,
    so no such step compiles it: steps of any prefill token and request count launch only warmed variants."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from vllm.v1.attention.ops.triton_merge_attn_states import mask_empty_context, mask_empty_context_kernel

    from turboquant_core.vllm.mla_backend import CONTEXT_MASK_SHAPES, warmup_context_mask

    dev = torch.device("cuda")
    heads = 16
    assert warmup_context_mask(heads, dev) == len(CONTEXT_MASK_SHAPES)
    kernel_cache = mask_empty_context_kernel.device_caches[torch.cuda.current_device()][0]
    warmed = set(kernel_cache)
    assert warmed
    for tokens in (2, 3, 8, 16, 17, 48, 1000, 1024, 8184, 8192):
        for reqs in (2, 3, 7, 8, 16, 31, 32, 64):
            if reqs > tokens:
                continue
            lse = torch.zeros(heads, tokens, dtype=torch.float32, device=dev)
            out = torch.ones(tokens, heads, 8, dtype=torch.bfloat16, device=dev)
            starts = torch.tensor([0, *range(1, reqs), tokens], dtype=torch.int32, device=dev)
            # cumulative context offsets: the first request has none, the others 5 tokens each
            context = torch.tensor([0, 0, *range(5, 5 * reqs, 5)], dtype=torch.int32, device=dev)
            mask_empty_context(lse, out, starts, context)
            assert bool(torch.isneginf(lse[:, 0]).all()) and not bool(out[0].any())  # masked: it ran
            assert bool(out[1:].all()), (tokens, reqs)  # the others untouched
    assert set(kernel_cache) == warmed, f"{len(set(kernel_cache) - warmed)} variant(s) compiled after the warm-up"


if __name__ == "__main__":
    cfg, out_path = json.loads(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(_generate(cfg)))

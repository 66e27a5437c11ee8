# SPDX-License-Identifier: Apache-2.0
"""End-to-end generation through the patched vLLM with TurboQuant KV caches (GPU, slow).

Set TQ_TEST_MODEL to a local Hugging Face model directory (a small instruct model, e.g. a
Qwen3 or Llama checkpoint; TQ_TEST_SLIDING_MODEL optionally to a Gemma 3 text model). Each
configuration runs in its own process (one engine per process frees the GPU reliably);
this file doubles as that process's entry point.
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


def _generate(config: dict) -> dict:
    """Entry point of the child process: build an engine, generate greedily, return tokens."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=config["model"], kv_cache_dtype=config["kv_cache_dtype"],
              max_model_len=config.get("max_model_len", 8192), enforce_eager=config.get("enforce_eager", False),
              enable_prefix_caching=config.get("prefix_caching", True),
              max_num_batched_tokens=config.get("max_num_batched_tokens"), gpu_memory_utilization=0.6, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=config.get("max_tokens", 24))
    prompts = _prompts(config.get("num_filler", 60))
    outputs = llm.generate(prompts, params)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "texts": [o.outputs[0].text for o in outputs]}
    if config.get("repeat"):  # second pass: every prompt is now a prefix-cache hit
        again = llm.generate(prompts, params)
        result["tokens_again"] = [list(o.outputs[0].token_ids) for o in again]
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
    if PASSKEY in bf16["texts"][3]:
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
    assert sum(_agree(a, b, 8) for a, b in zip(graphs["tokens"], whole["tokens"])) >= 3


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

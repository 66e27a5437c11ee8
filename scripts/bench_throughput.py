#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Offline-generate throughput and KV capacity of vLLM across KV-cache dtypes, in one run on one GPU (or one
tensor-parallel group of GPUs).

Each configuration runs in its own subprocess (GPU memory is freed between them) with its own
PYTHONPATH, so an unpatched ("stock") and a patched vLLM compare side by side:

    python scripts/bench_throughput.py --model benchmarks/configs/qwen3-8b --scenarios S1 \
        --configs bf16,fp8,stock-k3v4,ours-k3v4 --pythonpath-stock DIR --pythonpath-patched DIR --out s1.json
    python scripts/bench_throughput.py --model benchmarks/configs/qwen3-8b --scenarios sweep --max-num-seqs 512 ...
    python scripts/bench_throughput.py --model benchmarks/configs/llama-3.1-8b --scenarios S3 ...

Configs are NAME=stock|patched:KV_CACHE_DTYPE[+option=value...] (options: the fork's vllm.LLM arguments, e.g.
+tq_decode_kernel=wgmma) or a name (bf16, fp8, ours-<preset>, stock-<preset>; ours-k3v4-register-tile and
ours-k3v4-wgmma: k3v4 on one decode kernel, ours-k3v4-wgmma-plain: the latter with keys not centred); scenarios
INxOUTxBATCH or a name (S1, S2, S3, sweep). A run of several batch sizes at one shape also draws
``<out>-sweep.png``: output tok/s against requests, one line per config.

Dummy weights (load_format="dummy"), prompts as random token ids, greedy, ignore_eos: the numbers measure the
serving engine, not the model's text. Capacity is what vLLM reports ("GPU KV cache size: N tokens").

``--tensor-parallel-size N`` spreads every config's engine over N GPUs (vLLM's ``tensor_parallel_size``; each rank
holds its share of the KV heads, one head replicated where there are fewer heads than ranks). The capacity is then
still the engine's tokens, not a sum over ranks: vLLM sizes each rank's pool from that rank's free memory, gives every
rank the smallest block count of them all (every rank holds every token, for its own heads) and logs the tokens of
that pool once (vLLM 0.26: v1/core/kv_cache_utils.py, ``get_kv_cache_configs``). Ratios are taken against the
baseline run at the same size. ``kv_capacity_expected_tokens`` is the format table's arithmetic for the same pool:
the KV memory vLLM gives a rank ("Available KV cache memory: X GiB", the smallest over the ranks) over the bytes one
token takes on that rank (layers x the rank's KV heads x the dtype's bytes per token and head); it holds for models
whose layers are all full attention (not the sliding-window or hybrid shapes).

Per scenario, with vLLM's stats on (``disable_log_stats=False``; ``--no-engine-stats`` turns them off and drops
these columns): the peak number of running sequences (``SchedulerStats.num_running_reqs`` of every engine step, read
where ``LLMEngine.step`` hands them to its output processor: exact, no polling) and the time per output token from
each request's ``RequestOutput.metrics`` (first and last token times): ``tpot_ms`` averages vLLM's per-request TPOT
((last - first token) / (tokens - 1)), which counts decode steps shared with other requests' prefill chunks;
``tpot_ms_no_prefill`` averages it over the requests whose first token came last, whose decode ran with no prefill of
the scenario left (the decode-only number for S3's 8 x 32k prompts); and the time to first token (vLLM's
``first_token_latency``: ``ttft_ms`` the mean, ``ttft_ms_max`` the largest, for requests sent at once the prefill
phase).

``--speculative-config JSON`` gives every config's engine that speculative decoding (vLLM's ``speculative_config``,
e.g. ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``), and
each scenario then records the draft and accepted tokens; ``--prompt-period N`` makes every prompt one random pattern
of N tokens repeated, so that an ngram drafter proposes from the first step.

``--repeat N`` runs every scenario N times in each engine, in rounds (all scenarios, then all again), on fresh
prompts: the row is the median run by output tok/s, with the range and each run's timings (``repeats``). Scenarios
whose time is mostly prefill vary from run to run; the engine's start-up is most of a config's time, so repeats cost
little.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

# Scenarios by the names the throughput issue and the README use; S3 is meant for a Llama-3.1-8B shape
# (benchmarks/configs/llama-3.1-8b), the others for Qwen3-8B (benchmarks/configs/qwen3-8b).
NAMED_SCENARIOS = {
    "S1": "1024x256x64",
    "S2": "2048x512x384",  # memory-bound: run with --max-num-seqs 512
    "S3": "32768x128x8",
    "sweep": "2048x512x32,2048x512x64,2048x512x128,2048x512x256,2048x512x384,2048x512x512",
    "W": "256x256x1,256x256x8,256x256x64",  # the weights suite: decode-bound batches
}
# Baselines by name; TurboQuant configs are named ours-<preset> / stock-<preset> (see config_names()).
BASELINE_CONFIGS = {"bf16": ("patched", "auto"), "fp8": ("patched", "fp8")}
# Configs that are a preset with engine options (KV_CACHE_DTYPE+option=value: vllm.LLM arguments of the fork).
OPTION_CONFIGS = {"ours-k3v4-register-tile": ("patched", "turboquant_k3v4_nc+tq_decode_kernel=register-tile"),
                  "ours-k3v4-wgmma": ("patched", "turboquant_k3v4_nc+tq_decode_kernel=wgmma"),
                  "ours-k3v4-wgmma-plain": ("patched",
                                            "turboquant_k3v4_nc+tq_decode_kernel=wgmma+tq_key_centering=false")}
DEFAULT_CONFIGS = "bf16,fp8,stock-k3v4,ours-k3v4,ours-k4v3,ours-4bit,ours-2bit"
# The weights suite (--suite weights): NAME -> (install, KV-cache dtype, --quantization). awq-marlin is W4A16 with
# group 128 from a dummy AWQ config (AWQ_DUMMY_CONFIG), served by vLLM's Marlin kernel.
WEIGHT_CONFIGS = {"bf16": ("patched", "auto", None), "fp8": ("patched", "auto", "fp8"),
                  "awq-marlin": ("patched", "auto", "awq_marlin"), "tq4": ("patched", "auto", "tq4"),
                  "tq3": ("patched", "auto", "tq3"), "tq4+k3v4": ("patched", "turboquant_k3v4_nc", "tq4"),
                  "tq4-lm-head": ("patched", "auto+tq_weights_lm_head=true", "tq4"),
                  "tq4-fp16-decode": ("patched", "auto+tq_weights_decode_int8=false", "tq4")}
# The weights issue's configs; tq4-lm-head (the output head encoded too, --tq-weights-lm-head) and tq4-fp16-decode
# (decode products with the fp16 activation, --no-tq-weights-decode-int8) run when named.
DEFAULT_WEIGHT_CONFIGS = "bf16,fp8,awq-marlin,tq4,tq3,tq4+k3v4"
GIB = 1 << 30
AWQ_DUMMY_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def parse_scenarios(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        for one in NAMED_SCENARIOS.get(item.strip(), item).split(","):
            try:
                i, o, b = (int(v) for v in one.lower().split("x"))
            except ValueError:
                raise SystemExit(f"bad scenario {one!r}; expected INxOUTxBATCH (e.g. 1024x256x64) or one of "
                                 f"{', '.join(NAMED_SCENARIOS)}") from None
            out.append((i, o, b))
    return out


def _short(preset: str) -> str:
    """turboquant_k3v4_nc -> k3v4, turboquant_4bit_nc -> 4bit."""
    return preset.removeprefix("turboquant_").removesuffix("_nc")


def config_names() -> dict[str, tuple[str, str]]:
    """Every config name a bare --configs entry may use: bf16, fp8, ours-<preset> for each preset of the format
    table and stock-<preset> for those stock vLLM also has."""
    try:
        from turboquant_core.formats import KV_FORMATS
    except ImportError:  # the script also runs where only vLLM is importable
        KV_FORMATS = {}
    names = dict(BASELINE_CONFIGS)
    for preset, fmt in KV_FORMATS.items():
        names[f"ours-{_short(preset)}"] = ("patched", preset)
        if fmt.origin == "stock":
            names[f"stock-{_short(preset)}"] = ("stock", preset)
    names.update(OPTION_CONFIGS)
    return names


def split_engine_options(spec: str) -> tuple[str, dict]:
    """KV_CACHE_DTYPE[+option=value...] -> (the dtype, vllm.LLM keyword arguments): values true / false become
    booleans and whole numbers ints, e.g. ``turboquant_k3v4_nc+tq_decode_kernel=wgmma+tq_key_centering=false``."""
    dtype, *items = spec.split("+")
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not (key and eq and value):
            raise SystemExit(f"bad engine option {item!r} in {spec!r}; expected option=value")
        low = value.lower()
        options[key] = low == "true" if low in ("true", "false") else int(value) if value.isdigit() else value
    return dtype, options


def parse_configs(text: str) -> list[tuple[str, str, str]]:
    out = []
    named = None
    for item in text.split(","):
        name, eq, rest = item.strip().partition("=")
        if not eq:
            named = named if named is not None else config_names()
            if name not in named:
                raise SystemExit(f"unknown config {name!r}; expected NAME=stock|patched:KV_CACHE_DTYPE or one of "
                                 f"{', '.join(named)}")
            out.append((name, *named[name]))
            continue
        install, _, dtype = rest.partition(":")
        if not (name and install in ("stock", "patched") and dtype):
            raise SystemExit(f"bad config {item!r}; expected NAME=stock|patched:KV_CACHE_DTYPE[+option=value...]")
        split_engine_options(dtype)  # a bad option fails here, before any engine starts
        out.append((name, install, dtype))
    return out


def parse_weight_configs(text: str) -> list[tuple[str, str, str, str | None]]:
    """--suite weights: names of WEIGHT_CONFIGS, or NAME=stock|patched:KV_CACHE_DTYPE:QUANTIZATION."""
    out = []
    for item in text.split(","):
        name, eq, rest = item.strip().partition("=")
        if not eq:
            if name not in WEIGHT_CONFIGS:
                names = ", ".join(WEIGHT_CONFIGS)
                raise SystemExit(f"unknown weights config {name!r}; expected "
                                 f"NAME=stock|patched:KV_CACHE_DTYPE:QUANTIZATION or one of {names}")
            out.append((name, *WEIGHT_CONFIGS[name]))
            continue
        install, _, tail = rest.partition(":")
        dtype, _, quant = tail.partition(":")
        if not (name and install in ("stock", "patched") and dtype):
            raise SystemExit(f"bad config {item!r}; expected NAME=stock|patched:KV_CACHE_DTYPE:QUANTIZATION")
        out.append((name, install, dtype, quant or None))
    return out


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace, scenarios: list[tuple[int, int, int]]) -> dict:
    """vllm.LLM arguments for one config serving ``scenarios`` (scripts/profile_decode.py builds its engine with
    these too). ``args`` needs model, kv_cache_dtype, max_num_seqs (0: the largest batch), gpu_memory_utilization,
    enforce_eager, max_num_batched_tokens and cudagraph_sizes (comma list, empty: vLLM's); tensor_parallel_size
    when it has one (else 1)."""
    kv_cache_dtype, options = split_engine_options(args.kv_cache_dtype)
    max_model_len = max(i + o for i, o, _ in scenarios) + 16
    max_num_seqs = args.max_num_seqs or max(b for _, _, b in scenarios)
    kwargs = dict(
        model=args.model, load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False, seed=0,
        enforce_eager=args.enforce_eager,
        # No more than the batch can hold: vLLM's dummy steps spread a full step over max_num_seqs requests, and
        # requests longer than max_model_len run past their block tables (an illegal address at start-up, bf16 too).
        max_num_batched_tokens=min(args.max_num_batched_tokens, max_num_seqs * max_model_len),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), **options,
    )
    if getattr(args, "speculative_config", None):
        kwargs["speculative_config"] = json.loads(args.speculative_config)
    quantization = getattr(args, "quantization", None)
    if quantization:
        kwargs["quantization"] = quantization
        if quantization == "awq_marlin":  # dummy weights in AWQ's layout: the checkpoint config says what they are
            kwargs["hf_overrides"] = {"quantization_config": dict(AWQ_DUMMY_CONFIG)}
    # Every kernel compiled after vLLM's warm-up is logged with its specialization (by default only the first).
    kwargs["jit_monitor_verbose"] = True
    compilation = {}
    if args.cudagraph_sizes:
        # Fewer capture sizes start the engine faster; decode batches pad up to the next size.
        compilation["cudagraph_capture_sizes"] = [int(v) for v in args.cudagraph_sizes.split(",")]
    if getattr(args, "no_allreduce_rms_fusion", False):
        # vLLM fuses all-reduce + RMSNorm at TP > 1 on Hopper through FlashInfer's mnnvl workspace; without NVLink
        # multicast stock vLLM 0.26.0 hangs there (vllm#48071; the fork's patch 0012 turns the fusion off itself).
        compilation["pass_config"] = {"fuse_allreduce_rms": False}
    if compilation:
        kwargs["compilation_config"] = compilation
    return kwargs


def kv_bytes_per_token_per_head(kv_cache_dtype: str, head_dim: int, mla: tuple[int, int] | None = None) -> int | None:
    """K+V bytes one token takes per KV head: the format table for turboquant_*, 2*2*head_dim for bf16/fp16/auto,
    2*head_dim for fp8; None when unknown. MLA layers (``mla`` = (kv_lora_rank, rope_dim); one "KV head" of
    head_dim = their sum) cache one entry per token: the format table's MLA entry, 2*head_dim for bf16, head_dim for
    fp8."""
    if mla is not None:
        if kv_cache_dtype in ("auto", "bfloat16", "float16", "half"):
            return 2 * head_dim
        if kv_cache_dtype.startswith("fp8"):
            return head_dim
        try:
            from turboquant_core.formats import KV_FORMATS, mla_format
        except ImportError:
            return None
        return mla_format(kv_cache_dtype, *mla).bytes_per_token() if kv_cache_dtype in KV_FORMATS else None
    if kv_cache_dtype in ("auto", "bfloat16", "float16", "half"):
        return 2 * 2 * head_dim
    if kv_cache_dtype.startswith("fp8"):
        return 2 * head_dim
    try:
        from turboquant_core.formats import KV_FORMATS
    except ImportError:
        return None
    fmt = KV_FORMATS.get(kv_cache_dtype)
    return fmt.bytes_per_token_per_head(head_dim) if fmt else None


def expected_kv_tokens(kv_cache_dtype: str, kv_shape: dict, kv_cache_bytes: int) -> int | None:
    """Tokens a pool of ``kv_cache_bytes`` on one rank holds by the format table: ``kv_shape`` is the rank's (layers,
    kv_heads, head_dim, mla: [kv_lora_rank, rope_dim] or None, as the worker records it); None for an unknown dtype.
    Every layer is taken to cache every token (full attention)."""
    mla = kv_shape.get("mla")
    per_head = kv_bytes_per_token_per_head(kv_cache_dtype, kv_shape["head_dim"], tuple(mla) if mla else None)
    if not per_head:
        return None
    return kv_cache_bytes // (kv_shape["layers"] * kv_shape["kv_heads"] * per_head)


def worker_env(args: argparse.Namespace, install: str) -> dict[str, str]:
    """The environment of a config's subprocess: its vLLM install first on PYTHONPATH, offline, no FlashInfer
    sampler (as every run of this script had)."""
    env = dict(os.environ)
    pp = args.pythonpath_stock if install == "stock" else args.pythonpath_patched
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pp, env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class RunningPeak:
    """The largest ``num_running_reqs`` of vLLM's per-step ``SchedulerStats`` since the last ``reset()``.

    ``attach(llm)`` wraps ``llm.llm_engine.output_processor.update_scheduler_stats``, which ``LLMEngine.step``
    calls once per engine step with that step's stats (vLLM 0.26: v1/engine/llm_engine.py, ``step``): one ``max``
    per step in the front-end process, nothing polled. The stats exist only with ``disable_log_stats=False``."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self.steps = 0

    def reset(self) -> None:
        self.peak, self.steps = None, 0

    def observe(self, stats) -> None:
        n = getattr(stats, "num_running_reqs", None)
        if n is None:
            return
        self.steps += 1
        self.peak = n if self.peak is None else max(self.peak, n)

    @classmethod
    def attach(cls, llm) -> RunningPeak | None:
        proc = getattr(getattr(llm, "llm_engine", None), "output_processor", None)
        update = getattr(proc, "update_scheduler_stats", None)
        if update is None:
            return None
        tracker = cls()

        def update_and_observe(scheduler_stats, *a, **kw):
            tracker.observe(scheduler_stats)
            return update(scheduler_stats, *a, **kw)

        proc.update_scheduler_stats = update_and_observe
        return tracker


def request_timings(outputs) -> list[tuple[float, float, int]]:
    """(first token time, last token time, generated tokens) of each RequestOutput whose ``metrics`` (vLLM's
    ``RequestStateStats``, set with log stats on) has them."""
    rows = []
    for o in outputs:
        m = getattr(o, "metrics", None)
        if m is not None and hasattr(m, "first_token_ts") and hasattr(m, "last_token_ts"):
            rows.append((float(m.first_token_ts), float(m.last_token_ts), int(m.num_generation_tokens)))
    return rows


def ttft_stats(outputs) -> dict:
    """Time to first token from each RequestOutput's ``metrics.first_token_latency`` (vLLM's TTFT, seconds):
    ``ttft_ms`` the mean, ``ttft_ms_max`` the largest; for a scenario's requests sent at once the largest is the
    prefill phase, where a scenario that loses with level decode steps loses its time. Requests without one are
    left out; none left: {}."""
    lat = [float(m.first_token_latency) for o in outputs
           if (m := getattr(o, "metrics", None)) is not None and getattr(m, "first_token_latency", 0.0) > 0]
    if not lat:
        return {}
    return dict(ttft_ms=1e3 * sum(lat) / len(lat), ttft_ms_max=1e3 * max(lat))


def tpot_stats(timings: Iterable[tuple[float, float, int]]) -> dict:
    """Time per output token apart from prefill, from (first token time, last token time, generated tokens) per
    request (seconds, one clock):

    - ``tpot_ms``: the mean of vLLM's per-request TPOT, (last - first) / (tokens - 1) (the first token is the
      prefill's); a request's decode steps may carry other requests' prefill chunks;
    - ``tpot_ms_no_prefill``: the same mean over the requests whose first token came last (same step): when they
      decode, every request of the scenario has finished its prefill.

    Requests with fewer than two tokens or no timestamps are left out; none left: {}."""
    rows = [(f, l, n) for f, l, n in timings if n > 1 and f > 0 and l >= f]
    if not rows:
        return {}
    per = [(l - f) / (n - 1) for f, l, n in rows]
    last_first = max(f for f, _, _ in rows)
    late = [t for t, (f, _, _) in zip(per, rows) if f == last_first]
    return dict(tpot_ms=1e3 * sum(per) / len(per), tpot_ms_no_prefill=1e3 * sum(late) / len(late),
                tpot_requests=len(rows), tpot_requests_no_prefill=len(late))


def embedding_gib_per_rank(text_config, dtype_bytes: int, tensor_parallel_size: int) -> float:
    """GiB of one rank's input embedding and output head (one table when tied), which every config of the weights
    suite keeps in the model's dtype: what "linears vs bf16" takes out of the weights vLLM reports."""
    tables = 1 if getattr(text_config, "tie_word_embeddings", False) else 2
    return tables * text_config.vocab_size * text_config.hidden_size * dtype_bytes / tensor_parallel_size / GIB


def prompt_ids(rng, n: int, period: int = 0) -> list[int]:
    """n random token ids, or (``period``) one random pattern of that many tokens repeated to n."""
    pattern = [rng.randrange(1000, 30000) for _ in range(min(period, n) if period else n)]
    return (pattern * (n // max(len(pattern), 1) + 1))[:n]


def spec_counts(llm) -> dict[str, int]:
    """The engine's speculative-decoding counters so far: draft and accepted tokens."""
    from vllm.v1.metrics.reader import Counter

    names = {"vllm:spec_decode_num_draft_tokens": "spec_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "spec_accepted_tokens"}
    out = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += int(m.value)
    return out


def run_scenario(llm, rng, running, args, n_in: int, n_out: int, batch: int) -> dict:
    """One timed run of a scenario: ``batch`` random prompts of ``n_in`` tokens sent at once, ``n_out`` tokens each."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": prompt_ids(rng, n_in, args.prompt_period)} for _ in range(batch)]
    sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
    if running is not None:
        running.reset()
    spec0 = spec_counts(llm) if args.speculative_config and not args.no_engine_stats else None
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    el = time.perf_counter() - t
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    row = dict(input_len=n_in, output_len=n_out, batch=batch, elapsed_s=el, output_tokens=n_gen,
               output_tok_per_s=n_gen / el, total_tok_per_s=(n_gen + n_in * batch) / el)
    if spec0 is not None:
        row.update({k: v - spec0[k] for k, v in spec_counts(llm).items()})
    if running is not None and running.peak is not None:
        row["peak_running_seqs"] = running.peak
    row.update(tpot_stats(request_timings(outs)))
    row.update(ttft_stats(outs))
    return row


REPEAT_KEYS = ("elapsed_s", "output_tok_per_s", "ttft_ms", "ttft_ms_max", "tpot_ms", "tpot_ms_no_prefill")


def aggregate_repeats(runs: list[dict]) -> dict:
    """A scenario's runs (``--repeat``) -> its row: the median run by output tok/s (the lower of the two middle
    ones for an even count), and with more than one run the range of output tok/s and each run's timings in
    ``repeats``."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["output_tok_per_s"])
    row = dict(runs[order[(len(runs) - 1) // 2]])
    if len(runs) > 1:
        row["output_tok_per_s_min"] = runs[order[0]]["output_tok_per_s"]
        row["output_tok_per_s_max"] = runs[order[-1]]["output_tok_per_s"]
        row["repeats"] = [{k: r[k] for k in REPEAT_KEYS if k in r} for r in runs]
    return row


def worker(args: argparse.Namespace) -> None:
    """Runs inside one subprocess: one engine, every scenario, one JSON line on stdout."""
    import random

    from vllm import LLM, SamplingParams

    scenarios = parse_scenarios(args.scenarios)
    kwargs = engine_kwargs(args, scenarios)
    max_len = kwargs["max_model_len"]
    if not args.no_engine_stats:
        kwargs["disable_log_stats"] = False  # LLM's default is True: no SchedulerStats, no RequestOutput.metrics
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    running = None if args.no_engine_stats else RunningPeak.attach(llm)
    vc = llm.llm_engine.vllm_config
    cache, mc, pc = vc.cache_config, vc.model_config, vc.parallel_config
    # One rank's share of the KV cache: what the format table's bytes per token are multiplied by.
    kv_shape = dict(layers=mc.get_num_layers(pc), kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size(),
                    mla=[mc.hf_text_config.kv_lora_rank, mc.hf_text_config.qk_rope_head_dim] if mc.use_mla else None)
    embedding_gib = embedding_gib_per_rank(mc.hf_text_config, mc.dtype.itemsize, pc.tensor_parallel_size)
    head_encoded = bool(getattr(getattr(cache, "turboquant", None), "weights_lm_head", False))
    rng = random.Random(0)
    # Warm-up outside the timed region: a short prompt (prefill + decode kernels), a batch whose prefill (8 x 256
    # tokens) runs past the usual CUDA-graph sizes, eagerly, and, where it fits, a prompt longer than a scheduler
    # step, so chunked prefill's cached-context path is compiled too. Kernels compiled here after vLLM's own
    # warm-up still show in the JIT monitor's list.
    warm = [64] + [min(256, max_len - 16)] * min(8, kwargs["max_num_seqs"])
    warm += [kwargs["max_num_batched_tokens"] + 64] if kwargs["max_num_batched_tokens"] + 72 <= max_len else []
    llm.generate([{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(n)]} for n in warm],
                 SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    runs: list[list[dict]] = [[] for _ in scenarios]
    for _ in range(args.repeat):  # rounds of every scenario, so that no scenario always runs first
        for i, (n_in, n_out, batch) in enumerate(scenarios):
            runs[i].append(run_scenario(llm, rng, running, args, n_in, n_out, batch))
    rows = [aggregate_repeats(r) for r in runs]
    import torch
    import vllm

    result = dict(device=torch.cuda.get_device_name(0), num_devices=torch.cuda.device_count(),
                  vllm_version=vllm.__version__, startup_s=startup, tensor_parallel_size=pc.tensor_parallel_size,
                  num_gpu_blocks=cache.num_gpu_blocks, block_size=cache.block_size, kv_shape=kv_shape,
                  embedding_gib=embedding_gib, **({"output_head_encoded": True} if head_encoded else {}),
                  engine_stats=not args.no_engine_stats, scenarios=rows)
    print("TQ_BENCH_RESULT " + json.dumps(result), flush=True)


def run_engine_process(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[str, str, int | str]:
    """(stdout, stderr, return code or "timeout") of one engine's subprocess, run in its own process group: on a
    timeout the engine's worker processes go too (else they keep the GPU memory and every later config fails to
    start)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return out, err, p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return out, err, "timeout"


JIT_WHILE_SERVING = re.compile(r"Triton kernel JIT compilation during inference: (\w+)(?: \((.*?)\))?\. This causes")


def jit_while_serving(log: str, detail_chars: int = 600) -> list[dict]:
    """The Triton kernels vLLM's JIT monitor saw compiled after the engine's warm-up (each a latency spike while
    serving), in order: [{"kernel": name, "detail": its constexprs and signature, cut to ``detail_chars``}]."""
    return [dict(kernel=m.group(1), detail=(m.group(2) or "")[:detail_chars]) for m in JIT_WHILE_SERVING.finditer(log)]


def run_config(args, name: str, install: str, dtype: str, log_dir: Path, quantization: str | None = None) -> dict:
    env = worker_env(args, install)
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--kv-cache-dtype", dtype,
           *(["--quantization", quantization] if quantization else []),
           "--scenarios", args.scenarios, "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--cudagraph-sizes", args.cudagraph_sizes,
           "--max-num-seqs", str(args.max_num_seqs), "--tensor-parallel-size", str(args.tensor_parallel_size),
           "--prompt-period", str(args.prompt_period), "--repeat", str(args.repeat)]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.no_engine_stats:
        cmd.append("--no-engine-stats")
    if args.no_allreduce_rms_fusion:
        cmd.append("--no-allreduce-rms-fusion")
    tp = f", tensor_parallel_size={args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"[bench] {name}: {install} vLLM, kv_cache_dtype={dtype}{tp}", flush=True)
    t = time.perf_counter()
    out, err, rc = run_engine_process(cmd, env, args.timeout)
    (log_dir / f"{name}.log").write_text(out + "\n--- stderr ---\n" + err)
    dtype, options = split_engine_options(dtype)
    row = dict(name=name, install=install, kv_cache_dtype=dtype, tensor_parallel_size=args.tensor_parallel_size,
               wall_s=time.perf_counter() - t, returncode=rc, **({"engine_options": options} if options else {}))
    if quantization:
        row["quantization"] = quantization
    # Logged once by the engine core for the whole engine (every rank holds that many tokens): not per rank summed.
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", out + err)
    if m:
        row["kv_capacity_tokens"] = int(m.group(1).replace(",", ""))
    # Logged by each rank's worker; the engine's pool is the smallest rank's.
    per_rank = [float(v) for v in re.findall(r"Available KV cache memory: ([\d.]+) GiB", out + err)]
    if per_rank:
        row["kv_cache_gib_per_rank"] = min(per_rank)
    jit = jit_while_serving(out + err)
    if jit:
        row["jit_while_serving"] = jit
    m = re.search(r"Model loading took ([\d.]+) GiB", out + err)
    if m:
        row["weight_gib"] = float(m.group(1))
    res = [ln for ln in out.splitlines() if ln.startswith("TQ_BENCH_RESULT ")]
    if res:
        row.update(json.loads(res[-1].split(" ", 1)[1]))
        if row.get("kv_cache_gib_per_rank") and row.get("kv_shape"):
            expected = expected_kv_tokens(dtype, row["kv_shape"], int(row["kv_cache_gib_per_rank"] * GIB))
            if expected:
                row["kv_capacity_expected_tokens"] = expected
    else:
        tail = [ln for ln in err.splitlines() if ln.strip()][-6:]
        row["error"] = " | ".join(tail)[-1500:]
    print(f"[bench] {name}: " + (f"ok in {row['wall_s']:.0f}s" if res else f"FAILED: {row.get('error', '')[-300:]}"),
          flush=True)
    return row


def _opt(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _tp(row: dict) -> int:
    """A row's tensor-parallel size (rows of runs before the option: 1)."""
    return row.get("tensor_parallel_size", 1)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def summarize(rows: list[dict], baseline: str) -> str:
    """The markdown table of a run. Each row is compared with the baseline of its own tensor-parallel size; a TP
    column appears when any row ran on more than one GPU, a "vs format table" column (capacity over
    ``kv_capacity_expected_tokens``) when any row has that number, a "runs" column (how many, and the range of
    output tok/s) when a scenario ran more than once (``--repeat``)."""
    bases = {_tp(r): r for r in rows if r["name"] == baseline and "scenarios" in r}
    show_tp = any(_tp(r) != 1 for r in rows)
    show_expected = any(r.get("kv_capacity_expected_tokens") for r in rows)
    show_spec = any("spec_draft_tokens" in s for r in rows for s in r.get("scenarios", []))
    show_range = any("repeats" in s for r in rows for s in r.get("scenarios", []))
    head = ["config", "install", *(["TP"] if show_tp else []), "kv_cache_dtype", "scenario", "output tok/s",
            *(["runs: min-max"] if show_range else []), "vs bf16", "KV capacity (tokens)", "vs bf16",
            *(["vs format table"] if show_expected else []), "peak running", "TTFT ms, max", "TPOT ms",
            "TPOT ms, no prefill", *(["drafts accepted / proposed"] if show_spec else [])]

    def line(cells: list) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    lines = [line(head), "|" + "---|" * len(head)]
    for r in rows:
        lead = [r["name"], r["install"], *([_tp(r)] if show_tp else []), r["kv_cache_dtype"]]
        if "scenarios" not in r:
            lines.append(line(lead + ["-", "failed"] + ["-"] * (len(head) - len(lead) - 2)))
            continue
        base = bases.get(_tp(r))
        cap, base_cap = r.get("kv_capacity_tokens"), base.get("kv_capacity_tokens") if base else None
        for i, s in enumerate(r["scenarios"]):
            bs = base["scenarios"][i]["output_tok_per_s"] if base else None
            lines.append(line(lead + [
                f"{s['input_len']}/{s['output_len']}/{s['batch']}", f"{s['output_tok_per_s']:.0f}",
                *([f"{len(s['repeats'])}: {s['output_tok_per_s_min']:.0f}-{s['output_tok_per_s_max']:.0f}"
                   if "repeats" in s else "1"] if show_range else []),
                _ratio(s["output_tok_per_s"], bs), cap or "-", _ratio(cap, base_cap),
                *([_ratio(cap, r.get("kv_capacity_expected_tokens"))] if show_expected else []),
                _opt(s.get("peak_running_seqs"), "d"), _opt(s.get("ttft_ms_max"), ".0f"), _opt(s.get("tpot_ms"), ".1f"),
                _opt(s.get("tpot_ms_no_prefill"), ".1f"),
                *([f"{s['spec_accepted_tokens']} / {s['spec_draft_tokens']}" if "spec_draft_tokens" in s else "-"]
                  if show_spec else [])]))
    weights = [r for r in rows if r.get("weight_gib")]
    if weights:  # the weights suite: model memory as vLLM reports it after loading (one rank's under TP)
        lines += ["", "| config | --quantization | weights GiB | vs bf16 | linears vs bf16 |", "|---|---|---|---|---|"]
        for r in weights:
            bw = bases[_tp(r)].get("weight_gib") if _tp(r) in bases else None
            # Without the embedding and head (bf16 in every config): the layers --quantization encodes.
            emb = r.get("embedding_gib")
            linears = (r["weight_gib"] - emb) / (bw - emb) if bw and emb is not None and bw > emb else None
            if r.get("output_head_encoded"):  # its head is not among what the ratio leaves out
                linears = None
            lines.append(line([r["name"], r.get("quantization") or "-", f"{r['weight_gib']:.2f}",
                               f"{r['weight_gib'] / bw:.3f}" if bw else "-", _opt(linears, ".3f")]))
    jit = [(r["name"], r["jit_while_serving"]) for r in rows if r.get("jit_while_serving")]
    if jit:  # kernels the warm-up missed: their first launch while serving compiled them
        lines += ["", "Kernels compiled while serving (vLLM's JIT monitor): "
                  + "; ".join(f"{name}: " + ", ".join(sorted({e['kernel'] for e in events})) + f" ({len(events)})"
                              for name, events in jit)]
    return "\n".join(lines)


def plot(rows: list[dict], baseline: str, path: Path) -> bool:
    """Bar chart: output tok/s and KV capacity relative to the baseline, per config and scenario."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    base = next((r for r in rows if r["name"] == baseline and "scenarios" in r), None)
    ok = [r for r in rows if "scenarios" in r]
    if base is None or not ok:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(base["scenarios"]), 1)
    for i, s in enumerate(base["scenarios"]):
        ratios = [r["scenarios"][i]["output_tok_per_s"] / s["output_tok_per_s"] for r in ok]
        xs = [j + i * width for j in range(len(ok))]
        axes[0].bar(xs, ratios, width, label=f"{s['input_len']} in / {s['output_len']} out / batch {s['batch']}")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel(f"output tok/s vs {baseline}")
    # above the axes: inside, it covers the first config's bars
    axes[0].legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.02), ncol=2, frameon=False)
    caps = [(r.get("kv_capacity_tokens") or 0) / (base.get("kv_capacity_tokens") or 1) for r in ok]
    axes[1].bar(range(len(ok)), caps, 0.6, color="tab:green")
    axes[1].set_ylabel(f"KV capacity (tokens) vs {baseline}")
    for ax in axes:
        ax.set_xticks([j + (len(base["scenarios"]) - 1) * width / 2 if ax is axes[0] else j for j in range(len(ok))])
        ax.set_xticklabels([r["name"] for r in ok], rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sweep_series(rows: list[dict]) -> tuple[tuple[int, int] | None, dict[str, list[tuple[int, float]]]]:
    """The most common (input, output) lengths and, per config, (requests, output tok/s) of its scenarios with
    them (a concurrency sweep); configs with fewer than three such scenarios are left out."""
    from collections import Counter

    shapes = Counter((s["input_len"], s["output_len"]) for r in rows if "scenarios" in r for s in r["scenarios"])
    if not shapes:
        return None, {}
    shape, _ = shapes.most_common(1)[0]
    series = {r["name"]: sorted((s["batch"], s["output_tok_per_s"]) for s in r.get("scenarios", [])
                                if (s["input_len"], s["output_len"]) == shape) for r in rows}
    return shape, {k: v for k, v in series.items() if len(v) >= 3}


def plot_sweep(rows: list[dict], path: Path) -> bool:
    """Output tok/s against the number of requests, one line per config: where each dtype starts to win."""
    shape, series = sweep_series(rows)
    if not series:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xlabel("requests")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{shape[0]} in / {shape[1]} out")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def merge_results(files: list[Path], out: Path) -> Path:
    """One results file from runs of disjoint configs (``--report-only A B ...``): the same model, scenarios and
    tensor-parallel size, every row on the same GPU model; the merged file lists each source's command and date."""
    if out.resolve() in {f.resolve() for f in files}:
        raise SystemExit(f"--out {out} is one of the files to merge; give another")
    docs = [json.loads(f.read_text()) for f in files]
    for key in ("model", "scenarios", "tensor_parallel_size"):
        values = {json.dumps(d.get(key)) for d in docs}
        if len(values) > 1:
            raise SystemExit(f"cannot merge runs of different {key}: {', '.join(sorted(values))}")
    rows = [r for d in docs for r in d["results"]]
    names = [r["name"] for r in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"cannot merge: configs in more than one file: {twice}")
    devices = {r.get("device") for r in rows if "scenarios" in r}
    if len(devices) > 1:
        raise SystemExit(f"cannot merge runs on different GPUs: {', '.join(sorted(map(str, devices)))}")
    doc = dict(date=max(d.get("date", "") for d in docs), command=" ".join(sys.argv), model=docs[0].get("model"),
               scenarios=docs[0].get("scenarios"), tensor_parallel_size=docs[0].get("tensor_parallel_size", 1),
               merged_from=[dict(file=f.name, command=d.get("command"), date=d.get("date"),
                                 configs=[r["name"] for r in d["results"]]) for f, d in zip(files, docs)],
               results=rows)
    out.write_text(json.dumps(doc, indent=1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (a config.json is enough with dummy weights)")
    ap.add_argument("--suite", choices=("kv", "weights"), default="kv",
                    help="kv: configs are KV-cache dtypes (names below); weights: configs are weight quantizations "
                         f"({', '.join(WEIGHT_CONFIGS)}; default all; scenario W=256x256x1,8,64)")
    ap.add_argument("--configs", default=None,
                    help="comma list of NAME=stock|patched:KV_CACHE_DTYPE[+option=value...] or names: bf16, fp8, "
                         "ours-<preset> (every preset, e.g. ours-k3v4, ours-4bit), stock-<preset> (stock's presets), "
                         f"{', '.join(OPTION_CONFIGS)}; with "
                         "--suite weights NAME=stock|patched:KV_CACHE_DTYPE:QUANTIZATION or the names of that suite "
                         "(default: every config of the suite)")
    ap.add_argument("--scenarios", default="1024x256x64,8192x256x32",
                    help="comma list of INxOUTxBATCH or names: "
                         + ", ".join(f"{k}={v}" for k, v in NAMED_SCENARIOS.items()))
    ap.add_argument("--max-num-seqs", type=int, default=0, help="vLLM's max_num_seqs (0: the largest batch)")
    ap.add_argument("--speculative-config", default="",
                    help="vLLM's speculative_config as JSON for every config's engine (e.g. an ngram drafter)")
    ap.add_argument("--prompt-period", type=int, default=0,
                    help="prompts of one random pattern of this many tokens, repeated (0: random throughout)")
    ap.add_argument("--repeat", type=positive_int, default=1,
                    help="run every scenario N times in each engine (in rounds); the table shows the median run by "
                         "output tok/s and the range")
    ap.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                    help="GPUs each config's engine is spread over (vLLM's tensor_parallel_size; default 1)")
    ap.add_argument("--baseline", default="bf16", help="config name the ratios are taken against")
    ap.add_argument("--pythonpath-stock", default="")
    ap.add_argument("--pythonpath-patched", default="")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cudagraph-sizes", default="", help="comma list of CUDA-graph capture sizes (default: vLLM's)")
    ap.add_argument("--no-allreduce-rms-fusion", action="store_true",
                    help="turn off vLLM's all-reduce + RMSNorm fusion (TP > 1 on Hopper), which needs NVLink multicast")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--no-engine-stats", action="store_true",
                    help="leave vLLM's stats off (as before): no peak running / TPOT columns")
    ap.add_argument("--out", default="throughput.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an existing --out file and run only configs it does not have")
    ap.add_argument("--report-only", metavar="JSON", nargs="+",
                    help="rewrite the markdown table and plots of a results file; several files (runs of one model, "
                         "scenarios and GPU model, e.g. configs split over the GPUs of one host) are merged into --out "
                         "first")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report_only:
        src = Path(args.report_only[0])
        if len(args.report_only) > 1:
            src = merge_results([Path(f) for f in args.report_only], Path(args.out))
        rows = json.loads(src.read_text())["results"]
        src.with_suffix(".md").write_text(summarize(rows, args.baseline) + "\n")
        plot(rows, args.baseline, src.with_suffix(".png"))
        plot_sweep(rows, src.with_name(src.stem + "-sweep.png"))
        print(summarize(rows, args.baseline))
        return 0
    parse_scenarios(args.scenarios)
    if args.speculative_config:
        try:
            if not isinstance(json.loads(args.speculative_config), dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise SystemExit(f"--speculative-config must be a JSON object (vLLM's speculative_config), got "
                             f"{args.speculative_config!r}: {e}") from None
    if args.suite == "weights":
        configs = parse_weight_configs(args.configs or DEFAULT_WEIGHT_CONFIGS)
    else:
        configs = [(*c, None) for c in parse_configs(args.configs or DEFAULT_CONFIGS)]
    out = Path(args.out)
    log_dir = out.with_suffix("").with_name(out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.resume and out.exists():
        earlier = json.loads(out.read_text())
        # Capacities and ratios compare engines of one tensor-parallel size: do not mix sizes in one file.
        if earlier.get("tensor_parallel_size", 1) != args.tensor_parallel_size:
            raise SystemExit(f"--resume: {out} was run with --tensor-parallel-size "
                             f"{earlier.get('tensor_parallel_size', 1)}, this run has {args.tensor_parallel_size}; "
                             "give another --out")
        rows = [r for r in earlier["results"] if "scenarios" in r]
    done = {r["name"] for r in rows}
    for name, install, dtype, quantization in configs:
        if name in done:
            print(f"[bench] {name}: kept from {out}", flush=True)
            continue
        rows.append(run_config(args, name, install, dtype, log_dir, quantization))
        doc = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv),
                   model=args.model, scenarios=args.scenarios, tensor_parallel_size=args.tensor_parallel_size,
                   **({"speculative_config": json.loads(args.speculative_config)} if args.speculative_config else {}),
                   **({"prompt_period": args.prompt_period} if args.prompt_period else {}),
                   **({"repeat": args.repeat} if args.repeat > 1 else {}), results=rows)
        out.write_text(json.dumps(doc, indent=1))  # after every config: a killed run keeps what it has
    table = summarize(rows, args.baseline)
    out.with_suffix(".md").write_text(table + "\n")
    plot(rows, args.baseline, out.with_suffix(".png"))
    plot_sweep(rows, out.with_name(out.stem + "-sweep.png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

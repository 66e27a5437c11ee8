#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where the time of one steady-state decode step goes, per KV-cache dtype: CUDA kernel time by family (attention,
split merge, KV store, key centring, GEMM, ...) from torch.profiler, against host wall time and simple bandwidth
limits, for the configs and scenarios of scripts/bench_throughput.py.

    python scripts/profile_decode.py --configs bf16,ours-k3v4 --scenarios S1,S2 --out profile-decode
    python scripts/profile_decode.py --suite weights --configs bf16,awq-marlin,tq4 --scenarios 256x256x1 --out p
    python scripts/profile_decode.py --report-only profile-decode/profile.json

Method. One subprocess per config (its PYTHONPATH as in bench_throughput: --pythonpath-stock/--pythonpath-patched)
builds ``vllm.LLM`` in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine core, the scheduler and the model
runner run in that process and the profiler sees their CUDA work. Engine arguments are bench_throughput's
(``engine_kwargs``: dummy weights, prefix caching off, default compilation and CUDA graphs, max_model_len from the
longest scenario; --max-num-seqs 512 as in the README's ``--scenarios S1,S2 --max-num-seqs 512``). Per scenario it
adds the requests (``LLM.enqueue`` -> ``LLMEngine.add_request``: random prompt ids, greedy, ignore_eos,
max_tokens = output length) and calls ``LLMEngine.step()`` until the scheduler has scheduled --warm-steps + 1
pure-decode steps in a row (every scheduled request one token, none new or resumed: every running request has
finished prefill). Then
  1. --timed-steps steps between two torch.cuda.synchronize() calls, by host wall clock: ``step_ms``;
  2. --steps steps under ``torch.profiler.profile(activities=[CPU, CUDA])``, each in a ``record_function``.
A window with a prefill in it (bf16 at S2 cannot hold all 384 requests, so the scheduler preempts and re-prefills) is
retried, up to --max-attempts; the last one is kept and flagged. The requests are then aborted. Running sequences are
the scheduled requests per profiled step; mean context the running requests' computed tokens around the windows.

Aggregation. GPU activity of the profiled window (kernels, memcpy, memset) divided by the number of steps. Families:
the first rule of FAMILY_RULES whose case-insensitive regex is found in the kernel name wins, in this order:
  memcpy / memset  "Memcpy ...", "Memset ..." (torch.profiler's names)
  KV store         reshape_and_cache*, concat_and_cache*, tq_paged_store_kernel, stock's _tq_fused_store_*
  key centring     key_center* (tq_key_center_sums_kernel), tq_center_queries_kernel, tq_center_logits_kernel
  split merge      tq_merge_splits_kernel, tq_merge_split_groups_kernel, tq_merge_unrotate_kernel, FlashAttention's
                   split-KV combine (FA2 *splitkv_combine*, FA3 FlashAttnFwdCombine), merge_attn_states, Triton
                   decode's _fwd_kernel_stage2 (stock TurboQuant's too)
  attention        flash_fwd*, FlashAttn*, flash::*, fmha, tq_paged_attention_kernel, tq_paged_decode_kernel,
                   tq_rotate_queries_kernel, tq_paged_gather_dequant_kernel,
                   stock's _tq_decode_stage1 / _tq_full_dequant_kv, *paged_attention*, *unified_attention*, Triton
                   decode's _fwd_kernel_stage1, FlashInfer
  GEMM             gemm, gemv, cutlass, nvjet, xmma, cublas, splitKreduce, wgmma, Inductor templates (triton_tem_),
                   Marlin, ours' weight products with their activation rotation and dequantization (tq_linear*,
                   tq_moe_linear, tq_rotate_kernel / tq_rotate_fp16 / tq_rotate_int8, tq_dequant_kernel)
  sampling/logits  argmax, sampl*, top-k/p, softmax, gumbel, penalties, multinomial, exponential, logit*
  norms / RoPE / activation / elementwise
                   norm, rotary/rope, silu/gelu/act_and_mul/activation, Inductor's triton_poi/per/red_, at::native::*,
                   fill, copy
  other            the rest.
Specific rules come first: "reshape_and_cache_flash_kernel" is a store though it says "flash", the split-KV combine a
merge though it says "flash_fwd", FA3's "cutlass::device_kernel<flash::...>" attention though it says "cutlass".
``busy`` is the union of the GPU intervals (overlapping kernels count once), ``gaps`` = step_ms - busy (GPU idle
within a step: host work, launch latency). Kernels per step count GPU kernel executions, graph ones included;
launch calls count host launch API calls (kernels launched outside CUDA graphs), graph launches cudaGraphLaunch calls.

CUDA graphs. CUPTI reports each kernel a graph runs as its own kernel record, correlated to the cudaGraphLaunch that
ran it, and kineto writes those as ``kernel`` events (newer kineto also adds a "graph id"). Checked on an H100 with
torch 2.11.0+cu130 (CUDA 13.0): a graph captured before the profiler's first use, as vLLM's are, then replayed under
two profiler sessions in a row: every kernel of the graph came back each time, with its launch's correlation id and no
"graph id". PyTorch knows of problems with graphs captured before the first profiler use on older stacks
(torch.profiler._utils._init_for_cuda_graphs, pytorch#100441): --cupti-warmup calls it before the engine starts; others
report that it silences CUPTI instead, so it is off by default. The output checks itself: it counts per step the
kernels that came from graphs (by correlation) and warns when graphs were launched but none of their kernels came
back, or when GPU busy time covers less than half of the step.

Hardware limits (ms at the GPU's copy bandwidth, measured in the subprocess: a 1 GiB device-to-device copy timed with
CUDA events, counted as bytes read + written): attention reads running x mean context x layers x KV heads x bytes per
token per head (turboquant_core.formats for turboquant_*, 2*2*head_dim for bf16, 2*head_dim for fp8; MLA models
one latent entry per token and layer: the format table's MLA entry, 2*576 bytes for bf16); the KV store reads the
new token's K and V (MLA: its latent) in bf16 and writes them in the cache dtype; GEMMs read every weight matrix but
the input embedding once. Elsewhere no limit is given.

Timeline (--timeline): instead of a decode window, every engine step of each scenario from its first prompt to its
last token, timed to the end of its GPU work (torch.cuda.synchronize() after each step, so async scheduling's overlap
is not in these times) with the tokens and requests it scheduled. The report sums the steps by kind: prefill steps
(new prompts, chunks, re-prefills after a preemption; decode tokens may ride along), pure-decode steps and empty ones.
It answers where a whole run's time goes when a steady decode step alone does not explain its throughput. With
--profile-prefill the profiler runs from the first step to the first pure-decode step, and the report adds the GPU
time of the prefill steps by kernel family (the events their launches correlate to) and their top kernels: where the
time to first token goes. --host-profile runs cProfile over the same steps (host-<config>-<scenario>.txt): where the
host spends a step whose wall time the GPU's busy time does not explain.

Output in --out: profile.json (device, date, command, per config and scenario: running sequences, mean context,
step ms, per family ms / share / ms per 100 sequences / limit, kernels per step, top 15 kernels), profile.md (per
scenario, configs side by side), trace-<config>-<scenario>.json.gz (the Chrome trace of one profiled step, for
chrome://tracing or ui.perfetto.dev; --no-trace to skip; larger than --trace-max-mb without its CPU ops: skipped) and
logs/. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "benchmarks" / "configs" / "qwen3-8b"
STEP_MARK = "tq_decode_step_"

# (family, regex) in order: the first rule whose regex is found in a kernel's name (case-insensitive) names its
# family; none: "other". Specific before broad: "reshape_and_cache_flash_kernel" is a store though it says "flash",
# FlashAttention's split-KV combine a merge though it says "flash_fwd", FA3 kernels attention though they are
# "cutlass::device_kernel<flash::...>", argmax (an at::native reduce) sampling before the at::native catch-all.
FAMILY_RULES: tuple[tuple[str, str], ...] = (
    ("memcpy", r"^mem(cpy|set)\b"),  # torch.profiler's names of copies and memsets: "Memcpy DtoH (...)"
    ("kv_store", r"reshape_and_cache|concat_and_cache|tq_paged_store|tq_fused_store|tq_mla_store"),
    ("key_centering", r"key_?cent|center_queries|center_logits"),  # the sums, the queries' operands, their logits
    ("split_merge", r"tq_merge_split|tq_merge_unrotate|splitkv_combine|flash_fwd_combine|FlashAttnFwdCombine|"
                    r"merge_attn_states|fwd_kernel_stage2"),
    ("attention", r"flash_fwd|flashattn|flash::|fmha|tq_paged_attention|tq_paged_decode|tq_rotate_queries|"
                  r"tq_paged_gather_dequant|tq_decode_stage1|tq_mla_decode|tq_mla_gather|"
                  r"tq_full_dequant|paged_attention|unified_attention|fwd_(grouped_)?kernel_stage1|flashinfer|"
                  r"BatchDecode|BatchPrefill"),
    # Ours by their whole names: Inductor names a fused kernel after the ops it fuses ("..._rms_norm_tq_linear_0").
    ("gemm", r"gemm|gemv|cutlass|nvjet|xmma|cublas|splitKreduce|wgmma|triton_tem_|s16816|s1688|marlin::|"
             r"fused_moe_kernel|^(tq_linear_w?mma|tq_moe_linear|tq_rotate|tq_rotate_(fp16|int8)|tq_dequant)_kernel$"),
    ("sampling", r"argmax|sampl|top_?k|top_?p|softmax|gumbel|penalt|multinomial|exponential|logit"),
    ("elementwise", r"norm|rotary|rope|silu|gelu|act_and_mul|activation|swiglu|triton_(poi|per|red)_|elementwise|"
                    r"vectorized|at::native|CatArray|fill|copy"),
)
# Report order.
FAMILIES = ("attention", "split_merge", "kv_store", "key_centering", "gemm", "elementwise", "sampling", "memcpy",
            "other")
assert set(FAMILIES) == {f for f, _ in FAMILY_RULES} | {"other"}
FAMILY_LABELS = {
    "attention": "attention", "split_merge": "split merge", "kv_store": "KV store", "key_centering": "key centring",
    "gemm": "GEMM", "elementwise": "norms / RoPE / activation / elementwise", "sampling": "sampling / logits",
    "memcpy": "memcpy / memset", "other": "other", "gaps": "gaps (step - busy)",
}
_RULES = tuple((f, re.compile(rx, re.IGNORECASE)) for f, rx in FAMILY_RULES)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_LAUNCH = re.compile(r"^cu(da)?GraphLaunch")
KERNEL_LAUNCH = re.compile(r"^cu(da)?Launch(Cooperative)?Kernel")


def _bench():
    """scripts/bench_throughput.py as a module (its config and scenario names, engine arguments, environment)."""
    mod = sys.modules.get("bench_throughput")
    if mod is None:
        path = Path(__file__).with_name("bench_throughput.py")
        spec = importlib.util.spec_from_file_location("bench_throughput", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_throughput"] = mod
        spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------------- pure helpers


def classify(name: str) -> str:
    """The family of a kernel (or memcpy / memset) by its name: the first rule of FAMILY_RULES that matches."""
    for family, rx in _RULES:
        if rx.search(name):
            return family
    return "other"


def busy_union(intervals) -> float:
    """Length of the union of (start, duration) intervals: time with at least one of them running."""
    total, end = 0.0, None
    for start, dur in sorted(intervals):
        stop = start + dur
        if end is None or start > end:
            total += dur
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def aggregate(events, steps: int, top: int = 15) -> dict:
    """Per-step GPU time of (name, start_us, duration_us) events (kernels, memcpy, memset) over ``steps`` steps:
    ms per family, busy ms (union of the intervals), kernels and copies per step, the ``top`` kernels by time."""
    fam_us = dict.fromkeys(FAMILIES, 0.0)
    by_name: dict[str, list] = {}
    n_kernels = n_copies = 0
    for name, _, dur in events:
        fam = classify(name)
        fam_us[fam] += dur
        if fam == "memcpy":
            n_copies += 1
        else:
            n_kernels += 1
        acc = by_name.setdefault(name, [0.0, 0])
        acc[0] += dur
        acc[1] += 1
    total = sum(fam_us.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(
        family_ms={f: us / 1e3 / steps for f, us in fam_us.items()},
        kernel_ms=total / 1e3 / steps,
        busy_ms=busy_union((s, d) for _, s, d in events) / 1e3 / steps,
        kernels_per_step=n_kernels / steps,
        copies_per_step=n_copies / steps,
        top_kernels=[dict(name=n, family=classify(n), ms_per_step=us / 1e3 / steps, calls_per_step=c / steps,
                          share_of_kernel_time=us / total if total else 0.0) for n, (us, c) in ranked],
    )


def gpu_events(trace: dict) -> dict:
    """From a torch.profiler Chrome trace (``export_chrome_trace``): the GPU events as (name, start_us, dur_us) and
    counts: graph_launches (cudaGraphLaunch calls), launch_calls (host kernel-launch API calls), graph_kernels (kernels
    a graph ran: their correlation id is a graph launch's, or, where kineto writes it, their "graph id" is set)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    graph_corr = {(e.get("args") or {}).get("correlation") for e in evs
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and GRAPH_LAUNCH.search(e.get("name", ""))}
    graph_corr.discard(None)
    events, graph_kernels, launch_calls = [], 0, 0
    for e in evs:
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        if cat in GPU_CATS:
            events.append((name, float(e["ts"]), float(e.get("dur", 0.0))))
            if cat == "kernel" and (args.get("correlation") in graph_corr or args.get("graph id")):
                graph_kernels += 1
        elif cat in ("cuda_runtime", "cuda_driver") and KERNEL_LAUNCH.search(name):
            launch_calls += 1
    return dict(events=events, graph_kernels=graph_kernels, graph_launches=sum(
        1 for e in evs if e.get("cat") in ("cuda_runtime", "cuda_driver") and GRAPH_LAUNCH.search(e.get("name", ""))),
        launch_calls=launch_calls)


def events_of_steps(trace: dict, marks: set[str]) -> list[tuple[str, float, float]]:
    """GPU events (name, start_us, dur_us) launched inside the ``record_function`` ranges named in ``marks``: by the
    correlation ids of the runtime and driver calls made within those ranges (a CUDA graph's kernels carry their
    cudaGraphLaunch's)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in evs
             if e.get("cat") == "user_annotation" and e.get("name") in marks]
    corr = {e["args"]["correlation"] for e in evs
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})
            and any(lo <= float(e["ts"]) <= hi for lo, hi in spans)}
    return [(e.get("name", ""), float(e["ts"]), float(e.get("dur", 0.0))) for e in evs
            if e.get("cat") in GPU_CATS and (e.get("args") or {}).get("correlation") in corr]


def one_step_trace(trace: dict, step: int) -> dict | None:
    """The part of a Chrome trace around profiled step ``step``: its ``record_function`` range, the GPU work its
    launches correlate to (a CUDA graph's kernels carry the correlation id of their cudaGraphLaunch), every event
    overlapping that span, metadata and the launch-to-kernel flow arrows. None: the step is not in the trace."""
    evs = trace.get("traceEvents", [])
    mark = next((e for e in evs if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                 and e.get("name") == f"{STEP_MARK}{step}"), None)
    if mark is None:
        return None
    lo, hi = float(mark["ts"]), float(mark["ts"]) + float(mark.get("dur", 0.0))
    corr = {e["args"]["correlation"] for e in evs
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= float(e["ts"]) <= hi
            and "correlation" in (e.get("args") or {})}
    gpu = [e for e in evs if e.get("ph") == "X" and e.get("cat") in GPU_CATS
           and (e.get("args") or {}).get("correlation") in corr]
    if gpu:
        lo = min(lo, min(float(e["ts"]) for e in gpu))
        hi = max(hi, max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in gpu))
    keep = [e for e in evs if e.get("ph") == "M"
            or (e.get("ph") == "X" and float(e["ts"]) < hi and float(e["ts"]) + float(e.get("dur", 0.0)) > lo)
            or (e.get("ph") in ("s", "f") and e.get("id") in corr)]
    out = {k: v for k, v in trace.items() if k != "traceEvents"}
    out["traceEvents"] = keep
    return out


def write_trace(trace: dict, path: Path, max_bytes: int) -> str:
    """Gzipped JSON at ``path``; over ``max_bytes``, again without CPU ops; still over: not written. Returns what
    happened ("written", "written without CPU ops", "skipped: N MB")."""
    for how, t in (("written", trace), ("written without CPU ops", dict(trace, traceEvents=[
            e for e in trace["traceEvents"] if e.get("cat") not in ("cpu_op", "python_function")]))):
        data = gzip.compress(json.dumps(t).encode(), compresslevel=6)
        if len(data) <= max_bytes:
            path.write_bytes(data)
            return how
    return f"skipped: {len(data) / 2**20:.1f} MB gzipped"


def is_pure_decode(num_scheduled_tokens: dict, num_new_reqs: int) -> bool:
    """A scheduler step that only decodes: some request scheduled, every one for one token, none new (a resumed
    request re-prefills, so it has more than one token)."""
    return bool(num_scheduled_tokens) and num_new_reqs == 0 and all(n == 1 for n in num_scheduled_tokens.values())


def steady(records: list[dict], warm: int) -> bool:
    """The last warm + 1 scheduler steps were all pure decode."""
    return len(records) > warm and all(r["pure"] for r in records[-(warm + 1):])


def summarize_timeline(steps: list[dict]) -> dict:
    """A scenario's engine steps (``ms``, ``tokens``, ``reqs``, ``pure``) by kind: prefill (some prefill token),
    decode (pure decode) and idle (nothing scheduled): count, seconds and tokens each, the whole run's seconds, and
    the mean pure-decode step in ms (None without one)."""
    kinds = {"prefill": [x for x in steps if x["tokens"] and not x["pure"]],
             "decode": [x for x in steps if x["tokens"] and x["pure"]],
             "idle": [x for x in steps if not x["tokens"]]}
    out = dict(steps=len(steps), total_s=sum(x["ms"] for x in steps) / 1e3)
    for kind, xs in kinds.items():
        out[f"{kind}_steps"] = len(xs)
        out[f"{kind}_s"] = sum(x["ms"] for x in xs) / 1e3
        out[f"{kind}_tokens"] = sum(x["tokens"] for x in xs)
    out["decode_ms_mean"] = 1e3 * out["decode_s"] / out["decode_steps"] if out["decode_steps"] else None
    return out


def kv_bytes_per_token_per_head(kv_cache_dtype: str, head_dim: int, mla: tuple[int, int] | None = None) -> int | None:
    """K+V bytes one token takes per KV head (one latent entry per token for MLA layers, ``mla`` = (kv_lora_rank,
    rope_dim)): bench_throughput's, which sizes its expected KV capacity with them."""
    return _bench().kv_bytes_per_token_per_head(kv_cache_dtype, head_dim, mla)


def hardware_limits(*, running: float, mean_context: float, layers: int, kv_heads: int, head_dim: int,
                    kv_cache_dtype: str, gemm_weight_bytes: float | None, copy_bytes_per_s: float | None,
                    mla: tuple[int, int] | None = None) -> dict:
    """{family: {"bytes", "ms"}}: bytes one decode step must move, over the copy bandwidth (see the module doc)."""
    if not copy_bytes_per_s:
        return {}
    bpt = kv_bytes_per_token_per_head(kv_cache_dtype, head_dim, mla)
    moved = {}
    if bpt:
        moved["attention"] = running * mean_context * layers * kv_heads * bpt
        # the store reads the step's bf16 K and V (one bf16 latent entry for MLA) and writes the cache's entries
        read = 2 * head_dim if mla is not None else 2 * 2 * head_dim
        moved["kv_store"] = running * layers * kv_heads * (read + bpt)
    if gemm_weight_bytes:
        moved["gemm"] = gemm_weight_bytes
    return {f: dict(bytes=b, ms=1e3 * b / copy_bytes_per_s) for f, b in moved.items()}


def coverage_warnings(run: dict) -> list[str]:
    """What in a finished run says the profile missed GPU work."""
    out = []
    step, busy = run.get("step_ms"), run.get("busy_ms")
    if step and busy is not None and busy < 0.5 * step:
        out.append(f"GPU busy time {busy:.2f} ms covers only {busy / step:.0%} of the {step:.2f} ms step: either the "
                   "step is host-bound or kernels (e.g. inside CUDA graphs) are missing from the profile")
    if run.get("graph_launches_per_step") and run.get("graph_kernels_per_step") == 0:
        out.append("cudaGraphLaunch calls were profiled but no kernel from a graph: kernels inside CUDA graphs are "
                   "missing (try --cupti-warmup, or --enforce-eager to see the same kernels without graphs)")
    return out


def finish_run(raw: dict, *, kv_cache_dtype: str, shape: dict, gemm_weight_bytes: float | None,
               copy_bytes_per_s: float | None) -> dict:
    """A worker's raw numbers of one (config, scenario) -> the reported run: per family ms, share of the step,
    ms per 100 running sequences and the limit; gaps; warnings."""
    if "error" in raw:
        return dict(raw)
    step, running = raw["step_ms"], raw["running_seqs"]
    limits = hardware_limits(running=running, mean_context=raw["mean_context"], layers=shape["layers"],
                             kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], kv_cache_dtype=kv_cache_dtype,
                             mla=tuple(shape["mla"]) if shape.get("mla") else None,
                             gemm_weight_bytes=gemm_weight_bytes, copy_bytes_per_s=copy_bytes_per_s)
    gaps = max(0.0, step - raw["busy_ms"])

    def row(ms, family):
        return dict(ms=ms, share=ms / step if step else None, ms_per_100_seqs=100 * ms / running if running else None,
                    limit_ms=limits[family]["ms"] if family in limits else None)

    run = dict(raw, gaps_ms=gaps, families={f: row(raw["family_ms"].get(f, 0.0), f) for f in FAMILIES},
               limit_bytes={f: v["bytes"] for f, v in limits.items()})
    run["families"]["gaps"] = row(gaps, "gaps")
    run.pop("family_ms", None)
    run["limit_ms"] = sum(v["ms"] for v in limits.values()) if limits else None
    run["warnings"] = list(raw.get("warnings", [])) + coverage_warnings(run)
    return run


def reclassify_top_kernels(doc: dict) -> bool:
    """Apply today's FAMILY_RULES to a stored profile's top kernels: a kernel now in another family moves its
    ms there (shares and ms per 100 sequences follow; a note goes to the run's warnings). Kernels outside the
    top list stay where the run put them. Returns whether anything moved."""
    moved = False
    for run in doc.get("runs", []):
        fams = run.get("families")
        if not fams:
            continue
        step, running = run.get("step_ms"), run.get("running_seqs")
        for k in run.get("top_kernels", []):
            new = classify(k["name"])
            if new == k["family"]:
                continue
            for fam, sign in ((k["family"], -1), (new, 1)):
                f = fams[fam]
                f["ms"] = max(0.0, f["ms"] + sign * k["ms_per_step"])
                f["share"] = f["ms"] / step if step else None
                f["ms_per_100_seqs"] = 100 * f["ms"] / running if running else None
            run.setdefault("warnings", []).append(
                f"reclassified {k['name']} ({k['ms_per_step']:.3f} ms) from {k['family']} to {new}")
            k["family"] = new
            moved = True
    return moved


def scenario_label(sc: tuple[int, int, int]) -> str:
    """S1 / S2 / S3 when the scenario is one of bench_throughput's named ones, else INxOUTxBATCH."""
    text = "x".join(str(v) for v in sc)
    return next((k for k, v in _bench().NAMED_SCENARIOS.items() if v == text), text)


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _fmt_limit(v) -> str:
    return "-" if v is None else format(v, ".3f" if v < 0.1 else ".2f")


def _per100(run: dict, fam: str | None = None) -> float | None:
    """ms per 100 running sequences of a family, or of the whole step (fam None)."""
    if fam is not None:
        return run["families"][fam]["ms_per_100_seqs"]
    return 100 * run["step_ms"] / run["running_seqs"] if run["running_seqs"] else None


def _ratio(run: dict, base: dict, fam: str | None = None) -> str:
    b, v = _per100(base, fam), _per100(run, fam)
    return f"{v / b:.2f}x" if (b and v is not None and b > 1e-3) else "-"


def render_markdown(doc: dict, baseline: str = "bf16") -> str:
    """profile.md: per scenario one table, family rows, per config ms/step (share), ms per 100 running sequences
    and the bandwidth limit, then each config's ratio to the baseline per sequence; warnings and top kernels."""
    lines = ["# One steady-state decode step, by kernel family", ""]
    cfgs = doc.get("configs", [])
    ok = next((c for c in cfgs if "device" in c), {})
    bw = ok.get("copy_bandwidth_gbs")
    lines.append(f"- Device: {ok.get('device', '?')}; copy bandwidth {_fmt(bw, '.0f')} GB/s (1 GiB device-to-device "
                 f"copy, read + write); vLLM {ok.get('vllm_version', '?')}, torch {ok.get('torch_version', '?')}; "
                 f"{doc.get('date', '?')}")
    lines.append(f"- Command: `{doc.get('command', '')}`")
    lines.append(f"- {doc.get('settings', {}).get('steps', '?')} profiled steps per run (torch.profiler, CPU + CUDA), "
                 "step = host wall time per step without the profiler; ms per 100 seqs = ms / running x 100; limit = "
                 "bytes the step must move / copy bandwidth; gaps = step - GPU busy (union of kernels and copies)")
    for c in cfgs:
        if "error" in c:
            lines.append(f"- {c['name']} ({c.get('kv_cache_dtype', '?')}): failed: {c['error'][-300:]}")
    lines.append("")
    runs = doc.get("runs", [])
    for label in dict.fromkeys(r["scenario"] for r in runs):
        srun = [r for r in runs if r["scenario"] == label]
        good = [r for r in srun if "families" in r]
        first = srun[0]
        lines.append(f"## {label}: {first.get('input_len')} in / {first.get('output_len')} out / "
                     f"{first.get('batch')} requests")
        lines.append("")
        failed = [r for r in srun if "families" not in r]
        for r in failed:
            lines.append(f"- {r['config']}: failed: {r.get('error', '?')[-300:]}")
        if failed:
            lines.append("")
        if not good:
            continue
        base = next((r for r in good if r["config"] == baseline), good[0])
        others = [r for r in good if r is not base]
        head = ["per step"]
        for r in good:
            head += [f"{r['config']} ms (share)", f"{r['config']} ms/100 seqs", f"{r['config']} limit ms"]
        head += [f"{r['config']} / {base['config']}, per seq" for r in others]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

        cells = ["running seqs (mean context)"]
        for r in good:
            cells += [f"{r['running_seqs']:.0f} ({r['mean_context']:.0f} tok)"
                      + ("" if r.get("pure_decode", True) else ", not pure decode"), "", ""]
        cells += ["" for _ in others]
        lines.append("| " + " | ".join(cells) + " |")
        cells = ["**step (host wall)**"]
        for r in good:
            cells += [f"**{r['step_ms']:.2f}**", _fmt(_per100(r)), _fmt_limit(r.get("limit_ms"))]
        cells += [_ratio(r, base) for r in others]
        lines.append("| " + " | ".join(cells) + " |")
        for fam in FAMILIES + ("gaps",):
            if all(r["families"][fam]["ms"] < 5e-4 for r in good):
                continue
            cells = [FAMILY_LABELS[fam]]
            for r in good:
                f = r["families"][fam]
                cells += [f"{f['ms']:.2f} ({_fmt(f['share'], '.0%')})", _fmt(f["ms_per_100_seqs"]),
                          _fmt_limit(f["limit_ms"])]
            cells += [_ratio(r, base, fam) for r in others]
            lines.append("| " + " | ".join(cells) + " |")
        cells = ["kernels / step (in graphs)"]
        for r in good:
            g = r.get("graph_kernels_per_step")
            cells += [f"{r['kernels_per_step']:.0f}" + ("" if g is None else f" ({g:.0f})"), "", ""]
        cells += ["" for _ in others]
        lines.append("| " + " | ".join(cells) + " |")
        cells = ["host launch calls / step (graph launches)"]
        for r in good:
            cells += [f"{r.get('launch_calls_per_step', 0):.0f} ({r.get('graph_launches_per_step', 0):.0f})", "", ""]
        cells += ["" for _ in others]
        lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for r in good:
            for w in r.get("warnings", []):
                lines.append(f"- {r['config']}: {w}")
        for r in good:
            tops = "; ".join(f"`{k['name'][:70]}` ({k['family']}) {k['ms_per_step']:.2f} ms"
                             for k in r.get("top_kernels", [])[:5])
            lines.append(f"- {r['config']} top kernels: {tops}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the worker


def render_timeline(doc: dict, baseline: str = "bf16") -> str:
    """profile.md of a --timeline run: per scenario, each config's whole run split into prefill, pure-decode and idle
    steps (count, seconds, tokens), and its total against the baseline's."""
    lines = ["# Whole scenarios, step by step", ""]
    cfgs = doc.get("configs", [])
    ok = next((c for c in cfgs if "device" in c), {})
    lines.append(f"- Device: {ok.get('device', '?')}; vLLM {ok.get('vllm_version', '?')}, torch "
                 f"{ok.get('torch_version', '?')}; {doc.get('date', '?')}")
    lines.append(f"- Command: `{doc.get('command', '')}`")
    lines.append("- Every engine step from the first prompt to the last token, timed to the end of its GPU work; "
                 "prefill steps scheduled some prefill token (decode tokens may ride along), decode steps only one "
                 "token per running request")
    for c in cfgs:
        if "error" in c:
            lines.append(f"- {c['name']} ({c.get('kv_cache_dtype', '?')}): failed: {c['error'][-300:]}")
    runs = [r for r in doc.get("runs", []) if "timeline" in r]
    for label in doc.get("scenarios", []):
        rs = [r for r in runs if r["scenario"] == label]
        if not rs:
            continue
        base = next((r for r in rs if r["config"] == baseline), None)
        lines += ["", f"## {label}", "",
                  f"| config | total s | vs {baseline} | prefill steps | prefill s | prefill tokens | decode steps | "
                  "decode s | decode step ms | idle steps |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base_s = base["timeline"]["total_s"] if base else 0
        for r in rs:
            t = r["timeline"]
            vs = f"{t['total_s'] / base_s:.2f}x" if base_s else "-"
            note = "" if r.get("complete", True) else " (stopped before the last token)"
            lines.append(f"| {r['config']}{note} | {t['total_s']:.2f} | {vs} | {t['prefill_steps']} | "
                         f"{t['prefill_s']:.2f} | {t['prefill_tokens']} | {t['decode_steps']} | {t['decode_s']:.2f} | "
                         f"{_fmt(t['decode_ms_mean'])} | {t['idle_steps']} |")
        lines += render_prefill_profile([r for r in rs if r.get("prefill_profile")])
    return "\n".join(lines)


def render_prefill_profile(runs: list[dict], top: int = 8) -> list[str]:
    """Lines of a scenario's prefill-step GPU time (--profile-prefill): one column per config, ms over all its
    prefill steps per kernel family, then each config's top kernels."""
    if not runs:
        return []
    lines = ["", "GPU time of the prefill steps (ms, all of them together; under the profiler):", "",
             "| family | " + " | ".join(r["config"] for r in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    rows = [("prefill steps", lambda p: str(p["steps"])), ("step wall time", lambda p: f"{p['wall_ms']:.0f}"),
            ("GPU busy", lambda p: f"{p['busy_ms']:.0f}")]
    rows += [(FAMILY_LABELS[f], lambda p, f=f: f"{p['family_ms'].get(f, 0.0):.1f}") for f in FAMILIES]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(r["prefill_profile"]) for r in runs) + " |")
    for r in runs:
        lines += ["", f"{r['config']}, top kernels of the prefill steps:", ""]
        for k in r["prefill_profile"]["top_kernels"][:top]:
            lines.append(f"- {k['ms_per_step']:.1f} ms, {k['calls_per_step']:.0f} calls, {k['family']}: "
                         f"`{k['name'][:120]}`")
    return lines


def _log(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(torch, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes per second of a large device-to-device copy, counted as bytes read + bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def weight_bytes(model) -> dict:
    """Parameter count and bytes of the model, and the bytes of the weights decode GEMMs read (every matrix but the
    input embedding table, of which decode reads a few rows; a tied LM head counts)."""
    emb = {id(m.weight) for m in model.modules()
           if type(m).__name__ == "VocabParallelEmbedding" and getattr(m, "weight", None) is not None}
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    params = total = gemm = 0
    for p in model.parameters():
        b = p.numel() * p.element_size()
        params += p.numel()
        total += b
        if p.dim() >= 2 and (id(p) not in emb or p is head):
            gemm += b
    return dict(params=params, weight_bytes=total, gemm_weight_bytes=gemm)


class ScheduleRecorder:
    """Wraps the in-process scheduler's ``schedule()`` to note, per engine step, how many requests and tokens it
    scheduled and whether the step is pure decode."""

    def __init__(self, scheduler) -> None:
        self.records: list[dict] = []
        orig = scheduler.schedule

        def schedule(*a, **kw):
            out = orig(*a, **kw)
            nst = out.num_scheduled_tokens
            self.records.append(dict(reqs=len(nst), tokens=out.total_num_scheduled_tokens,
                                     pure=is_pure_decode(nst, len(out.scheduled_new_reqs))))
            return out

        scheduler.schedule = schedule


def _snapshot(sched) -> dict:
    ctx = [r.num_computed_tokens for r in list(sched.running)]
    return dict(running=len(ctx), waiting=len(sched.waiting), mean_context=sum(ctx) / len(ctx) if ctx else 0.0)


def _enqueue_scenario(llm, sc) -> list:
    """The scenario's requests (random prompt ids, greedy, ignore_eos, max_tokens = output length), added to the
    engine; their ids."""
    import random

    from vllm import SamplingParams

    n_in, n_out, batch = sc
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(n_in)]} for _ in range(batch)]
    sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
    return llm.enqueue(prompts, sp, use_tqdm=False)


def _abort_and_settle(engine, sched, core, ids) -> None:
    engine.abort_request(ids, internal=True)
    for _ in range(64):  # let the scheduler and an in-flight batch (async scheduling) settle
        if not sched.has_requests() and not getattr(core, "batch_queue", None):
            break
        engine.step()


def _profile_scenario(llm, torch, sched, core, rec: ScheduleRecorder, sc, args, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = llm.llm_engine
    n_in, n_out, batch = sc
    ids = _enqueue_scenario(llm, sc)
    out = dict(scenario=label, input_len=n_in, output_len=n_out, batch=batch, warnings=[])
    try:
        start = len(rec.records)
        t = time.perf_counter()

        def to_steady() -> None:
            base = len(rec.records)
            while not steady(rec.records[base:], args.warm_steps):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("every request finished before a steady pure-decode state")
                if len(rec.records) - base > 4 * n_out + 1000:
                    raise RuntimeError(f"no {args.warm_steps + 1} pure-decode steps in a row within "
                                       f"{len(rec.records) - base} steps")
                engine.step()

        def window(n: int, profiler=None):
            torch.cuda.synchronize()
            i0, t0 = len(rec.records), time.perf_counter()
            for i in range(n):
                if profiler is None:
                    engine.step()
                else:
                    with record_function(f"{STEP_MARK}{i}"):
                        engine.step()
            torch.cuda.synchronize()
            recs = rec.records[i0:]
            return (time.perf_counter() - t0) / n, recs, len(recs) == n and all(r["pure"] for r in recs)

        to_steady()
        out["steps_to_steady"] = len(rec.records) - start
        out["seconds_to_steady"] = time.perf_counter() - t
        _log(f"{args.config_name} {label}: steady decode after {out['steps_to_steady']} steps "
             f"({out['seconds_to_steady']:.1f} s), {_snapshot(sched)}")
        for attempt in range(1, args.max_attempts + 1):
            step_s, trecs, ok = window(args.timed_steps)
            if ok or attempt == args.max_attempts:
                break
            _log(f"{args.config_name} {label}: timed window had a prefill, again ({attempt})")
            to_steady()
        out["timed_window_pure"] = ok
        for attempt in range(1, args.max_attempts + 1):
            if attempt > 1 or not ok:
                to_steady()
            before = _snapshot(sched)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prof_s, precs, pure = window(args.steps, profiler=prof)
            after = _snapshot(sched)
            if pure or attempt == args.max_attempts:
                break
            _log(f"{args.config_name} {label}: profiled window had a prefill, again ({attempt})")
        out["attempts"] = attempt
        out["pure_decode"] = pure
        if not pure:
            extra = sum(r["tokens"] - r["reqs"] for r in precs if not r["pure"])
            out["warnings"].append(f"no pure-decode window in {attempt} attempts: the profiled steps include about "
                                   f"{extra} prefill tokens")
        reqs = [r["reqs"] for r in precs]
        out.update(step_ms=1e3 * step_s, step_ms_profiled=1e3 * prof_s, running_seqs=sum(reqs) / len(reqs),
                   running_min=min(reqs), running_max=max(reqs), waiting_seqs=after["waiting"],
                   mean_context=(before["mean_context"] + after["mean_context"]) / 2, profiled_steps=args.steps,
                   timed_steps=args.timed_steps)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        g = gpu_events(trace)
        agg = aggregate(g["events"], args.steps)
        out.update(agg)
        out.update(graph_launches_per_step=g["graph_launches"] / args.steps,
                   launch_calls_per_step=g["launch_calls"] / args.steps,
                   graph_kernels_per_step=None if g["graph_kernels"] is None else g["graph_kernels"] / args.steps)
        if args.trace_dir:
            one = one_step_trace(trace, args.steps // 2)
            name = f"trace-{args.config_name}-{label}.json.gz"
            how = "not found" if one is None else write_trace(one, Path(args.trace_dir) / name,
                                                              int(args.trace_max_mb * 2**20))
            out["trace"] = name if how.startswith("written") else None
            out["trace_note"] = how
        _log(f"{args.config_name} {label}: {out['running_seqs']:.0f} running, context {out['mean_context']:.0f}, "
             f"step {out['step_ms']:.2f} ms (profiled {out['step_ms_profiled']:.2f}), "
             f"GPU busy {agg['busy_ms']:.2f} ms, {agg['kernels_per_step']:.0f} kernels/step")
    finally:
        _abort_and_settle(engine, sched, core, ids)
    return out


def _timeline_scenario(llm, torch, sched, core, rec: ScheduleRecorder, sc, args, label: str) -> dict:
    """Every engine step of one scenario, timed to the end of its GPU work: (ms, tokens, requests, pure decode) each,
    and ``summarize_timeline`` of them. Stops after as many steps as _profile_scenario allows to reach steady decode
    (the requests are then aborted and ``complete`` is False)."""
    engine = llm.llm_engine
    n_in, n_out, batch = sc
    ids = _enqueue_scenario(llm, sc)
    steps: list[dict] = []
    complete = False
    prefill = prof = host_report = None
    # --profile-prefill: the profiler runs from the first step until the first pure-decode step (that step is
    # profiled too but not counted: only the steps with prefill tokens are).
    if args.profile_prefill:
        from torch.profiler import ProfilerActivity, profile, record_function

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.start()
    # --host-profile: cProfile over the same steps (host time by Python function; a call that waits for the GPU
    # shows as its own time)
    host = None
    if args.host_profile:
        import cProfile

        host = cProfile.Profile()
        host.enable()

    def stop_profilers() -> None:  # at the first pure-decode step, or where the scenario ended (or failed) before it
        nonlocal prof, host, prefill, host_report
        if prof is not None:
            prof.stop()
            prefill = prefill_profile(prof, steps)
            prof = None
        if host is not None:
            host.disable()
            host_report = write_host_profile(host, args, label)
            host = None

    try:
        torch.cuda.synchronize()
        while engine.has_unfinished_requests() and len(steps) < 4 * n_out + 1000:
            i0, t0 = len(rec.records), time.perf_counter()
            if prof is not None:
                with record_function(f"{STEP_MARK}{len(steps)}"):
                    engine.step()
            else:
                engine.step()
            torch.cuda.synchronize()
            recs = rec.records[i0:]
            steps.append(dict(ms=1e3 * (time.perf_counter() - t0), tokens=sum(r["tokens"] for r in recs),
                              reqs=max((r["reqs"] for r in recs), default=0), pure=all(r["pure"] for r in recs)))
            if steps[-1]["pure"] and steps[-1]["tokens"]:
                stop_profilers()
        complete = not engine.has_unfinished_requests()
    finally:
        stop_profilers()
        if not complete:
            _abort_and_settle(engine, sched, core, ids)
    t = summarize_timeline(steps)
    _log(f"{args.config_name} {label}: {t['steps']} steps, {t['total_s']:.2f} s: prefill {t['prefill_steps']} steps "
         f"{t['prefill_s']:.2f} s, decode {t['decode_steps']} steps {t['decode_s']:.2f} s")
    out = dict(scenario=label, input_len=n_in, output_len=n_out, batch=batch, complete=complete, timeline=t,
               steps=steps)
    if args.host_profile:
        out["host_profile"] = host_report
    if args.profile_prefill:
        out["prefill_profile"] = prefill
        fam = ", ".join(f"{f} {ms:.0f}" for f, ms in prefill["family_ms"].items() if ms >= 1)
        _log(f"{args.config_name} {label}: prefill steps' GPU time by family, ms: {fam}")
    return out


def write_host_profile(host, args, label: str, top: int = 60) -> str | None:
    """The cProfile statistics of a timeline's steps up to the first pure-decode one: the ``top`` functions by own
    time and by cumulative time, as text in ``host-<config>-<scenario>.txt`` of the trace folder (its name returned;
    None without a trace folder)."""
    import io
    import pstats

    if not args.trace_dir:
        return None
    buf = io.StringIO()
    stats = pstats.Stats(host, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    name = f"host-{args.config_name}-{label}.txt"
    Path(args.trace_dir, name).write_text(buf.getvalue())
    return name


def prefill_profile(prof, steps: list[dict]) -> dict:
    """GPU time of a timeline's prefill steps (those with a prefill token, marked ``STEP_MARK<i>``) from a stopped
    profiler: ``aggregate`` over them, as totals (ms over all of them), with their count and wall time (ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    marks = {f"{STEP_MARK}{i}" for i, s in enumerate(steps) if s["tokens"] and not s["pure"]}
    out = aggregate(events_of_steps(trace, marks), steps=1)
    out.update(steps=len(marks), wall_ms=sum(s["ms"] for i, s in enumerate(steps) if f"{STEP_MARK}{i}" in marks))
    return out


def worker(args: argparse.Namespace) -> None:
    """Runs inside one subprocess: one in-process engine, every scenario; the result as JSON in --result-file."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: engine core in this process
    import torch

    if args.cupti_warmup:
        from torch.profiler._utils import _init_for_cuda_graphs

        _init_for_cuda_graphs()
    bench = _bench()
    scenarios = bench.parse_scenarios(args.scenarios)
    result = dict(device=torch.cuda.get_device_name(0), torch_version=torch.__version__, runs=[])
    bw = copy_bandwidth(torch)
    result["copy_bandwidth_gbs"] = bw / 1e9
    _log(f"{args.config_name}: {result['device']}, copy bandwidth {bw / 1e9:.0f} GB/s")

    import vllm
    from vllm import LLM

    result["vllm_version"] = vllm.__version__
    t0 = time.perf_counter()
    llm = LLM(**bench.engine_kwargs(args, scenarios))
    result["startup_s"] = time.perf_counter() - t0
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        raise SystemExit("the engine core runs in another process: VLLM_ENABLE_V1_MULTIPROCESSING=0 did not take "
                         "effect, so the profiler would not see the model's kernels")
    sched = core.scheduler
    rec = ScheduleRecorder(sched)
    vc = engine.vllm_config
    mc, pc, cc = vc.model_config, vc.parallel_config, vc.cache_config
    shape = dict(layers=mc.get_num_layers(pc), kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size())
    if mc.use_mla:  # (kv_lora_rank, rope_dim): one latent entry per token and layer
        hf = mc.hf_text_config
        shape["mla"] = (hf.kv_lora_rank, hf.qk_rope_head_dim)
    result.update(model_shape=shape, weights=llm.apply_model(weight_bytes)[0], num_gpu_blocks=cc.num_gpu_blocks,
                  block_size=cc.block_size, kv_capacity_tokens=(cc.num_gpu_blocks or 0) * cc.block_size,
                  async_scheduling=bool(vc.scheduler_config.async_scheduling),
                  cudagraph_mode=str(vc.compilation_config.cudagraph_mode), engine_kwargs={
                      k: v for k, v in bench.engine_kwargs(args, scenarios).items() if k != "model"})
    _log(f"{args.config_name}: engine up in {result['startup_s']:.0f} s, {shape}, "
         f"KV capacity {result['kv_capacity_tokens']} tokens")
    for sc in scenarios:
        label = scenario_label(sc)
        try:
            run = _timeline_scenario if args.timeline else _profile_scenario
            result["runs"].append(run(llm, torch, sched, core, rec, sc, args, label))
        except Exception as e:  # one scenario failing keeps the others
            import traceback

            traceback.print_exc()
            result["runs"].append(dict(scenario=label, input_len=sc[0], output_len=sc[1], batch=sc[2],
                                       error=f"{type(e).__name__}: {e}"))
        Path(args.result_file).write_text(json.dumps(result))
    Path(args.result_file).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- the driver


def run_config(args, name: str, install: str, dtype: str, out: Path,
               quantization: str | None = None) -> tuple[dict, list[dict]]:
    """One config's subprocess; returns (config row, finished runs)."""
    bench = _bench()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result_file = logs / f"{name}.result.json"
    result_file.unlink(missing_ok=True)
    env = bench.worker_env(args, install)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [sys.executable, __file__, "--worker", "--config-name", name, "--kv-cache-dtype", dtype,
           "--model", args.model, "--scenarios", args.scenarios, "--steps", str(args.steps),
           "--warm-steps", str(args.warm_steps), "--timed-steps", str(args.timed_steps),
           "--max-attempts", str(args.max_attempts), "--max-num-seqs", str(args.max_num_seqs),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--cudagraph-sizes", args.cudagraph_sizes,
           "--trace-max-mb", str(args.trace_max_mb), "--result-file", str(result_file)]
    if not args.no_trace:
        cmd += ["--trace-dir", str(out)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.timeline:
        cmd.append("--timeline")
    if args.profile_prefill:
        cmd.append("--profile-prefill")
    if args.host_profile:
        cmd.append("--host-profile")
    if args.cupti_warmup:
        cmd.append("--cupti-warmup")
    if quantization:
        cmd += ["--quantization", quantization]
    _log(f"{name}: {install} vLLM, kv_cache_dtype={dtype}" + (f", quantization={quantization}" if quantization else ""))
    t = time.perf_counter()
    tail: deque[str] = deque(maxlen=8)
    with open(logs / f"{name}.stdout.log", "w") as so, open(logs / f"{name}.stderr.log", "w") as se:
        # Own process group: a timeout takes every child with it.
        p = subprocess.Popen(cmd, env=env, stdout=so, stderr=subprocess.PIPE, text=True, start_new_session=True)

        def pump():
            for line in p.stderr:
                se.write(line)
                if line.strip():
                    tail.append(line.rstrip())
                if line.startswith("[profile]"):
                    sys.stderr.write(line)
                    sys.stderr.flush()

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            rc = p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "timeout"
        th.join(timeout=30)
    dtype, options = _bench().split_engine_options(dtype)  # the worker got them; the results keep them apart
    cfg = dict(name=name, install=install, kv_cache_dtype=dtype, returncode=rc, wall_s=time.perf_counter() - t,
               **({"engine_options": options} if options else {}),
               **({"quantization": quantization} if quantization else {}))
    raw = json.loads(result_file.read_text()) if result_file.is_file() else None
    if raw is None:
        cfg["error"] = " | ".join(tail)[-1500:] or f"exit {rc}, no result"
        _log(f"{name}: FAILED: {cfg['error'][-300:]}")
        return cfg, []
    raw_runs = raw.pop("runs", [])
    cfg.update(raw)
    if rc != 0:
        cfg["error"] = f"exit {rc} after {len(raw_runs)} scenario(s): " + " | ".join(tail)[-1000:]
    weights = raw.get("weights", {})
    runs = []
    for r in raw_runs:
        if "timeline" in r or "error" in r and args.timeline:
            runs.append(dict(config=name, install=install, kv_cache_dtype=dtype, **r))
            continue
        r = finish_run(r, kv_cache_dtype=dtype, shape=raw["model_shape"],
                       gemm_weight_bytes=weights.get("gemm_weight_bytes"),
                       copy_bytes_per_s=raw["copy_bandwidth_gbs"] * 1e9)
        runs.append(dict(config=name, install=install, kv_cache_dtype=dtype, **r))
    _log(f"{name}: done in {cfg['wall_s']:.0f} s")
    return cfg, runs


def _default_model() -> str:
    """The repo's Qwen3-8B shape, relative to the working directory when it is inside the repo."""
    try:
        return str(DEFAULT_MODEL.relative_to(Path.cwd()))
    except ValueError:
        return str(DEFAULT_MODEL)


def main(argv=None) -> int:
    if importlib.util.find_spec("turboquant_core") is None:  # not installed: this checkout's (config names, formats)
        sys.path.append(str(REPO))
    bench = _bench()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--model-config", dest="model", default=_default_model(),
                    help="model folder (a config.json is enough with dummy weights; default: the repo's "
                         "benchmarks/configs/qwen3-8b)")
    ap.add_argument("--suite", choices=("kv", "weights"), default="kv",
                    help="kv: configs are KV-cache dtypes; weights: configs are bench_throughput's weight "
                         "quantizations (bf16, fp8, awq-marlin, tq4, tq3, tq4+k3v4)")
    ap.add_argument("--configs", default=None,
                    help="comma list of bench_throughput config names (bf16, fp8, ours-<preset>, stock-<preset>) "
                         "or NAME=stock|patched:KV_CACHE_DTYPE; with --suite weights that suite's names or "
                         "NAME=stock|patched:KV_CACHE_DTYPE:QUANTIZATION (default: bf16,ours-k3v4 / bf16,tq4)")
    ap.add_argument("--scenarios", default="S1,S2",
                    help="comma list of INxOUTxBATCH or names: "
                         + ", ".join(f"{k}={v}" for k, v in bench.NAMED_SCENARIOS.items() if k != "sweep"))
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled per scenario")
    ap.add_argument("--warm-steps", type=int, default=3, help="pure-decode steps run before any measurement")
    ap.add_argument("--timed-steps", type=int, default=20, help="decode steps timed by wall clock, no profiler")
    ap.add_argument("--max-attempts", type=int, default=5, help="windows tried for one without a prefill")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="vLLM's max_num_seqs (0: the largest batch)")
    ap.add_argument("--baseline", default="bf16", help="config the markdown ratios are taken against")
    ap.add_argument("--pythonpath-stock", default="")
    ap.add_argument("--pythonpath-patched", default="")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (for comparison)")
    ap.add_argument("--cudagraph-sizes", default="", help="comma list of CUDA-graph capture sizes (default: vLLM's)")
    ap.add_argument("--cupti-warmup", action="store_true",
                    help="run torch.profiler._utils._init_for_cuda_graphs() before the engine captures its graphs")
    ap.add_argument("--timeline", action="store_true",
                    help="time every engine step of each scenario from start to finish instead of a decode window "
                         "(no profiler unless --profile-prefill or --host-profile)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="with --timeline: GPU time of the prefill steps by kernel family and the top kernels "
                         "(torch.profiler from the first step to the first pure-decode step; the step times are "
                         "then taken under the profiler)")
    ap.add_argument("--host-profile", action="store_true",
                    help="with --timeline: cProfile over the steps up to the first pure-decode one, its top functions "
                         "in host-<config>-<scenario>.txt (host time of the prefill steps by Python function)")
    ap.add_argument("--no-trace", action="store_true", help="write no Chrome trace")
    ap.add_argument("--trace-max-mb", type=float, default=5.0, help="largest gzipped one-step trace kept")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds per config (stock-<preset> compiles its decode kernel per CUDA-graph size: more)")
    ap.add_argument("--out", default="profile-decode", help="output folder")
    ap.add_argument("--report-only", metavar="JSON", help="rewrite profile.md next to this profile.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config-name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        # The result is on disk: leave without interpreter teardown, which an in-process engine (compile workers,
        # CUDA graphs, CUPTI) can make slow or hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.report_only:
        src = Path(args.report_only)
        doc = json.loads(src.read_text())
        if reclassify_top_kernels(doc):
            src.write_text(json.dumps(doc, indent=1) + "\n")
        render = render_timeline if doc.get("settings", {}).get("timeline") else render_markdown
        md = render(doc, args.baseline)
        src.with_name("profile.md").write_text(md + "\n")
        print(md)
        return 0
    for opt, low in (("steps", 1), ("warm_steps", 0), ("timed_steps", 1), ("max_attempts", 1)):
        if getattr(args, opt) < low:
            ap.error(f"--{opt.replace('_', '-')} must be at least {low}, got {getattr(args, opt)}")
    for opt in ("profile_prefill", "host_profile"):
        if getattr(args, opt) and not args.timeline:
            ap.error(f"--{opt.replace('_', '-')} profiles a --timeline run's prefill steps: add --timeline")
    if args.trace_max_mb <= 0:
        ap.error(f"--trace-max-mb must be positive, got {args.trace_max_mb}")
    if not Path(args.model, "config.json").is_file():
        known = sorted(p.parent.name for p in (REPO / "benchmarks" / "configs").glob("*/config.json"))
        ap.error(f"--model {args.model!r} has no config.json; the repo's model configs: "
                 + ", ".join(f"benchmarks/configs/{k}" for k in known))
    scenarios = bench.parse_scenarios(args.scenarios)
    if args.suite == "weights":
        configs = bench.parse_weight_configs(args.configs or "bf16,tq4")
    else:
        configs = [(*c, None) for c in bench.parse_configs(args.configs or "bf16,ours-k3v4")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = dict(device=None, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(sys.argv), model=args.model, scenarios=[scenario_label(s) for s in scenarios],
               settings=dict(steps=args.steps, warm_steps=args.warm_steps, timed_steps=args.timed_steps,
                             max_attempts=args.max_attempts, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                             cudagraph_sizes=args.cudagraph_sizes or "vLLM's", cupti_warmup=args.cupti_warmup,
                             timeline=args.timeline, profile_prefill=args.profile_prefill,
                             host_profile=args.host_profile),
               family_rules=[list(r) for r in FAMILY_RULES], configs=[], runs=[])
    for name, install, dtype, quantization in configs:
        cfg, runs = run_config(args, name, install, dtype, out, quantization)
        doc["configs"].append(cfg)
        doc["runs"] += runs
        doc["device"] = doc["device"] or cfg.get("device")
        (out / "profile.json").write_text(json.dumps(doc, indent=1))  # after every config: a killed run keeps it
    # Scenario-major order for the report.
    doc["runs"].sort(key=lambda r: doc["scenarios"].index(r["scenario"]) if r["scenario"] in doc["scenarios"] else 99)
    (out / "profile.json").write_text(json.dumps(doc, indent=1))
    md = (render_timeline if args.timeline else render_markdown)(doc, args.baseline)
    (out / "profile.md").write_text(md + "\n")
    print(md)
    _log(f"wrote {out / 'profile.json'} and {out / 'profile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

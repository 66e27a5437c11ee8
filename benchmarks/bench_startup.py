#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Engine start-up time of vLLM with bf16 and TurboQuant KV caches, on a cold machine (compile caches empty) and a
warm one, with the TurboQuant kernel variants compiled one after another or by parallel processes
(``--tq-compile-workers``).

Each run is one engine in its own subprocess (``vllm.LLM`` on dummy weights, CUDA graphs as served, then one short
request to show it serves), timed from the constructor's call to its return. A run's compile caches live under its own
cache root: vLLM's (``VLLM_CACHE_ROOT``: torch.compile, Inductor, and the Triton cache vLLM points ``TRITON_CACHE_DIR``
at once torch.compile starts, where the TurboQuant variants then land too) and Triton's own (``TRITON_CACHE_DIR``, used
before that). A cold run gets an empty root; a warm one reuses the root of the latest earlier run of the same NAME.
Runs in the order given, the results written after each (a run cut short keeps the rows before it); by default:

    bf16            cold
    bf16            warm: over the caches the run before filled; the baseline the others are compared with
    ours-k3v4/0     turboquant_k3v4_nc, cold, the automatic worker count (the default)
    ours-k3v4/0     warm
    ours-k3v4/1     cold, variants compiled in the engine process, one after another

    python benchmarks/bench_startup.py --model benchmarks/configs/qwen3-8b --out startup.json

A run is NAME[/WORKERS][:warm]: NAME bf16 or ours-<preset>; WORKERS the ``--tq-compile-workers`` value (0:
automatic). The engine log's TurboQuant lines give the compile-ahead and warm-up seconds. Needs CUDA and vLLM 0.26.0
patched by scripts/patches.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_throughput import config_names, run_engine_process  # noqa: E402

DEFAULT_RUNS = "bf16,bf16:warm,ours-k3v4/0,ours-k3v4/0:warm,ours-k3v4/1"
AHEAD_RE = re.compile(r"TurboQuant attention: (\d+) kernel variants, (\d+) already cached, (\d+) compiled "
                      r"\((\d+) with their launchers\) by (\d+) processes in ([\d.]+) s")
LAUNCH_RE = re.compile(r"TurboQuant attention: (\d+) kernel launches in ([\d.]+) s \((\d+) variants loaded from the "
                       r"cache, (\d+) compiled here")


def parse_run(text: str) -> dict:
    """NAME[/WORKERS][:warm] -> {name, kv_cache_dtype, compile_workers (None for bf16), warm}."""
    spec, _, mode = text.strip().partition(":")
    if mode not in ("", "warm"):
        raise SystemExit(f"bad run {text!r}: the only suffix is ':warm'")
    name, _, workers = spec.partition("/")
    ours = {n: dtype for n, (install, dtype) in config_names().items() if n.startswith("ours-")}
    if name == "bf16":
        dtype = "auto"
    elif name in ours:
        dtype = ours[name]
    else:
        raise SystemExit(f"bad run {text!r}: expected bf16 or one of {', '.join(ours)}")
    if workers and name == "bf16":
        raise SystemExit(f"bad run {text!r}: bf16 compiles no TurboQuant kernels, so takes no /WORKERS")
    try:
        count = int(workers) if workers else (None if name == "bf16" else 0)
    except ValueError:
        raise SystemExit(f"bad run {text!r}: WORKERS must be an integer >= 0") from None
    if count is not None and count < 0:
        raise SystemExit(f"bad run {text!r}: WORKERS must be an integer >= 0")
    return dict(run=text.strip(), name=name, kv_cache_dtype=dtype, compile_workers=count, warm=mode == "warm")


def log_numbers(log: str) -> dict:
    """The TurboQuant start-up lines of an engine log: compile-ahead variants / cached / compiled / launchers built /
    processes / seconds and the warm-up's launches / seconds / variants loaded / compiled (absent for bf16)."""
    out = {}
    m = AHEAD_RE.search(log)
    if m:
        out.update(variants=int(m[1]), cached=int(m[2]), compiled_ahead=int(m[3]), launchers_ahead=int(m[4]),
                   compile_processes=int(m[5]), compile_ahead_s=float(m[6]))
    m = LAUNCH_RE.search(log)
    if m:
        out.update(warmup_launches=int(m[1]), warmup_s=float(m[2]), warmup_loaded=int(m[3]),
                   warmup_compiled=int(m[4]))
    return out


def worker(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=args.model, load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype=args.kv_cache_dtype,
                  max_model_len=2048, gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    if args.compile_workers is not None:
        kwargs["tq_compile_workers"] = args.compile_workers
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    out = llm.generate([{"prompt_token_ids": list(range(1000, 1064))}],
                       SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    print("TQ_STARTUP_RESULT " + json.dumps(dict(startup_s=startup, tokens=len(out[0].outputs[0].token_ids))),
          flush=True)


def run_one(args, run: dict, cache_root: Path, log_dir: Path) -> dict:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache_root / "vllm"), TRITON_CACHE_DIR=str(cache_root / "triton"),
               VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--kv-cache-dtype", run["kv_cache_dtype"],
           "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if run["compile_workers"] is not None:
        cmd += ["--compile-workers", str(run["compile_workers"])]
    t = time.perf_counter()
    out, err, rc = run_engine_process(cmd, env, args.timeout)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run["run"])
    (log_dir / f"{len(list(log_dir.iterdir())):02d}-{safe}.log").write_text(out + "\n--- stderr ---\n" + err)
    row = dict(run, returncode=rc, wall_s=time.perf_counter() - t, **log_numbers(out + err))
    res = [ln for ln in out.splitlines() if ln.startswith("TQ_STARTUP_RESULT ")]
    if res:
        row.update(json.loads(res[-1].split(" ", 1)[1]))
    else:
        row["error"] = " | ".join([ln for ln in err.splitlines() if ln.strip()][-6:])[-1500:]
    return row


def summarize(rows: list[dict]) -> str:
    warm_bf16 = [r["startup_s"] for r in rows if r["name"] == "bf16" and r["warm"] and "startup_s" in r]
    base = warm_bf16[-1] if warm_bf16 else None
    lines = ["| run | compile caches | compile workers | start-up s | vs warm bf16 | variants (cached) "
             "| compile ahead s | warm-up launches s | compiled in the warm-up |",
             "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        s = r.get("startup_s")
        workers = "-" if r["compile_workers"] is None else (r["compile_workers"] or "auto")
        if r.get("compile_processes") is not None and r["compile_workers"] == 0:
            workers = f"auto ({r['compile_processes']})"
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["name"], "warm" if r["warm"] else "cold", workers, f"{s:.1f}" if s is not None else "failed",
            f"{s - base:+.1f}" if s is not None and base is not None else "-",
            f"{r['variants']} ({r['cached']})" if "variants" in r else "-",
            f"{r['compile_ahead_s']:.1f}" if "compile_ahead_s" in r else "-",
            f"{r['warmup_s']:.1f}" if "warmup_s" in r else "-",
            r["warmup_compiled"] if "warmup_compiled" in r else "-"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (a config.json is enough with dummy weights)")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help=f"comma list of NAME[/WORKERS][:warm] (default {DEFAULT_RUNS})")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--compile-workers", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    runs = [parse_run(r) for r in args.runs.split(",") if r.strip()]
    seen = set()
    for run in runs:
        if run["warm"] and run["name"] not in seen:
            raise SystemExit(f"run {run['run']!r}: no earlier {run['name']} run to take warm caches from")
        seen.add(run["name"])
    out = Path(args.out)
    log_dir = out.with_suffix("").parent / (out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tq-startup-"))
    rows, roots = [], {}
    for i, run in enumerate(runs):
        if not run["warm"]:
            roots[run["name"]] = scratch / f"caches-{i}"
            roots[run["name"]].mkdir()
        print(f"[startup] {run['run']}: compile caches {'warm' if run['warm'] else 'cold'}", flush=True)
        rows.append(run_one(args, run, roots[run["name"]], log_dir))
        r = rows[-1]
        print(f"[startup] {run['run']}: " + (f"{r['startup_s']:.1f} s" if "startup_s" in r else
                                             f"FAILED: {r.get('error', '')[-300:]}"), flush=True)
        # after every run, so that a run cut short keeps the rows before it
        table = write_results(out, args.model, argv, rows, planned=len(runs))
    print(table)
    return 0 if all("startup_s" in r for r in rows) else 1


def write_results(out: Path, model: str, argv, rows: list[dict], planned: int) -> str:
    """The JSON (date, device, command, model, rows, runs planned) and the markdown table of the runs so far;
    returns the table."""
    import torch

    result = dict(date=dt.date.today().isoformat(), device=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                  else None, command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                  model=model, runs_planned=planned, rows=rows)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    table = summarize(rows)
    out.with_suffix(".md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(main())

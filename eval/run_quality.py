#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Quality suite for KV-cache dtypes and weight quantization on vLLM: perplexity / KL / top-1 vs bf16, NIAH, GSM8K.

One process and one vLLM engine per (model, KV-cache dtype, install, weights); a report per model under
<out>/<model>/<run name>/ (report.json, report.md, plots/, configs/; raw/ keeps logs and logprobs).

    python eval/run_quality.py --model /models/smollm2-135m-instruct \\
        --dtypes auto,fp8,turboquant_4bit_nc,turboquant_k3v4_nc --installs stock,patched \\
        --python-path-stock /opt/site-stock --python-path-patched /opt/site \\
        --text data/wikitext2 --gsm8k data/gsm8k --out eval/results

    python eval/run_quality.py --model /models/smollm2-135m-instruct --dtypes auto \\
        --weights none,fp8,tq4,tq3,rtn4,rtn3 --tasks ppl --text data/wikitext2

    python eval/run_quality.py --report-only eval/results/smollm2-135m-instruct/2026-11-24-h200

See eval/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tq_eval import configs as C  # noqa: E402
from tq_eval import report as R  # noqa: E402

RUN_FILE = "run.json"
RAW_DIR = "raw"
RTN_DIR = "rtn-models"  # under raw/: the RTN controls' model folders, unless --rtn-dir says elsewhere
SECONDS_PER_CONFIG = 55  # eager engine start (~30-45 s) + tasks at the default sizes, tiny models


def _default_dtypes() -> str:
    return ",".join(["auto", "fp8", *C.turboquant_names()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--model", action="append", default=[], help="Hugging Face model folder (repeatable)")
    g.add_argument("--model-name", action="append", default=[], help="report name per --model (default: folder name)")
    g.add_argument("--dtypes", default=None, help="comma list of KV-cache dtypes (default: auto, fp8, every "
                   "turboquant_* preset); 'bf16' means 'auto'")
    g.add_argument("--weights", default="none",
                   help="comma list of: none, fp8, tq4, tq3, rtn4, rtn3, tq4-fp16-decode, tq3-fp16-decode (default: "
                   "none); each name but none is one config with KV dtype auto on patched; rtn* is the "
                   "round-to-nearest control at tq's group size and bytes; *-fp16-decode keeps the decode-sized "
                   "products' activation in fp16 (--no-tq-weights-decode-int8; with --prefill-chunk <= 64 the "
                   "scored positions run them); 'bf16' means 'none'")
    g.add_argument("--rtn-dir", default=None,
                   help="where the RTN controls' model folders are written and reused, one per (model, bits) "
                   f"(default: the run's {RAW_DIR}/{RTN_DIR}/)")
    g.add_argument("--installs", default="patched", help="comma list of: stock, patched (default: patched)")
    g.add_argument("--baseline-installs", default=None,
                   help="installs that run auto/fp8 (default: patched if requested, else the first install)")
    g.add_argument("--python-path-stock", default=None, help="PYTHONPATH head for stock configs (default: current)")
    g.add_argument("--python-path-patched", default=None, help="PYTHONPATH head for patched configs (default: current)")
    g.add_argument("--python", default=sys.executable, help="interpreter for the config processes")
    g.add_argument("--tasks", default="ppl,niah,gsm8k", help="comma list of: ppl, niah, gsm8k")
    g = p.add_argument_group("data")
    g.add_argument("--text", default=os.environ.get("TQ_EVAL_TEXT"),
                   help="perplexity text: a file, or a folder holding wiki.test.raw (env TQ_EVAL_TEXT)")
    g.add_argument("--gsm8k", default=os.environ.get("TQ_EVAL_GSM8K"),
                   help="folder with train.jsonl/test.jsonl, or 'hub' for openai/gsm8k (env TQ_EVAL_GSM8K)")
    g.add_argument("--online", action="store_true", help="allow Hugging Face hub access (needed for --gsm8k hub)")
    g = p.add_argument_group("task sizes")
    g.add_argument("--ppl-window", type=int, default=1024, help="tokens per perplexity window (512..8192)")
    g.add_argument("--ppl-windows", type=int, default=24, help="number of windows")
    g.add_argument("--topk", type=int, default=20, help="prompt logprobs per position (KL estimate)")
    g.add_argument("--niah-lengths", default="auto", help="comma list of context lengths, or 'auto' "
                   "(powers of two from 1024 to the model's limit)")
    g.add_argument("--niah-depths", default="0,25,50,75,100", help="needle depths in percent")
    g.add_argument("--niah-samples", type=int, default=4, help="prompts per (length, depth)")
    g.add_argument("--niah-seed", type=int, default=0)
    g.add_argument("--gsm8k-limit", type=int, default=100, help="questions (0: all 1319)")
    g.add_argument("--gsm8k-fewshot", type=int, default=5)
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    g.add_argument("--kv-cache-gib", type=float, default=6.0,
                   help="fixed KV pool per engine (vLLM kv_cache_memory_bytes); 0: size by utilization")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests per step (vLLM max_num_seqs; default: vLLM's); with --max-num-batched-tokens, "
                   "bounds the rows each step's linear layers see")
    g.add_argument("--prefill-chunk", type=int, default=256,
                   help="prefill tokens per request per step (vLLM long_prefill_token_threshold); "
                   "0: chunked prefill off, each prompt prefilled whole in one step (NIAH/GSM8K only: "
                   "perplexity then never reads the KV cache)")
    g.add_argument("--no-enforce-eager", action="store_true", help="allow CUDA graphs / torch.compile (slower start)")
    g = p.add_argument_group("scheduling and output")
    g.add_argument("--parallel", type=int, default=1, help="configs running at once on the GPU")
    g.add_argument("--config-timeout", type=float, default=420.0, help="seconds per config")
    g.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run; later configs skip")
    g.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results root")
    g.add_argument("--run-name", default=None, help="folder under <out>/<model>/ (default: UTC date)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--report-only", nargs="+", default=None, metavar="DIR",
                   help="rebuild report(s) from DIR/raw (or redraw from DIR/report.json)")
    g.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    return p


def resolve_text(path: str | None) -> str | None:
    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        p = p / "wiki.test.raw"
    if not p.is_file():
        raise SystemExit(f"--text: no such file: {p}")
    return str(p.resolve())


def rebuild_report(run_dir: Path, plots: bool = True) -> list[Path]:
    run_dir = Path(run_dir)
    raw = run_dir / RAW_DIR
    meta_path = run_dir / RUN_FILE
    if raw.is_dir() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        report = R.summarize(meta["model"], raw, meta.get("not_run"), meta.get("settings"))
        report["notes"] += meta.get("notes", [])
        return R.write_report(report, run_dir, raw, plots=plots)
    rp = run_dir / R.REPORT_JSON
    if not rp.is_file():
        raise SystemExit(f"{run_dir}: neither {RAW_DIR}/ with {RUN_FILE} nor {R.REPORT_JSON}")
    return R.write_report(json.loads(rp.read_text()), run_dir, None, plots=plots)


def write_rtn_controls(plan: list[C.RunConfig], rtn_dirs: dict[str, Path], skipped: list[dict]) -> list[C.RunConfig]:
    """Write (or reuse) the fake-quantized model folder of every RTN config and point the config at it; a config
    whose folder cannot be written is left out of the plan and listed in ``skipped`` with the reason."""
    out = []
    for c in plan:
        bits = C.rtn_bits(c.weights)
        if bits is None:
            out.append(c)
            continue
        dest = C.rtn_folder(rtn_dirs[c.model.name], c.model, c.weights)
        try:
            from tq_eval.rtn import write_rtn_folder

            folder = write_rtn_folder(c.model.path, dest, bits)
        except (ImportError, OSError, RuntimeError, ValueError) as e:
            skipped.append({"model": c.model.name, "dtype": c.dtype, "install": c.install, "weights": c.weights,
                            "reason": f"RTN control not written: {type(e).__name__}: {e}"})
            print(f"[tq-eval] {c.model.name} {c.weights}: RTN control not written: {e}", flush=True)
            continue
        print(f"[tq-eval] {c.model.name} {c.weights}: {'wrote' if folder.built else 'reusing'} {dest} "
              f"({len(folder.quantized)} tensors rounded)", flush=True)
        out.append(replace(c, served_path=str(dest)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        for d in args.report_only:
            for p in rebuild_report(Path(d), plots=not args.no_plots):
                print(p)
        return 0
    if not args.model:
        raise SystemExit("--model is required (or --report-only DIR)")
    if args.model_name and len(args.model_name) != len(args.model):
        raise SystemExit("give --model-name once per --model, or not at all")
    try:
        dtypes = C.parse_dtypes(args.dtypes or _default_dtypes())
        weights = C.parse_weights(args.weights)
        installs = C.parse_installs(args.installs)
        baseline_installs = C.parse_installs(args.baseline_installs) if args.baseline_installs else None
        niah_lengths = None if args.niah_lengths == "auto" else C.parse_int_list(args.niah_lengths, "--niah-lengths")
        tasks = C.TaskSettings(
            text_path=resolve_text(args.text),
            ppl_window_tokens=args.ppl_window, ppl_windows=args.ppl_windows, topk=args.topk,
            niah_lengths=niah_lengths, niah_depths=C.parse_float_list(args.niah_depths, "--niah-depths"),
            niah_samples=args.niah_samples, niah_seed=args.niah_seed,
            gsm8k_data=(args.gsm8k if args.gsm8k in (None, "hub") else str(Path(args.gsm8k).resolve())),
            gsm8k_limit=args.gsm8k_limit or None, gsm8k_fewshot=args.gsm8k_fewshot,
            tasks=[t.strip() for t in args.tasks.split(",") if t.strip()],
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    notes = []
    if "ppl" in tasks.tasks and not tasks.text_path:
        notes.append("perplexity/KL skipped: no --text given")
    if "gsm8k" in tasks.tasks and not tasks.gsm8k_data:
        notes.append("GSM8K skipped: no --gsm8k given")
    if tasks.gsm8k_data == "hub" and not args.online:
        raise SystemExit("--gsm8k hub needs --online (the config processes run with HF_HUB_OFFLINE=1 otherwise)")
    try:
        engine = C.EngineSettings(
            enforce_eager=not args.no_enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, prefill_chunk=args.prefill_chunk,
            max_num_seqs=args.max_num_seqs,
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if 0 < engine.prefill_chunk <= 128:
        notes.append("prefill chunk <= 128: stock TurboQuant routes such continuation chunks through its decode "
                     "kernel, so stock and ours are not compared on the same attention path")
    paths = {"stock": args.python_path_stock, "patched": args.python_path_patched}
    if set(installs) == {"stock", "patched"} and paths["stock"] == paths["patched"]:
        notes.append("stock and patched use the same Python path: both rows run the same vLLM")
    names = args.model_name or [None] * len(args.model)
    models = [C.ModelInfo.from_path(m, n) for m, n in zip(args.model, names)]
    if engine.prefill_chunk == 0:
        if "ppl" in tasks.tasks and tasks.text_path:
            raise SystemExit("--prefill-chunk 0 prefills each window whole, so no scored position would read the KV "
                             "cache and every dtype would score as bf16; give a chunk (e.g. 256) for perplexity, or "
                             "--tasks niah,gsm8k")
        for m in models:
            limit = engine.max_model_len or m.max_position_embeddings or 0
            if limit > engine.max_num_batched_tokens:
                raise SystemExit(
                    f"--prefill-chunk 0 prefills a prompt in one step, so --max-num-batched-tokens "
                    f"({engine.max_num_batched_tokens}) must cover the context length ({limit}, {m.name}); "
                    f"raise it or cap --max-model-len")
    plan, skipped = C.plan_configs(models, dtypes, installs, baseline_installs, weights)
    run_name = args.run_name or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    run_dirs = {m.name: Path(args.out) / m.name / run_name for m in models}
    rtn_dirs = {m.name: Path(args.rtn_dir) if args.rtn_dir else run_dirs[m.name] / RAW_DIR / RTN_DIR for m in models}
    for m in models:
        if any(c.weights != C.NO_WEIGHTS for c in plan if c.model == m) and not any(
                c.model == m and c.dtype == C.REFERENCE_DTYPE and c.weights == C.NO_WEIGHTS for c in plan):
            notes.append(f"{m.name}: weight configs without the bf16 run (KV dtype auto, weights none) have no "
                         "reference; add auto to --dtypes")
    est = SECONDS_PER_CONFIG * len(plan) / max(1, args.parallel)
    print(f"[tq-eval] {len(plan)} configs, about {est / 60:.1f} min at ~{SECONDS_PER_CONFIG} s each "
          f"(parallel {args.parallel})", flush=True)
    for c in plan:
        weights = "" if c.weights == C.NO_WEIGHTS else f"  weights {c.weights}"
        if C.rtn_bits(c.weights) is not None:
            weights += f" ({C.rtn_folder(rtn_dirs[c.model.name], c.model, c.weights)})"
        print(f"  {c.model.name:32s} {c.install:8s} {c.dtype}{weights}")
    for n in notes:
        print(f"[tq-eval] note: {n}")
    if args.dry_run:
        return 0
    plan = write_rtn_controls(plan, rtn_dirs, skipped)
    settings = {"engine": asdict(engine), "tasks": asdict(tasks), "installs": installs,
                "python_paths": paths, "argv": sys.argv[1:] if argv is None else argv}
    for m in models:
        d = run_dirs[m.name]
        (d / RAW_DIR).mkdir(parents=True, exist_ok=True)
        meta = {"model": asdict(m),
                "settings": {**settings, "weights": {"names": weights, "rtn_dir": str(rtn_dirs[m.name])}},
                "not_run": [s for s in skipped if s["model"] == m.name],
                "plan": [c.id for c in plan if c.model.name == m.name], "notes": notes}
        (d / RUN_FILE).write_text(json.dumps(meta, indent=1))

    from tq_eval.runner import execute

    def on_done(cfg, _res):
        # Rebuild this model's report after every config: a run cut short still leaves one.
        try:
            rebuild_report(run_dirs[cfg.model.name], plots=not args.no_plots)
        except Exception as e:  # noqa: BLE001 -- a report bug must not stop the remaining configs
            print(f"[tq-eval] report failed: {type(e).__name__}: {e}", flush=True)

    results = execute(
        plan, engine, tasks, {m.name: run_dirs[m.name] / RAW_DIR for m in models}, paths,
        python=args.python, parallel=args.parallel, timeout_s=args.config_timeout,
        time_budget_s=args.time_budget, offline=not args.online, on_done=on_done,
    )
    for m in models:
        for p in rebuild_report(run_dirs[m.name], plots=not args.no_plots):
            if p.suffix == ".md":
                print(f"[tq-eval] report: {p}")
    bad = [k for k, r in results.items() if r.get("status") not in ("ok",)]
    if bad:
        print(f"[tq-eval] {len(bad)} config(s) not fully ok: {', '.join(bad)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

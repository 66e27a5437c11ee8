#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What key centering costs in the paged kernels, per layer and step (Qwen3-8B heads: 32 query / 8 KV heads,
head_dim 128, pages of 16): decode attention with and without the centre term, the store of one decode token
per request (one launch; the three of a centred store; the two of its single-token path, which a decode-only
batch takes), and the sums launch alone. CUDA-graph replay timings
(median of triton.testing.do_bench), as a serving engine runs decode.

    python benchmarks/bench_key_centering.py --out bench_key_centering.json
    python benchmarks/bench_key_centering.py --smoke   # CPU / interpreter: run every launch once, no timing
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import build_batch, time_ms  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.paged import (  # noqa: E402
    TQAttentionPlan,
    new_center_sums,
    tq_key_center_sums,
    tq_store,
)

HQ, HKV, D, PAGE = 32, 8, 128, 16


def run_case(fmt: str, batch: int, context: int, device: str, smoke: bool) -> dict:
    b = build_batch(fmt, batch, context, hq=HQ, hkv=HKV, d=D, block_size=PAGE, device=device, keep_dense=False)
    lay, cache, bt, sl, qsl, q = b["layout"], b["cache"], b["block_table"], b["seq_lens"], b["qsl"], b["q"]
    theta = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # Qwen3's RoPE base
    cent = key_centering_tables(theta, D, PAGE, 40960, device=device)
    sums = new_center_sums(batch, HKV, cent, device)
    tq_key_center_sums(cache, lay, cent, bt, sl, sums)
    plan = TQAttentionPlan(lay, HQ, HKV, device, workspace_bytes=64 << 20)
    plan.plan(bt, qsl, sl, num_tokens=batch, max_query_len=1, max_seq_len=context)
    tri = TQAttentionPlan(lay, HQ, HKV, device, workspace_bytes=64 << 20)
    tri.plan(bt, qsl, sl, num_tokens=batch, max_query_len=1, max_seq_len=context)
    tri.decode_splits = 0  # the Triton kernel, which the plan keeps where the register-tile one does not apply
    out = torch.empty_like(q)
    g = torch.Generator(device=device).manual_seed(1)
    k = torch.randn(batch, HKV, D, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, HKV, D, device=device, dtype=torch.bfloat16, generator=g)
    last = context - 1  # the step's token: the last position of every request
    slots = bt[:, last // PAGE].long() * PAGE + last % PAGE
    fns = {
        "attention_plain": lambda: plan.run(q, cache, out=out),
        "attention_centred": lambda: plan.run(q, cache, out=out, centering=cent, center_sums=sums),
        "attention_plain_triton": lambda: tri.run(q, cache, out=out),
        "attention_centred_triton": lambda: tri.run(q, cache, out=out, centering=cent, center_sums=sums),
        "store_plain": lambda: tq_store(k, v, cache, slots, lay),
        "store_centred": lambda: tq_store(k, v, cache, slots, lay, centering=cent, query_start_loc=qsl, seq_lens=sl,
                                          block_table=bt, center_sums=sums),
        "store_centred_single": lambda: tq_store(k, v, cache, slots, lay, centering=cent, query_start_loc=qsl,
                                                 seq_lens=sl, block_table=bt, center_sums=sums,
                                                 single_token_requests=True),
        "sums": lambda: tq_key_center_sums(cache, lay, cent, bt, sl, sums),
    }
    row = dict(format=fmt, batch=batch, context=context, num_splits=plan.decode_splits or plan.num_splits,
               decode_kernel="register-tile" if plan.decode_splits else "triton", triton_num_splits=tri.num_splits)
    for name, fn in fns.items():
        if smoke:
            fn()
            row[name + "_ms"] = None
        else:
            row[name + "_ms"] = time_ms(fn, graph=True)
    if not smoke:
        row["attention_ratio"] = row["attention_centred_ms"] / row["attention_plain_ms"]
        row["layer_plain_ms"] = row["attention_plain_ms"] + row["store_plain_ms"]
        row["layer_centred_ms"] = row["attention_centred_ms"] + row["store_centred_ms"]
        row["layer_centred_single_ms"] = row["attention_centred_ms"] + row["store_centred_single_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench_key_centering.json"))
    ap.add_argument("--formats", nargs="+", default=["turboquant_k3v4_nc", "turboquant_4bit_nc"])
    ap.add_argument("--cases", nargs="+", default=["64x1280", "32x8448"], help="BATCHxCONTEXT")
    ap.add_argument("--smoke", action="store_true", help="run each launch once (CPU interpreter), no timing")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        ap.error("timing needs a CUDA device (use --smoke on the CPU)")
    rows = []
    for fmt in args.formats:
        for case in args.cases:
            batch, context = (int(x) for x in case.lower().split("x"))
            row = run_case(fmt, batch, context, device, args.smoke)
            rows.append(row)
            print(json.dumps(row), flush=True)
    import triton

    report = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter, smoke)",
                  torch=torch.__version__, triton=triton.__version__,
                  command="python benchmarks/bench_key_centering.py " + " ".join(argv or sys.argv[1:]), rows=rows)
    args.out.write_text(json.dumps(report, indent=1))
    if not args.smoke:
        print("| format | batch x context | attention plain ms | centred ms | ratio | store plain ms | "
              "store centred ms (3 launches) | (2 launches) | sums ms |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['format']} | {r['batch']} x {r['context']} | {r['attention_plain_ms']:.4f} | "
                  f"{r['attention_centred_ms']:.4f} | {r['attention_ratio']:.2f} | {r['store_plain_ms']:.4f} | "
                  f"{r['store_centred_ms']:.4f} | {r['store_centred_single_ms']:.4f} | {r['sums_ms']:.4f} |")
    return 0 if all(math.isfinite(x) for r in rows for x in r.values() if isinstance(x, float)) else 1


if __name__ == "__main__":
    sys.exit(main())

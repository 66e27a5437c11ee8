#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Decode attention time against the KV split count (Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128, pages
of 16), keys centred and plain, CUDA-graph replay: the measurements behind ``ops.paged_decode.num_decode_splits``.

    python benchmarks/sweep_decode_splits.py --out splits.json
    python benchmarks/sweep_decode_splits.py --cases 8x32768:16,24,29 --formats turboquant_4bit_nc --out s.json
    python benchmarks/sweep_decode_splits.py --cases 8x32768:24 --prefetch 0 1 --out s.json

Each case is BATCHxCONTEXT with the split counts to time (default: a spread around the heuristic's); the
heuristic's own count is always timed and marked.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import build_batch, time_ms  # noqa: E402
from turboquant_core.ops import paged_decode  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.paged import TQAttentionPlan, new_center_sums, tq_key_center_sums  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DEFAULT_CASES = ["8x32768:8,12,16,20,24,26,28,29,30,32,33,40,48,56,64", "16x16384:4,8,12,14,15,16,20,24,28,32",
                 "64x1280:1,2,3,4,5", "32x8448:4,6,7,8,9,10,12,14", "128x2048:1,2,3",
                 "4x65536:32,48,56,58,64,72,80,96,112,128"]


def parse_case(text: str) -> tuple[int, int, list[int]]:
    shape, _, splits = text.partition(":")
    batch, context = (int(x) for x in shape.lower().split("x"))
    return batch, context, [int(s) for s in splits.split(",") if s.strip()]


def sweep_case(fmt: str, batch: int, context: int, splits: list[int], device: str, prefetch: list[int]) -> list[dict]:
    b = build_batch(fmt, batch, context, hq=HQ, hkv=HKV, d=D, block_size=PAGE, device=device, keep_dense=False)
    lay, cache, bt, sl, qsl, q = b["layout"], b["cache"], b["block_table"], b["seq_lens"], b["qsl"], b["q"]
    theta = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # Qwen3's RoPE base
    cent = key_centering_tables(theta, D, PAGE, context + PAGE, device=device)
    sums = new_center_sums(batch, HKV, cent, device)
    tq_key_center_sums(cache, lay, cent, bt, sl, sums)
    out = torch.empty_like(q)
    # the count the plan picks by itself, for whichever decode kernel serves this batch on this device
    auto = TQAttentionPlan(lay, HQ, HKV, device, workspace_bytes=256 << 20)
    heuristic = auto.plan(bt, qsl, sl, num_tokens=batch, max_query_len=1, max_seq_len=context).decode_splits
    rows = []
    for s, pf in ((s, pf) for s in sorted(set(splits) | {heuristic}) for pf in prefetch):
        paged_decode.DECODE_PREFETCH = bool(pf)
        plan = TQAttentionPlan(lay, HQ, HKV, device, workspace_bytes=256 << 20)
        plan.plan(bt, qsl, sl, num_tokens=batch, max_query_len=1, max_seq_len=context, num_splits=s)
        row = dict(format=fmt, batch=batch, context=context, kernel=plan.decode_kernel, splits=plan.decode_splits,
                   heuristic=s == heuristic,
                   prefetch=int(pf), programs=batch * HKV * plan.decode_splits,
                   centred_ms=time_ms(lambda p=plan: p.run(q, cache, out=out, centering=cent, center_sums=sums),
                                      graph=True),
                   plain_ms=time_ms(lambda p=plan: p.run(q, cache, out=out), graph=True))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", nargs="+", default=["turboquant_k3v4_nc"])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="BATCHxCONTEXT:SPLITS,SPLITS,...")
    ap.add_argument("--prefetch", nargs="+", type=int, default=[int(paged_decode.DECODE_PREFETCH)],
                    help="time the kernel loading each next tile ahead (1: DECODE_PREFETCH) and not (0)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("timing needs a CUDA device")
    rows = [r for fmt in args.formats for case in args.cases
            for r in sweep_case(fmt, *parse_case(case), "cuda", args.prefetch)]
    import triton

    args.out.write_text(json.dumps(dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, command="python benchmarks/sweep_decode_splits.py " + " ".join(argv or sys.argv[1:]),
        rows=rows), indent=1))
    print("| format | batch x context | kernel | splits | prefetch | programs | centred us | plain us |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        mark = " (heuristic)" if r["heuristic"] else ""
        print(f"| {r['format']} | {r['batch']} x {r['context']} | {r['kernel']} | {r['splits']}{mark} | "
              f"{r['prefetch']} | {r['programs']} | {1e3 * r['centred_ms']:.1f} | {1e3 * r['plain_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

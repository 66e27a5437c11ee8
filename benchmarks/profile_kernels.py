#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Run each TurboQuant kernel of interest once inside a CUDA profiler range, for Nsight Compute.

Everything is compiled and warmed up first; then ``torch.cuda.profiler.start()`` opens the range and
each selected launch runs exactly once, so ``ncu --profile-from-start off`` reports one entry per
kernel with no compilation or warm-up launches mixed in:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \\
        python benchmarks/profile_kernels.py --what codec,decode

Shapes: the dense codec on 1M bf16 vectors of d = 128 (``tq bench``'s), decode attention and the
single-token store on the Qwen3-8B heads of ``bench_key_centering.py`` (32 / 8 heads, d = 128, pages of
16, 64 requests x 1280 tokens).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import build_batch  # noqa: E402
from turboquant_core.ops import codec  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.paged import TQAttentionPlan, new_center_sums, tq_key_center_sums, tq_store  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
WHAT = ("codec", "decode", "store")


def codec_launches(bits_list, n: int) -> dict:
    x = torch.randn(n, D, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    out = {}
    for b in bits_list:
        packed, scale = codec.encode(x, b, 0)
        out[f"encode_{b:g}bit"] = lambda b=b: codec.encode(x, b, 0)
        out[f"decode_{b:g}bit"] = lambda b=b, p=packed, s=scale: codec.decode(p, s, D, b, 0, torch.bfloat16)
    return out


def paged_launches(fmt: str, batch: int, context: int, what: set[str]) -> dict:
    b = build_batch(fmt, batch, context, hq=HQ, hkv=HKV, d=D, block_size=PAGE, device="cuda", keep_dense=False)
    lay, cache, bt, sl, qsl, q = b["layout"], b["cache"], b["block_table"], b["seq_lens"], b["qsl"], b["q"]
    theta = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cent = key_centering_tables(theta, D, PAGE, 40960, device="cuda")
    sums = new_center_sums(batch, HKV, cent, "cuda")
    tq_key_center_sums(cache, lay, cent, bt, sl, sums)
    plan = TQAttentionPlan(lay, HQ, HKV, "cuda", workspace_bytes=64 << 20)
    plan.plan(bt, qsl, sl, num_tokens=batch, max_query_len=1, max_seq_len=context)
    o = torch.empty_like(q)
    k = torch.randn(batch, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, HKV, D, device="cuda", dtype=torch.bfloat16)
    last = context - 1
    slots = bt[:, last // PAGE].long() * PAGE + last % PAGE
    out = {}
    if "decode" in what:
        out["attention_plain"] = lambda: plan.run(q, cache, out=o)
        out["attention_centred"] = lambda: plan.run(q, cache, out=o, centering=cent, center_sums=sums)
    if "store" in what:
        out["store_plain"] = lambda: tq_store(k, v, cache, slots, lay)
        out["store_centred_single"] = lambda: tq_store(k, v, cache, slots, lay, centering=cent,
                                                       query_start_loc=qsl, seq_lens=sl, block_table=bt,
                                                       center_sums=sums, single_token_requests=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", default="codec,decode,store", help=f"comma-separated subset of {', '.join(WHAT)}")
    ap.add_argument("--bits", default="3,4", help="codec bit widths")
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--format", default="turboquant_k3v4_nc")
    ap.add_argument("--case", default="64x1280", help="BATCHxCONTEXT for decode attention and the store")
    args = ap.parse_args(argv)
    what = {w.strip() for w in args.what.split(",") if w.strip()}
    if not what <= set(WHAT):
        ap.error(f"--what: unknown {sorted(what - set(WHAT))}; valid: {', '.join(WHAT)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    launches = {}
    if "codec" in what:
        launches.update(codec_launches([float(b) for b in args.bits.split(",")], args.vectors))
    if what & {"decode", "store"}:
        batch, context = (int(x) for x in args.case.lower().split("x"))
        launches.update(paged_launches(args.format, batch, context, what))
    for fn in launches.values():  # compile + warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in launches.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order:", ", ".join(launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TurboQuant MLA decode attention and store, one layer, CUDA-graph replay: time against the KV split count and the
share of the GPU's copy bandwidth the page reads reach (DeepSeek latents: kv_lora_rank 512, rope 64, pages of 16).

    python benchmarks/bench_mla_decode.py --out mla-decode.json
    python benchmarks/bench_mla_decode.py --cases 64x1024:2,4,8,16 --heads 16 128 --out m.json

Each case is BATCHxCONTEXT with the split counts to time (default: a spread around the heuristic's,
``ops.mla.mla_decode_splits``, whose own count is always timed and marked). Attention runs as the vLLM backend runs
it: queries already rotated by the folded absorbed weights (``rotated=True``), bf16 in and out. The store writes one
token per request (a decode step's). Bandwidth: the compressed pages the requests read (context x bytes per token)
over the time; the copy bandwidth is a 1 GiB device-to-device copy, read + write.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import time_ms  # noqa: E402
from turboquant_core.ops import mla as mla_ops  # noqa: E402
from turboquant_core.ops.mla import (  # noqa: E402
    MLA_DECODE_LAUNCH,
    MLADecodeLaunch,
    mla_decode_attention,
    mla_decode_kernel,
    mla_decode_splits,
    mla_store,
)
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout  # noqa: E402

LR, R, PAGE = 512, 64, 16
DEFAULT_CASES = ["64x1024:1,2,4,8,16", "32x8192:2,4,8,16,32", "384x2048:1,2", "8x32768:16,32,64", "1x8192:8,16,32,64"]


def parse_case(text: str) -> tuple[int, int, list[int]]:
    shape, _, splits = text.partition(":")
    try:
        batch, context = (int(x) for x in shape.lower().split("x"))
        return batch, context, [int(s) for s in splits.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"bad case {text!r}: expected BATCHxCONTEXT[:SPLITS,...], e.g. 64x1024:2,4,8") from None


def build(fmt: str, batch: int, context: int, heads: int, device: str, seed: int = 0) -> dict:
    """``batch`` requests of ``context`` tokens in shuffled pages (stored by mla_store), their rotated queries."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lay = mla_paged_layout(fmt, PAGE)
    per = -(-context // PAGE)
    nb = batch * per + 1
    cache = allocate_mla_cache(nb, lay, device)
    bt = (torch.randperm(nb - 1, generator=g)[: batch * per] + 1).view(batch, per).to(torch.int32).to(device)
    pos = torch.arange(context)
    for r in range(batch):  # one request at a time bounds the latents' memory
        kv_c = torch.nn.functional.rms_norm(torch.randn(context, LR, generator=g), (LR,)).to(torch.bfloat16)
        k_pe = torch.randn(context, R, generator=g).to(torch.bfloat16)
        slots = bt[r].long().cpu()[pos // PAGE] * PAGE + pos % PAGE
        mla_store(kv_c.to(device), k_pe.to(device), cache, slots.to(device), lay)
    q = torch.randn(batch, heads, LR, generator=g).to(torch.bfloat16).to(device)
    q_pe = torch.randn(batch, heads, R, generator=g).to(torch.bfloat16).to(device)
    sl = torch.full((batch,), context, dtype=torch.int32, device=device)
    return dict(layout=lay, cache=cache, block_table=bt, seq_lens=sl, q=q, q_pe=q_pe)


def copy_gbps(device: str) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3) / 1e9


@dataclass(frozen=True)
class LaunchSpec:
    """One decode launch to time: ``kernel`` (one of ``MLA_DECODE_KERNELS``; None: the kernel the vLLM backend runs)
    with ``settings``, the ``ops.mla`` constants it runs with, or ``triton``, the Triton kernel's launch shape."""

    kernel: str | None = None
    settings: tuple[tuple[str, int | None], ...] = ()
    triton: MLADecodeLaunch | None = None


def parse_launch(text: str) -> LaunchSpec:
    """``auto``: the kernel ``mla_decode_attention`` picks; ``wgmma[:STAGES]``: the warpgroup-MMA kernel (sm_90; with
    STAGES tiles in shared memory); ``mma:WARPS:DEPTH[:MAXNREG]``: the register-tile kernel with WARPS warps loading
    DEPTH tiles ahead (and at most MAXNREG registers per thread); HEADS,TOKENS,WARPS,STAGES: the Triton kernel."""
    kind, _, rest = text.partition(":")
    try:
        values = [int(x) for x in rest.split(":")] if rest else []
        if text == "auto":
            return LaunchSpec()
        if kind == "wgmma" and len(values) <= 1:
            return LaunchSpec("wgmma", tuple(zip(("MLA_WGMMA_STAGES",), values)))
        if kind == "mma" and len(values) in (2, 3):
            return LaunchSpec("mma", tuple(zip(("MLA_MMA_WARPS", "MLA_MMA_DEPTH", "MLA_MMA_MAXNREG"),
                                               (*values, None)[:3])))
        shape = text.split(",")
        if not rest and len(shape) == 4:
            return LaunchSpec("triton", triton=MLADecodeLaunch(*(int(x) for x in shape)))
    except (ValueError, TypeError):
        pass
    raise SystemExit(f"bad launch {text!r}: expected auto, wgmma[:STAGES], mma:WARPS:DEPTH[:MAXNREG] or "
                     "HEADS,TOKENS,WARPS,STAGES (e.g. 16,32,4,1)")


@contextlib.contextmanager
def applied(spec: LaunchSpec):
    """``spec``'s settings on ``ops.mla`` for the duration, the shipped values back afterwards."""
    shipped = {name: getattr(mla_ops, name) for name, _ in spec.settings}
    try:
        for name, value in spec.settings:
            setattr(mla_ops, name, value)
        yield
    finally:
        for name, value in shipped.items():
            setattr(mla_ops, name, value)


def kernel_name(layout, device: str, spec: LaunchSpec) -> str:
    """What ``spec`` runs, under its settings (call inside ``applied(spec)``)."""
    kernel = spec.kernel or mla_decode_kernel(layout, device)
    if kernel == "wgmma":
        return f"warpgroup MMA, {mla_ops.MLA_WGMMA_STAGES} stages"
    if kernel == "mma":
        cap = f", at most {mla_ops.MLA_MMA_MAXNREG} registers" if mla_ops.MLA_MMA_MAXNREG else ""
        return f"register-tile {mla_ops.MLA_MMA_WARPS} warps, {mla_ops.MLA_MMA_DEPTH} ahead{cap}"
    la = spec.triton or MLA_DECODE_LAUNCH
    return f"triton {la.heads},{la.tokens},{la.warps},{la.stages}"


def run_case(fmt: str, batch: int, context: int, splits: list[int], heads: int, device: str,
             copy: float, launches: list[LaunchSpec]) -> list[dict]:
    b = build(fmt, batch, context, heads, device)
    lay, cache, bt, sl, q, q_pe = b["layout"], b["cache"], b["block_table"], b["seq_lens"], b["q"], b["q_pe"]
    scale = (128 + R) ** -0.5
    page_bytes = batch * context * lay.fmt.bytes_per_token()
    kv_c = torch.nn.functional.rms_norm(torch.randn(batch, LR, device=device), (LR,)).to(torch.bfloat16)
    k_pe = torch.randn(batch, R, device=device).to(torch.bfloat16)
    slots = (bt[:, -1].long() * PAGE + PAGE - 1).contiguous()  # one token per request, as a decode step stores
    store_ms = time_ms(lambda: mla_store(kv_c, k_pe, cache, slots, lay), graph=True)
    rows = []
    for spec in launches:
        kernel = spec.kernel or mla_decode_kernel(lay, device)
        own = mla_decode_splits(batch, heads, context, torch.device(device), kernel)
        tile_heads = spec.triton.heads if spec.triton else 16
        for s in sorted(set(splits) | {own}):
            with applied(spec):
                name = kernel_name(lay, device, spec)
                ms = time_ms(lambda s=s, spec=spec: mla_decode_attention(
                    q, q_pe, cache, lay, bt, sl, scale, num_splits=s, rotated=True, launch=spec.triton,
                    kernel=spec.kernel), graph=True)
            gbps = page_bytes / (ms * 1e-3) / 1e9
            row = dict(format=fmt, heads=heads, batch=batch, context=context, splits=s, heuristic=s == own,
                       kernel=name, programs=batch * -(-heads // tile_heads) * s, attention_us=1e3 * ms,
                       page_bytes=page_bytes, gb_per_s=gbps, copy_share=gbps / copy, store_us=1e3 * store_ms)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", nargs="+", default=["turboquant_k3v4_nc", "turboquant_4bit_nc"])
    ap.add_argument("--heads", nargs="+", type=int, default=[16], help="query heads (DeepSeek-V2-Lite 16, V3 128)")
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="BATCHxCONTEXT:SPLITS,SPLITS,...")
    ap.add_argument("--launch", nargs="+", type=parse_launch, default=[LaunchSpec()],
                    help="auto (the kernel the vLLM backend runs), wgmma[:STAGES] (the warpgroup-MMA kernel), "
                    "mma:WARPS:DEPTH[:MAXNREG] (the register-tile kernel) or Triton launch shapes "
                    "HEADS,TOKENS,WARPS,STAGES")
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in args.cases]
    if not torch.cuda.is_available():
        ap.error("timing needs a CUDA device")
    copy = copy_gbps("cuda")
    rows = [r for fmt in args.formats for h in args.heads for case in cases
            for r in run_case(fmt, *case, h, "cuda", copy, args.launch)]
    import triton

    args.out.write_text(json.dumps(dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, copy_gb_per_s=copy,
        command="python benchmarks/bench_mla_decode.py " + " ".join(argv or sys.argv[1:]), rows=rows), indent=1))
    print(f"copy bandwidth {copy:.0f} GB/s")
    print("| format | heads | batch x context | kernel | splits | programs | attention us | GB/s | % of copy | "
          "store us |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mark = " (heuristic)" if r["heuristic"] else ""
        print(f"| {r['format']} | {r['heads']} | {r['batch']} x {r['context']} | {r['kernel']} | {r['splits']}{mark} | "
              f"{r['programs']} | {r['attention_us']:.1f} | {r['gb_per_s']:.0f} | {100 * r['copy_share']:.1f} | "
              f"{r['store_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

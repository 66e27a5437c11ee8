# SPDX-License-Identifier: Apache-2.0
"""Where the dense encode kernel spends its time, and what each change to it bought.

Stages (one-segment formats, power-of-two d <= 256, bf16 input: the ``tq bench`` case), each a kernel
that stores the fp16 scale (and, from ``previous`` on, the packed indices):
  load           load the rows, their norms, store the scale: the memory floor of this launch shape
  rotate         + the previous encoder's rotation (bf16 rows scaled by a power of two into an exact
                 fp16 operand, one [d, d] product)
  quant          + its codebook search (two selects per boundary: the index and |c|) and sum of c^2
  previous       + packing through a [BN, 8, d/8] reshape: the encoder before the changes below
  sliced         ``previous`` with the rotation as 8 products of [d, d/8], one per packing slot, so the
                 8 index tiles share one layout and pack with shifts (no reshape across threads)
  sliced-levels  ``sliced`` with one select per boundary of a word holding the half-index and c^2
                 (``rotation_tables.encoder_levels``) and the sign half by one xor
  library        ``turboquant_core.ops.codec.encode``: ``sliced-levels`` with the bf16 rows as the
                 products' operand against bf16 +-1 rows (no rescale / fp16 conversion) and c^2 summed over
                 the slots in registers before one row reduction
and ``decode`` (``turboquant_core.ops.codec.decode``, bf16 output) for reference.

    python benchmarks/ablate_codec_encode.py --vectors 1000000 --dim 128 --bits 3,4 --out ablate.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from turboquant_core.bench import BF16_BYTES, SCALE_BYTES, copy_bandwidth_gbs, device_name, index_bytes, parse_bits
from turboquant_core.kernels.codec_jit import _pack_store, _quantize_segment, _segment_valid
from turboquant_core.ops.codec import decode, encode
from turboquant_core.ops.rotation_tables import codec_tables

STAGES = ("load", "rotate", "quant", "previous", "sliced", "sliced-levels", "library", "decode")


@triton.jit
def _prev_exact_f16(x, norm):
    """The previous encoder's bf16 -> fp16 operand: rows scaled by a power of two so the norm lands in
    [2^14, 2^15) (exact: 8 significant bits fit in fp16's 11)."""
    ebits = (norm.to(tl.int32, bitcast=True) >> 23) & 0xFF
    ebits = tl.minimum(tl.maximum(ebits, 14), 254)
    pow2 = ((268 - ebits) << 23).to(tl.float32, bitcast=True)
    pow2 = tl.where(norm > 0, pow2, 1.0)
    return (x.to(tl.float32) * pow2[:, None]).to(tl.float16), pow2


@triton.jit
def _prev_rotate(x16, ROT, row0, P: tl.constexpr, D_PAD: tl.constexpr):
    p = tl.arange(0, P)
    i = tl.arange(0, D_PAD)
    return tl.dot(x16, tl.load(ROT + (row0 + p)[None, :] * D_PAD + i[:, None]))


@triton.jit
def _prev_quantize(s, BND, CENT, NLEV: tl.constexpr):
    """The previous search: per positive boundary one compare and two selects (index, |c|)."""
    H: tl.constexpr = NLEV // 2
    a = tl.abs(s)
    cnt = tl.zeros(s.shape, dtype=tl.int32)
    cabs = tl.zeros(s.shape, dtype=tl.float32) + tl.load(CENT + H)
    for m in tl.static_range(H - 1):
        above = a > tl.load(BND + H + m)
        cnt = tl.where(above, m + 1, cnt)
        cabs = tl.where(above, tl.load(CENT + H + m + 1), cabs)
    return tl.where(s > 0, H + cnt, H - 1 - cnt), cabs * cabs


@triton.jit
def ablate_encode_kernel(X, stride_x, ROT_HI, CENT0, BND0, LEV0, OUT, stride_out, SCALE, N, rot_scale, sqrt_d,
                         D: tl.constexpr, D_PAD: tl.constexpr, G0: tl.constexpr, GP0: tl.constexpr,
                         B0: tl.constexpr, STAGE: tl.constexpr, BN: tl.constexpr):
    """STAGE: index into ``STAGES`` (0 .. 5)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    i = tl.arange(0, D_PAD)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + i[None, :], mask=rmask[:, None] & (i < D)[None, :],
                other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, axis=1))
    out_off = rows.to(tl.int64) * stride_out
    if STAGE == 0:
        scale = norm
    else:
        inv_norm = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
        x16, pow2 = _prev_exact_f16(x, norm)
        row_mul = (inv_norm / pow2 * (sqrt_d * rot_scale))[:, None]
        if STAGE >= 4:
            g = tl.arange(0, GP0)
            valid = (g < G0)[None, :]
            word = tl.zeros((BN, GP0), dtype=tl.uint32)
            sumsq = tl.zeros((BN,), dtype=tl.float32)
            for j in tl.static_range(8):
                t = _prev_rotate(x16, ROT_HI, j * GP0, GP0, D_PAD) * row_mul
                if STAGE == 4:
                    idx, sq = _prev_quantize(t, BND0, CENT0, 1 << B0)
                else:
                    idx, sq = _quantize_segment(t, BND0, LEV0, 1 << B0)
                sumsq += tl.sum(tl.where(valid, sq, 0.0), axis=1)
                word |= idx.to(tl.uint32) << (B0 * j)
            for k in tl.static_range(B0):
                tl.store(OUT + out_off[:, None] + k * G0 + g[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8),
                         mask=rmask[:, None] & valid)
        else:
            t0 = _prev_rotate(x16, ROT_HI, 0, 8 * GP0, D_PAD) * row_mul
            if STAGE == 1:
                sumsq = tl.sum(t0, axis=1)  # keeps the product
            else:
                idx0, sq0 = _prev_quantize(t0, BND0, CENT0, 1 << B0)
                sumsq = tl.sum(tl.where(_segment_valid(BN, G0, GP0), sq0, 0.0), axis=1)
                if STAGE == 3:
                    _pack_store(idx0, OUT, out_off, rmask, 0, BN, G0, GP0, B0)
                else:
                    sumsq += tl.sum(idx0, axis=1).to(tl.float32)  # keeps the search
        scale = tl.where(sumsq > 0, norm / tl.sqrt(tl.maximum(sumsq, 1e-30)), 0.0)
    tl.store(SCALE + rows, tl.minimum(scale, 65504.0).to(tl.float16), mask=rmask)


def run_stage(x: torch.Tensor, bits: float, stage: str, block_rows: int, num_warps: int):
    n, dim = x.shape
    if stage == "library":
        return encode(x, bits, 0, block_rows=block_rows, num_warps=num_warps)
    t = codec_tables(dim, bits, 0, str(x.device))
    if len(t.segments) != 1 or not t.exact_rot or t.dim_pad > 256 or t.segments[0].groups_pad < 16:
        raise ValueError("the ablation covers one-segment formats with a Hadamard rotation, 128 <= d <= 256")
    out = torch.empty(n, t.index_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(n, dtype=torch.float16, device=x.device)
    s = t.segments[0]
    ablate_encode_kernel[(triton.cdiv(n, block_rows),)](
        x, x.stride(0), t.rot_hi, t.centroids[0], t.boundaries[0], t.levels[0], out, out.stride(0), scale, n,
        t.rot_scale, math.sqrt(dim), D=dim, D_PAD=t.dim_pad, G0=s.groups, GP0=s.groups_pad, B0=s.bits,
        STAGE=STAGES.index(stage), BN=block_rows, num_warps=num_warps)
    return out, scale


def _ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stages = args.stages.split(",")
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stages {bad}; valid: {', '.join(STAGES)}")
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    n, dim = args.vectors, args.dim
    x = torch.randn(n, dim, generator=torch.Generator(device=dev).manual_seed(0), device=dev).to(torch.bfloat16)
    results = []
    for b in parse_bits(args.bits):
        ref = encode(x, b, 0)
        moved = n * dim * BF16_BYTES + n * (index_bytes(dim, b) + SCALE_BYTES)
        for bn in map(int, args.rows.split(",")):
            for nw in map(int, args.warps.split(",")):
                for stage in stages:
                    row = {"bits": b, "dim": dim, "vectors": n, "block_rows": bn, "num_warps": nw, "stage": stage}
                    try:
                        if stage == "decode":
                            fn = functools.partial(decode, ref[0], ref[1], dim, b, 0, torch.bfloat16,
                                                   block_rows=bn, num_warps=nw)
                        else:
                            fn = functools.partial(run_stage, x, b, stage, bn, nw)
                            if stage not in ("load", "rotate", "quant"):
                                p, s = fn()
                                # against the library at its default launch (the stored format)
                                row["bytes_differing_from_encode"] = int((p != ref[0]).sum())
                                row["scales_differing_from_encode"] = int((s != ref[1]).sum())
                        ms = _ms(fn)
                        gbs = moved / (ms * 1e-3) / 1e9
                        row.update(ms=ms, gbs=gbs, fraction_of_copy=gbs / copy["gbs"])
                    except Exception as e:  # a variant that fails to compile is a result too
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(json.dumps(row), flush=True)
                    results.append(row)
    doc = {"device": device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join(sys.argv), "copy": copy, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Variant not kept: two packing slots per product ([d, 2 * d/8] rows, the pair split with tl.split).

    PYTHONPATH=$PWD python benchmarks/results/2026-11-23-h100-codec-encode-sliced/exploratory/pairs_encode.py
"""

import triton
import triton.language as tl

from turboquant_core.kernels.codec_jit import INTERPRETING, _quantize_segment


@triton.jit
def _rotate_pair(x, ROT, row0, GP: tl.constexpr, D_PAD: tl.constexpr):
    """Slots (2p, 2p+1) of a segment in one [D_PAD, 2*GP] product, column 2g + jj = slot 2p + jj, group g."""
    c = tl.arange(0, 2 * GP)
    rows = row0 + (c % 2) * GP + c // 2
    i = tl.arange(0, D_PAD)
    r = tl.load(ROT + rows[None, :] * D_PAD + i[:, None])
    if INTERPRETING and x.dtype == tl.bfloat16:
        t = tl.dot(x.to(tl.float32), r.to(tl.float32))
    else:
        t = tl.dot(x, r)
    return tl.split(tl.reshape(t, (x.shape[0], GP, 2)))


@triton.jit
def pairs_encode_kernel(X, stride_x, ROT, LEV0, BND0, OUT, stride_out, SCALE, N, rot_scale, sqrt_d,
                        D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr,
                        BN: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    i = tl.arange(0, D_PAD)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + i[None, :], mask=rmask[:, None] & (i < D)[None, :],
                other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, axis=1))
    inv_norm = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
    row_mul = (inv_norm * (sqrt_d * rot_scale))[:, None]
    out_off = rows.to(tl.int64) * stride_out
    g = tl.arange(0, GP)
    valid = (g < G)[None, :]
    word = tl.zeros((BN, GP), dtype=tl.uint32)
    c2 = tl.zeros((BN, GP), dtype=tl.float32)
    for p in tl.static_range(4):
        ta, tb = _rotate_pair(x, ROT, 2 * p * GP, GP, D_PAD)
        ia, sa = _quantize_segment(ta * row_mul, BND0, LEV0, 1 << B)
        ib, sb = _quantize_segment(tb * row_mul, BND0, LEV0, 1 << B)
        c2 += sa + sb
        word |= (ia.to(tl.uint32) << (B * 2 * p)) | (ib.to(tl.uint32) << (B * (2 * p + 1)))
    for k in tl.static_range(B):
        tl.store(OUT + out_off[:, None] + k * G + g[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8),
                 mask=rmask[:, None] & valid)
    sumsq = tl.sum(tl.where(valid, c2, 0.0), axis=1)
    scale = tl.where(sumsq > 0, norm / tl.sqrt(tl.maximum(sumsq, 1e-30)), 0.0)
    tl.store(SCALE + rows, tl.minimum(scale, 65504.0).to(tl.float16), mask=rmask)


def run_pairs(x, b, bn, nw):
    import math

    import torch

    from turboquant_core.ops.rotation_tables import codec_tables
    n = x.shape[0]
    t = codec_tables(128, b, 0, str(x.device))
    out = torch.empty(n, t.index_bytes, dtype=torch.uint8, device=x.device)
    sc = torch.empty(n, dtype=torch.float16, device=x.device)
    pairs_encode_kernel[(triton.cdiv(n, bn),)](x, 128, t.rot_bf16, t.levels[0], t.boundaries[0], out, out.stride(0),
                                              sc, n, t.rot_scale, math.sqrt(128), D=128, D_PAD=128, G=16, GP=16,
                                              B=int(b), BN=bn, num_warps=nw)
    return out, sc


if __name__ == "__main__":
    import functools

    import torch
    import triton.testing

    from turboquant_core.ops.codec import encode
    x = torch.randn(1000000, 128, device="cuda").to(torch.bfloat16)
    moved = {3: 306e6, 4: 322e6}
    for b in (3, 4):
        ref = encode(x, b, 0)
        for bn, nw in ((64, 4), (128, 8), (128, 4)):
            p, s = run_pairs(x, b, bn, nw)
            ms_p = triton.testing.do_bench(functools.partial(run_pairs, x, b, bn, nw), warmup=25, rep=200,
                                           return_mode="median")
            ms_l = triton.testing.do_bench(functools.partial(encode, x, b, 0, block_rows=bn, num_warps=nw),
                                           warmup=25, rep=200, return_mode="median")
            diff = (p != ref[0]).sum().item()
            print(f"bits {b} rows {bn} warps {nw}: library {ms_l:.4f} ms ({moved[b] / ms_l / 3.0e9 * 100:.1f} %), "
                  f"pairs {ms_p:.4f} ms ({moved[b] / ms_p / 3.0e9 * 100:.1f} %), bytes diff {diff}")

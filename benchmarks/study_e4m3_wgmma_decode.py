#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study (compile only, no GPU): one decode-attention loop with e4m3 tensor-core operands through Hopper warpgroup MMA
(wgmma, A operand in registers, B in shared memory), for GQA decode (head_dim 128, 4 query heads per KV head padded
to N = 8, one warpgroup of 4 warps per program, 64 tokens per tile). Compiled for sm_90a with Triton's bundled ptxas;
the loop's SASS is counted with ``sass_loop_mix.loop_mix`` next to ``tq_paged_decode_kernel`` (649 per 16 tokens at
k3v4, ``benchmarks/results/2026-11-26-cpu-decode-sass-mix``).

Per 64-token tile:
1. S^T [64 tok, 8 q] = K [64, 128] (e4m3, looked up in registers from 3-bit indices) @ Q'^T [128, 8] (e4m3, shared
   memory, stored once before the loop): 4 x QGMMA.64x8x32;
2. online softmax over the tokens (columns are queries; the column maxima cross the 4 warps), P^T * v_scale to shared
   memory as e4m3;
3. O^T [128 ch, 8 q] += V^T [128, 64 tok] (e4m3, looked up from 4-bit indices) @ P^T [64, 8]: 4 x QGMMA.64x8x32.

Page formats this assumes (page = 16 tokens; study formats, not today's planar-byte pages):
- keys, token-major (per-token writes as today): a token's 128 3-bit indices as 12 words, [W0 x 4 | W1 x 4 | W2 x 4]
  over the 4 threads (``tid`` = lane % 4) that hold the token's A-operand row; for one thread's 32 dims W0 and W1 hold
  8 fields each as prmt selectors (field in bits 0-2 of its nibble), their 8 spare nibble bits 3 hold bit 2 of the
  other 16 fields, whose bits 0-1 fill W2 in nibble bits 0-1 (fields 16-23) and 2-3 (fields 24-31). Decode per
  thread and token: sel = W0 & 0x77777777, W1 & 0x77777777, (W2 & 0x33333333) | ((W0 >> 1) & 0x44444444),
  ((W2 >> 2) & 0x33333333) | ((W1 >> 1) & 0x44444444); each selector word -> 2 prmt (low half, >> 16) with the
  8-entry e4m3 codebook in two registers: 4 values per prmt, already the A operand's 4 consecutive-k bytes.
- values, channel-major inside a page (NOT what the store kernel writes today: a token's 4-bit indices become nibbles
  scattered over 128 words, so a per-token store needs read-modify-write or a page-granular writer): per channel
  2 words of 8 tokens each, sign-magnitude indices (bit 3 = sign, bits 0-2 = |value| rank: a symmetric Lloyd-Max
  codebook, so this is only a relabelling at encode time): nibbles' bits 0-2 = magnitudes, sign of the low four
  tokens at bits 7, 15, 23, 31, of the high four at 3, 11, 19, 27. Decode per word (8 values): m = w & 0x77777777,
  2 prmt (m, m >> 16) into the 8 magnitudes (two registers), xor the signs (w & 0x80808080, (w << 4) & 0x80808080).
The rotated coordinates may be permuted freely (query and output rotations permuted alike), so the dim order of the
K fields and the channel order of V are free; the token order of P^T follows V's (one page per thread: V^T column
k = kb*32 + h*16 + tid*4 + j holds token tid*16 + kb*8 + h*4 + j of the tile).

    python benchmarks/study_e4m3_wgmma_decode.py [--out mix.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRMT_LOOKUP_8 = gl.constexpr("prmt.b32 $0, $5, $9, $1;")  # pack 4: $1-$4 selector, $5-$8 / $9-$12 table regs
PRMT_LOOKUP_8_SIGN = gl.constexpr("{ .reg .b32 t; prmt.b32 t, $5, $9, $1; xor.b32 $0, t, $13; }")


@gluon.constexpr_function
def key5_layout():
    """[64 tok, 4 sw, 2 h, 4 tid, 4 j] -> the wgmma A operand [64, 128] (k = sw*32 + h*16 + tid*4 + j) reg by reg."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                   [0, 2, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[64, 4, 2, 4, 4])


@gluon.constexpr_function
def keyword_layout():
    """[64 tok, 4 tid]: one index word per (token, thread)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def val5_layout():
    """[128 ch, 2 kb, 2 h, 4 tid, 4 j] -> the A operand V^T [128, 64] (k = kb*32 + h*16 + tid*4 + j)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                   [64, 0, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[128, 2, 2, 4, 4])


@gluon.constexpr_function
def valword_layout():
    """[128 ch, 2 kb, 4 tid]: one index word (8 tokens of one channel) per (channel, kb, thread)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0], [0, 1, 0], [64, 0, 0]], lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[128, 2, 4])


@gluon.constexpr_function
def valword4_layout():
    """[64 channel pairs, 2 kb, 2 h, 4 tid] (token-interleaved V pages): pair p = channels (p // 8) * 16 + p % 8 and
    that + 8 (the A operand's row + 8 register), one word = 4 tokens of the pair."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 1, 0, 0], [32, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[64, 2, 2, 4])


COMPACT = gl.constexpr("prmt.b32 $0, $1, 0, 0x0020;")  # bytes 0 and 2 -> the low 16 bits (4 nibble selectors)


@gluon.jit
def _lookup(sel4, tab0, tab1, L5: gl.constexpr, SHAPE: gl.constexpr):
    """Selectors [.., 4 tid] (one 16-bit prmt selector per A-operand register) -> e4m3 values [.., 4 tid, 4 j] in the
    A-operand layout: one prmt per register (the selector broadcast over j: pack 4 gives the asm one register)."""
    sel5 = gl.expand_dims(gl.convert_layout(sel4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sel5 = sel5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    return gl.inline_asm_elementwise(PRMT_LOOKUP_8, "=r,r,r,r,r,r,r,r,r,r,r,r,r", [sel5, tab0, tab1],
                                     dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _lookup_sign(sel4, sgn4, tab0, tab1, L5: gl.constexpr, SHAPE: gl.constexpr):
    sel5 = gl.expand_dims(gl.convert_layout(sel4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sel5 = sel5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    sgn5 = gl.expand_dims(gl.convert_layout(sgn4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sgn5 = sgn5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    return gl.inline_asm_elementwise(PRMT_LOOKUP_8_SIGN, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [sel5, tab0, tab1, sgn5], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _halves(x):
    """[64, 4] selector words -> [64, 2 h, 4]: low half, high half (prmt reads bits 0-15)."""
    return gl.permute(gl.join(x, x >> 16), [0, 2, 1])


@gluon.jit(do_not_specialize=["lo", "hi"])
def e4m3_wgmma_decode_kernel(QF8, KW, VW, SC, BT, O, L, lo, hi, kt0, kt1, vt0, vt1,
                             KPAGE_W: gl.constexpr, VPAGE_W: gl.constexpr, SC_PAGE: gl.constexpr,
                             VTOK: gl.constexpr):
    """One program = one (request, KV head, split): tokens [lo, hi) of the pages in BT (16 tokens a page). QF8 [8, 128]
    e4m3 (queries rotated, pre-scaled, log2 domain); KW / VW int32 pages (module docstring); SC fp16 [page, 2, 16] key
    and value scales; kt0/kt1, vt0/vt1 the e4m3 codebooks (key 8 entries, value 8 magnitudes) as two registers."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    k5: gl.constexpr = key5_layout()
    kw_l: gl.constexpr = keyword_layout()
    v5: gl.constexpr = val5_layout()
    vw_l: gl.constexpr = valword_layout()
    sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ps_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    # Q'^T in shared memory, K-major (e4m3 B operands must be): stored [8 q, 128 d], read as [128, 8].
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    qr = gl.arange(0, 8, layout=gl.SliceLayout(1, blk))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [8, 128], sm_l, gl.load(QF8 + qr[:, None] * 128 + qc[None, :]))
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [8, 64], ps_l)

    # Key words: token row r of the tile (page r // 16, warp-uniform), thread tid.
    krow = gl.arange(0, 64, layout=gl.SliceLayout(1, kw_l))
    ktid = gl.arange(0, 4, layout=gl.SliceLayout(0, kw_l))
    # Value words: channel, kb, thread (the thread's page of the tile is tid).
    vch = gl.arange(0, 128, layout=gl.SliceLayout(1, gl.SliceLayout(2, vw_l)))
    vkb = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, vw_l)))
    vtid = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, vw_l)))
    voff = (vch[:, None, None] * 2 + vkb[None, :, None])
    ts = gl.arange(0, 64, layout=tok_l)
    if VTOK:
        vw4: gl.constexpr = valword4_layout()
        vp4 = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, vw4))))
        vkb4 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, vw4))))
        vh4 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, vw4))))
        vtid4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, vw4))))
        voff4 = (vkb4[None, :, None] * 2 + vh4[None, None, :]) * 64 + vp4[:, None, None]
        voff4 = gl.expand_dims(voff4, 3)

    m_i = gl.full([8], float("-inf"), gl.float32, layout=col_l)
    l_acc = gl.zeros([64, 8], gl.float32, layout=mma)
    acc = gl.zeros([128, 8], gl.float32, layout=mma)
    for start in range(lo, hi, 64):
        pg0 = start // 16
        # keys: one page per warp (rows r, r + 8 of a thread share it)
        kpage = gl.load(BT + pg0 + krow // 16)
        kbase = KW + kpage[:, None] * KPAGE_W + (krow % 16)[:, None] * 12 + ktid[None, :]
        w0 = gl.load(kbase)
        w1 = gl.load(kbase + 4)
        w2 = gl.load(kbase + 8)
        s0 = w0 & 0x77777777
        s1 = w1 & 0x77777777
        s2 = (w2 & 0x33333333) | ((w0 >> 1) & 0x44444444)
        s3 = ((w2 >> 2) & 0x33333333) | ((w1 >> 1) & 0x44444444)
        sel = gl.join(gl.join(_halves(s0), _halves(s1)), gl.join(_halves(s2), _halves(s3)))  # [64, 2h, 4tid, 2, 2]
        sel = gl.reshape(gl.permute(sel, [0, 4, 3, 1, 2]), [64, 4, 2, 4])
        kt = gl.reshape(_lookup(sel, kt0, kt1, k5, [64, 4, 2, 4, 4]), [64, 128])
        kt = gl.convert_layout(kt, a_op, assert_trivial=True)
        s = warpgroup_mma(kt, q_smem.permute((1, 0)), gl.zeros([64, 8], gl.float32, layout=mma))

        tpage = gl.load(BT + pg0 + ts // 16)
        ksc = gl.load(SC + tpage * SC_PAGE + ts % 16).to(gl.float32)
        vsc = gl.load(SC + tpage * SC_PAGE + 16 + ts % 16).to(gl.float32)
        s = gl.where((start + ts < hi)[:, None], s * ksc[:, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.ceil(gl.max(s, axis=0)))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_acc = l_acc * alpha[None, :] + p
        raised = gl.max((m_new > m_i).to(gl.int32), axis=0) > 0
        m_i = m_new
        if raised:
            acc = acc * alpha[None, :]
        # P^T [64 k, 8] in V's token order: k = kb*32 + h*16 + tid*4 + j <- token tid*16 + kb*8 + h*4 + j
        pv = (p * vsc[:, None]).to(gl.float8e4nv)
        pv = gl.reshape(gl.permute(gl.reshape(pv, [4, 2, 2, 4, 8]), [1, 2, 0, 3, 4]), [64, 8])
        p_smem.store(gl.permute(pv, [1, 0]))
        fence_async_shared()
        gl.thread_barrier()

        # values: V^T [128 ch, 64 k], thread tid's 16 tokens from page pg0 + tid
        if VTOK:
            # token-interleaved page: word (4-token group, channel pair p) = one byte per token, channel
            # a = (p // 8) * 16 + p % 8 in its low nibble, a + 8 in its high nibble
            vpage = gl.load(BT + pg0 + vtid4)
            vw = gl.load(VW + (vpage * VPAGE_W)[None, None, None, :] + voff4).to(gl.uint32, bitcast=True)
            xa = (vw & 0x07070707) | ((vw >> 4) & 0x70707070)
            xb = ((vw >> 4) & 0x07070707) | ((vw >> 8) & 0x70707070)
            xa = gl.inline_asm_elementwise(COMPACT, "=r,r", [xa], dtype=gl.uint32, is_pure=True, pack=1)
            xb = gl.inline_asm_elementwise(COMPACT, "=r,r", [xb], dtype=gl.uint32, is_pure=True, pack=1)
            vsel = gl.reshape(gl.permute(gl.reshape(gl.join(xa, xb), [8, 8, 2, 2, 4, 2]), [0, 5, 1, 2, 3, 4]),
                              [128, 2, 2, 4])
            vsgn = gl.join((vw << 4) & 0x80808080, vw & 0x80808080)
            vsgn = gl.reshape(gl.permute(gl.reshape(vsgn, [8, 8, 2, 2, 4, 2]), [0, 5, 1, 2, 3, 4]), [128, 2, 2, 4])
        else:
            vpage = gl.load(BT + pg0 + vtid)
            vw = gl.load(VW + (vpage * VPAGE_W)[None, None, :] + voff).to(gl.uint32, bitcast=True)
            m = vw & 0x77777777
            vsel = gl.permute(gl.join(m, m >> 16), [0, 1, 3, 2])  # [128, 2 kb, 2 h, 4 tid]
            vsgn = gl.permute(gl.join(vw & 0x80808080, (vw << 4) & 0x80808080), [0, 1, 3, 2])
        vt = gl.reshape(_lookup_sign(vsel, vsgn, vt0, vt1, v5, [128, 2, 2, 4, 4]), [128, 64])
        vt = gl.convert_layout(vt, a_op, assert_trivial=True)
        acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc)
        gl.thread_barrier()  # P^T is rewritten by the next tile

    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[None, :]
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, 8, layout=col_l)
    gl.store(O + cols[None, :] * 128 + od[:, None], o)
    gl.store(L + cols, gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf")))


def compile_kernel(vtok=False):
    """Compile for sm_90 (Triton's NVIDIA backend targets sm_90a for capability 90): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(QF8="*fp8e4nv", KW="*i32", VW="*i32", SC="*fp16", BT="*i32", O="*fp32", L="*fp32", lo="i32", hi="i32",
               kt0="i32", kt1="i32", vt0="i32", vt1="i32", KPAGE_W="constexpr", VPAGE_W="constexpr",
               SC_PAGE="constexpr", VTOK="constexpr")
    src = GluonASTSource(e4m3_wgmma_decode_kernel, sig, dict(KPAGE_W=192, VPAGE_W=256, SC_PAGE=32, VTOK=vtok), {})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--token-interleaved-v", action="store_true",
                    help="values in token-interleaved pages (one byte per token and channel pair: store-friendly)")
    ap.add_argument("--dump", type=Path, help="write the SASS listing here")
    args = ap.parse_args(argv)
    import triton
    from sass_loop_mix import loop_mix

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    k = compile_kernel(args.token_interleaved_v)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                         check=True).stdout
    os.unlink(f.name)
    if args.dump:
        args.dump.write_text(sass)
    mix = loop_mix(sass)
    ptx_target = re.search(r"\.target\s+(\S+)", k.asm["ptx"]).group(1)
    out = dict(values="token-interleaved" if args.token_interleaved_v else "channel-major", target=ptx_target, regs=int(re.search(r"REG:(\d+)", res).group(1)),
               stack=int(re.search(r"STACK:(\d+)", res).group(1)), shared=k.metadata.shared,
               loop=mix, per_token=round(mix["instructions"] / 64, 2),
               qgmma=sum(n for op, n in mix["ops"].items() if "GMMA" in op))
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

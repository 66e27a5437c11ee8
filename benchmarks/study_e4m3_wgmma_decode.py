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

On a GPU (``--gpu``): the page encoders of both value layouts (checked here against the kernel's own decode bit
operations, in numpy) fill pages from random indices; every (row, split) output and log-sum-exp is compared with a
float64 reference that rounds P^T * v_scale * P_SCALE to e4m3 tile by tile as the kernel does; then the kernel is timed
at 8 requests x 8 KV heads x 32768 tokens (three split sizes) and 384 x 8 x 2304, as a share of the copy bandwidth.

    python benchmarks/study_e4m3_wgmma_decode.py [--token-interleaved-v] [--out mix.json]   # SASS, no GPU
    python benchmarks/study_e4m3_wgmma_decode.py --gpu --out e4m3-gpu.json                  # on a GPU
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
        reg_bases=[[8, 0, 0], [0, 1, 0], [64, 0, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
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


@gluon.jit(do_not_specialize=["stride_bt", "n_tok", "chunk", "splits"])
def e4m3_wgmma_decode_kernel(QF8, KW, VW, SC, BT, O, L, stride_bt, n_tok, chunk, splits, kt0, kt1, vt0, vt1,
                             KPAGE_W: gl.constexpr, VPAGE_W: gl.constexpr, SC_PAGE: gl.constexpr,
                             VTOK: gl.constexpr, P_SCALE: gl.constexpr):
    """One program = one (request and KV head = block-table row, split): tokens [lo, hi) = [split * chunk, ...) of the
    row's pages (16 tokens a page; chunk a multiple of 64). QF8 [rows, 8, 128] e4m3 (queries rotated, pre-scaled, log2
    domain); KW / VW int32 pages (module docstring); SC fp16 [page, 2, 16] key and value scales; kt0/kt1, vt0/vt1 the
    e4m3 codebooks (key 8 entries, value 8 magnitudes) as two registers each. O [programs, 8, 128] fp32 normalised
    within the split, L [programs, 8] its log2-sum-exp2."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    pid = gl.program_id(0)
    row = pid // splits
    lo = (pid % splits) * chunk
    hi = gl.minimum(lo + chunk, n_tok)
    QF8 += row * 1024
    BT += row * stride_bt
    O += pid * 1024
    L += pid * 8
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
        # P_SCALE (a power of two, divided out at the end) lifts p * v_scale (<= about 0.2) out of e4m3's subnormals
        pv = (p * (vsc * P_SCALE)[:, None]).to(gl.float8e4nv)
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
    o = acc / (l_safe * P_SCALE)[None, :]
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, 8, layout=col_l)
    gl.store(O + cols[None, :] * 128 + od[:, None], o)
    gl.store(L + cols, gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf")))


def compile_kernel(vtok=False):
    """Compile for sm_90 (Triton's NVIDIA backend targets sm_90a for capability 90): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(QF8="*fp8e4nv", KW="*i32", VW="*i32", SC="*fp16", BT="*i32", O="*fp32", L="*fp32", stride_bt="i32",
               n_tok="i32", chunk="i32", splits="i32", kt0="i32", kt1="i32", vt0="i32", vt1="i32", KPAGE_W="constexpr",
               VPAGE_W="constexpr", SC_PAGE="constexpr", VTOK="constexpr", P_SCALE="constexpr")
    src = GluonASTSource(e4m3_wgmma_decode_kernel, sig,
                         dict(KPAGE_W=192, VPAGE_W=256, SC_PAGE=32, VTOK=vtok, P_SCALE=P_SCALE), {})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


# ----------------------------------------------------------------------------------------------------------------------
# The page formats in plain numpy / torch (encoder, decoder, attention over the decoded values), and the GPU run.

KPAGE_W, VPAGE_W, SC_PAGE, PAGE = 192, 256, 32, 16
P_SCALE = 256.0  # p * v_scale * P_SCALE stays below e4m3's 448 and mostly above its subnormals (2^-6)


def e4m3_codebooks():
    """(key 8 values, value 8 magnitudes) as float32 tensors exactly representable in e4m3: the 3- and 4-bit Lloyd-Max
    codebooks of d = 128 (unit-variance coordinates; the norm over sqrt(d) is the token's scale), rounded."""
    import torch

    from turboquant_core.codebooks import lloyd_max_codebook

    k = torch.tensor(lloyd_max_codebook(3, 128).centroids)
    v = torch.tensor(lloyd_max_codebook(4, 128).centroids[8:])
    return (k.to(torch.float8_e4m3fn).float(), v.to(torch.float8_e4m3fn).float())


def table_words(values):
    """8 e4m3 values -> the two int32 registers a prmt selects from (entries 0-3, 4-7, little-endian bytes)."""
    import numpy as np
    import torch

    b = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
    return [int(np.int32(np.uint32(b[4 * r] | b[4 * r + 1] << 8 | b[4 * r + 2] << 16 | b[4 * r + 3] << 24)))
            for r in range(2)]


def encode_key_page(kidx):
    """[16 tokens, 128] 3-bit indices -> one key page [192] int32 (module docstring): per token 12 words
    [W0 x 4 | W1 x 4 | W2 x 4] over tid; for thread tid, field sw of nibble n (= h * 4 + j) is dim
    sw * 32 + h * 16 + tid * 4 + j."""
    import numpy as np

    out = np.zeros((PAGE, 3, 4), np.uint32)
    for tid in range(4):
        f = np.stack([kidx[:, [sw * 32 + h * 16 + tid * 4 + j for h in range(2) for j in range(4)]]
                      for sw in range(4)], 1).astype(np.uint32)  # [16, sw, nibble]
        shift = 4 * np.arange(8, dtype=np.uint32)
        w0 = ((f[:, 0] | ((f[:, 2] >> 2) << 3)) << shift).sum(1)
        w1 = ((f[:, 1] | ((f[:, 3] >> 2) << 3)) << shift).sum(1)
        w2 = (((f[:, 2] & 3) | ((f[:, 3] & 3) << 2)) << shift).sum(1)
        out[:, 0, tid], out[:, 1, tid], out[:, 2, tid] = w0, w1, w2
    return out.reshape(-1).view(np.int32)


def decode_key_page(words):
    """The kernel's key decode (selector words and nibbles) in numpy: [192] int32 -> [16, 128] indices."""
    import numpy as np

    w = words.view(np.uint32).reshape(PAGE, 3, 4)
    out = np.zeros((PAGE, 128), np.int64)
    for tid in range(4):
        w0, w1, w2 = w[:, 0, tid], w[:, 1, tid], w[:, 2, tid]
        sel = [w0 & 0x77777777, w1 & 0x77777777, (w2 & 0x33333333) | ((w0 >> 1) & 0x44444444),
               ((w2 >> 2) & 0x33333333) | ((w1 >> 1) & 0x44444444)]
        for sw in range(4):
            for h in range(2):
                for j in range(4):
                    out[:, sw * 32 + h * 16 + tid * 4 + j] = (sel[sw] >> (4 * (h * 4 + j))) & 7
    return out


def encode_value_page(vidx):
    """[16 tokens, 128] sign-magnitude 4-bit indices (bit 3 sign, bits 0-2 magnitude) -> one channel-major value page
    [256] int32: per channel 2 words (kb) of 8 tokens kb * 8 + h * 4 + j, magnitude in nibble h * 4 + j's bits 0-2,
    sign of (h = 0, j) in bit 3 of nibble 2j + 1, of (h = 1, j) in bit 3 of nibble 2j."""
    import numpy as np

    out = np.zeros((128, 2), np.uint32)
    for kb in range(2):
        for h in range(2):
            for j in range(4):
                t = kb * 8 + h * 4 + j
                mag = vidx[t].astype(np.uint32) & 7
                sign = (vidx[t].astype(np.uint32) >> 3) & 1
                out[:, kb] |= mag << (4 * (h * 4 + j))
                out[:, kb] |= sign << (4 * (2 * j + (1 if h == 0 else 0)) + 3)
    return out.reshape(-1).view(np.int32)


def decode_value_page(words):
    """The kernel's value decode in numpy: [256] int32 -> [16, 128] sign-magnitude indices."""
    import numpy as np

    w = words.view(np.uint32).reshape(128, 2)
    out = np.zeros((PAGE, 128), np.int64)
    for kb in range(2):
        m = w[:, kb] & 0x77777777
        sg = [w[:, kb] & 0x80808080, (w[:, kb] << 4) & 0x80808080]
        for h in range(2):
            for j in range(4):
                mag = (m >> (4 * (h * 4 + j))) & 7
                sign = (sg[h] >> (8 * j + 7)) & 1
                out[kb * 8 + h * 4 + j] = mag | (sign << 3)
    return out


def encode_value_page_tok(vidx):
    """[16 tokens, 128] sign-magnitude indices -> one token-interleaved value page [256] int32
    (``--token-interleaved-v``, writable a token at a time with byte stores): word (kb * 2 + h) * 64 + p holds
    tokens kb * 8 + h * 4 + j in its bytes j, channel a = (p // 8) * 16 + p % 8 in a byte's low nibble and a + 8 in
    its high nibble."""
    import numpy as np

    out = np.zeros((4, 64), np.uint32)
    a = np.array([(p // 8) * 16 + p % 8 for p in range(64)])
    for kb in range(2):
        for h in range(2):
            for j in range(4):
                t = kb * 8 + h * 4 + j
                byte = vidx[t, a].astype(np.uint32) | (vidx[t, a + 8].astype(np.uint32) << 4)
                out[kb * 2 + h] |= byte << (8 * j)
    return out.reshape(-1).view(np.int32)


def decode_value_page_tok(words):
    """The kernel's token-interleaved value decode in numpy (magnitudes compacted by prmt 0x0020, signs from bit 3 of
    each nibble): [256] int32 -> [16, 128] sign-magnitude indices."""
    import numpy as np

    w = words.view(np.uint32).reshape(4, 64)
    out = np.zeros((PAGE, 128), np.int64)
    for kb in range(2):
        for h in range(2):
            vw = w[kb * 2 + h]
            xa = (vw & 0x07070707) | ((vw >> 4) & 0x70707070)
            xb = ((vw >> 4) & 0x07070707) | ((vw >> 8) & 0x70707070)
            sa, sb = (vw << 4) & 0x80808080, vw & 0x80808080
            for p in range(64):
                a = (p // 8) * 16 + p % 8
                for ch, x, sg in ((a, xa[p], sa[p]), (a + 8, xb[p], sb[p])):
                    sel = (x & 0xFF) | (((x >> 16) & 0xFF) << 8)  # prmt 0x0020: bytes 0 and 2
                    for j in range(4):
                        out[kb * 8 + h * 4 + j, ch] = ((sel >> (4 * j)) & 7) | (((sg >> (8 * j + 7)) & 1) << 3)
    return out


def reference(qf, kf, vf, ksc, vsc, n_tok, chunk, p_scale=P_SCALE):
    """What one program computes, in float64 with the kernel's rounding of P^T * v_scale to e4m3 tile by tile:
    qf [8, 128], kf / vf [n, 128] decoded values, ksc / vsc [n] -> per split (O [8, 128], L [8])."""
    import torch

    outs = []
    for lo in range(0, n_tok, chunk):
        m = torch.full((8,), float("-inf"), dtype=torch.float64)
        l_sum = torch.zeros(8, dtype=torch.float64)
        acc = torch.zeros(8, 128, dtype=torch.float64)
        for start in range(lo, min(lo + chunk, n_tok), 64):
            t = slice(start, min(start + 64, lo + chunk, n_tok))
            s = (kf[t].double() @ qf.double().T) * ksc[t, None].double()  # [tok, 8]
            m_new = torch.maximum(m, torch.ceil(s.max(0).values))
            alpha = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new)
            pv = (p.float() * (vsc[t, None].float() * p_scale)).to(torch.float8_e4m3fn).double() / p_scale
            acc = acc * alpha[:, None] + pv.T @ vf[t].double()
            l_sum = l_sum * alpha + p.sum(0)
            m = m_new
        outs.append(((acc / l_sum[:, None]).float(), (m + torch.log2(l_sum)).float()))
    return outs


def make_case(rows, n_tok, seed=0, token_interleaved_v=False):
    """Random indices, scales and queries for ``rows`` (request, KV head) block-table rows of ``n_tok`` tokens, their
    pages (shuffled page ids), and the decoded float values the reference attends to."""
    import numpy as np
    import torch

    g = np.random.default_rng(seed)
    kcb, vmag = e4m3_codebooks()
    pages_per_row = -(-n_tok // 64) * 4  # whole tiles: a tile's value loads touch its 4 pages
    n_pages = rows * pages_per_row
    perm = g.permutation(n_pages).astype(np.int32)
    bt = perm.reshape(rows, pages_per_row)
    kidx = g.integers(0, 8, (n_pages, PAGE, 128))
    vidx = g.integers(0, 16, (n_pages, PAGE, 128))
    kw = np.stack([encode_key_page(kidx[p]) for p in range(n_pages)])
    encode_v = encode_value_page_tok if token_interleaved_v else encode_value_page
    vw = np.stack([encode_v(vidx[p]) for p in range(n_pages)])
    sc = (g.uniform(0.5, 1.5, (n_pages, 2, PAGE)) / 128 ** 0.5).astype(np.float16)
    q = torch.from_numpy(g.standard_normal((rows, 8, 128)).astype(np.float32)).to(torch.float8_e4m3fn)
    kf = kcb[torch.from_numpy(kidx)]
    vf = vmag[torch.from_numpy(vidx & 7)] * torch.where(torch.from_numpy(vidx >= 8), -1.0, 1.0)
    return dict(bt=bt, kw=kw, vw=vw, sc=sc, q=q, kf=kf, vf=vf, kidx=kidx, vidx=vidx,
                tables=table_words(kcb) + table_words(vmag))


def row_values(case, r, n_tok):
    """(kf, vf, ksc, vsc) of row r's first n_tok tokens in order."""
    import torch

    pages = torch.as_tensor(case["bt"][r]).long()
    sc = torch.from_numpy(case["sc"].astype("float32"))
    kf = case["kf"][pages].reshape(-1, 128)[:n_tok]
    vf = case["vf"][pages].reshape(-1, 128)[:n_tok]
    return kf, vf, sc[pages, 0].reshape(-1)[:n_tok], sc[pages, 1].reshape(-1)[:n_tok]


def device_case(case):
    """A case's kernel inputs as CUDA tensors."""
    import torch

    return dict(q=case["q"].to("cuda"), kw=torch.from_numpy(case["kw"]).to("cuda"),
                vw=torch.from_numpy(case["vw"]).to("cuda"), sc=torch.from_numpy(case["sc"]).to("cuda"),
                bt=torch.from_numpy(case["bt"]).to("cuda"), tables=case["tables"])


def timing_case(rows, n_tok):
    """Random page words straight on the GPU (the time does not depend on the values: every lookup yields a codebook
    byte), shuffled page ids, and the real codebook tables."""
    import torch

    pages_per_row = -(-n_tok // 64) * 4
    n_pages = rows * pages_per_row
    kcb, vmag = e4m3_codebooks()
    return dict(q=torch.randn(rows, 8, 128, device="cuda").to(torch.float8_e4m3fn),
                kw=torch.randint(-2 ** 31, 2 ** 31 - 1, (n_pages, KPAGE_W), dtype=torch.int32, device="cuda"),
                vw=torch.randint(-2 ** 31, 2 ** 31 - 1, (n_pages, VPAGE_W), dtype=torch.int32, device="cuda"),
                sc=(torch.rand(n_pages, 2, PAGE, device="cuda") / 8 + 0.05).half(),
                bt=torch.randperm(n_pages, device="cuda").to(torch.int32).reshape(rows, pages_per_row),
                tables=table_words(kcb) + table_words(vmag))


def run_gpu(dcase, n_tok, chunk, reps=0, token_interleaved_v=False):
    """Launch the kernel over every (row, split): (O, L) on the CPU, and the mean time in us over ``reps`` launches
    when asked."""
    import torch

    rows = dcase["bt"].shape[0]
    splits = -(-n_tok // chunk)
    o = torch.empty(rows * splits, 8, 128, device="cuda")
    lse = torch.empty(rows * splits, 8, device="cuda")
    args = (dcase["q"], dcase["kw"], dcase["vw"], dcase["sc"], dcase["bt"], o, lse, dcase["bt"].stride(0), n_tok,
            chunk, splits, *dcase["tables"])
    kw_args = dict(KPAGE_W=KPAGE_W, VPAGE_W=VPAGE_W, SC_PAGE=SC_PAGE, VTOK=token_interleaved_v, P_SCALE=P_SCALE,
                   num_warps=4)
    e4m3_wgmma_decode_kernel[(rows * splits,)](*args, **kw_args)
    torch.cuda.synchronize()
    us = None
    if reps:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            e4m3_wgmma_decode_kernel[(rows * splits,)](*args, **kw_args)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / reps
    return o.cpu(), lse.cpu(), us


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def gpu_study(out: Path | None) -> dict:
    """Correctness on small cases (every split against the reference), then the time at 8 requests x 8 KV heads x
    32768 tokens (Llama-3.1-8B / Qwen3-8B KV heads) as a share of the copy bandwidth."""
    import torch

    res = dict(device=torch.cuda.get_device_name(0), checks=[], timings=[])
    for vtok in (False, True):
        for rows, n_tok, chunk in ((2, 64, 64), (3, 200, 64), (2, 1000, 256), (1, 4096, 1024)):
            case = make_case(rows, n_tok, seed=rows * 7919 + n_tok, token_interleaved_v=vtok)
            try:
                o, lse, _ = run_gpu(device_case(case), n_tok, chunk, token_interleaved_v=vtok)
            except Exception as e:  # recorded, the run goes on
                res["checks"].append(dict(token_interleaved_v=vtok, rows=rows, tokens=n_tok, error=repr(e)[:500]))
                print(res["checks"][-1], flush=True)
                continue
            splits = -(-n_tok // chunk)
            worst_o = worst_l = 0.0
            for r in range(rows):
                kf, vf, ksc, vsc = row_values(case, r, n_tok)
                for sp, (ro, rl) in enumerate(reference(case["q"][r].float(), kf, vf, ksc, vsc, n_tok, chunk)):
                    got = o[r * splits + sp]
                    worst_o = max(worst_o, ((got - ro).abs().max() / ro.abs().max().clamp_min(1e-30)).item())
                    worst_l = max(worst_l, (lse[r * splits + sp] - rl).abs().max().item())
            res["checks"].append(dict(token_interleaved_v=vtok, rows=rows, tokens=n_tok, chunk=chunk,
                                      max_rel_err_o=worst_o, max_abs_err_lse=worst_l,
                                      ok=bool(worst_o < 2e-2 and worst_l < 1e-2)))
            print(res["checks"][-1], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth_gbs"] = bw / 1e9
    for vtok in (False, True):
        for rows, n_tok, chunk in ((64, 32768, 2048), (64, 32768, 4096), (64, 32768, 1024), (384 * 8, 2304, 2304)):
            try:
                _, _, us = run_gpu(timing_case(rows, n_tok), n_tok, chunk, reps=20, token_interleaved_v=vtok)
            except Exception as e:
                res["timings"].append(dict(token_interleaved_v=vtok, rows=rows, tokens=n_tok, error=repr(e)[:500]))
                continue
            finally:
                torch.cuda.empty_cache()
            nbytes = rows * n_tok * (48 + 64 + 4)  # key words + value words + two fp16 scales per token and head
            res["timings"].append(dict(token_interleaved_v=vtok, rows=rows, tokens=n_tok, chunk=chunk,
                                       programs=rows * -(-n_tok // chunk), us=us, gbs=nbytes / (us * 1e-6) / 1e9,
                                       of_copy=nbytes / (us * 1e-6) / bw))
            print(res["timings"][-1], flush=True)
    if out:
        out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--token-interleaved-v", action="store_true",
                    help="values in token-interleaved pages (one byte per token and channel pair: store-friendly)")
    ap.add_argument("--dump", type=Path, help="write the SASS listing here")
    ap.add_argument("--gpu", action="store_true", help="on a GPU: check against the reference, then time it")
    args = ap.parse_args(argv)
    if args.gpu:
        gpu_study(args.out)
        return 0
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
    out = dict(values="token-interleaved" if args.token_interleaved_v else "channel-major", target=ptx_target,
               regs=int(re.search(r"REG:(\d+)", res).group(1)),
               stack=int(re.search(r"STACK:(\d+)", res).group(1)), shared=k.metadata.shared,
               loop=mix, per_token=round(mix["instructions"] / 64, 2),
               qgmma=sum(n for op, n in mix["ops"].items() if "GMMA" in op))
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

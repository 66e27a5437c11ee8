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

    python benchmarks/study_e4m3_wgmma_decode.py [--token-interleaved-v | --today-layout] [--out mix.json]  # SASS
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
PRMT_6420 = gl.constexpr("prmt.b32 $0, $1, $2, 0x6420;")  # even bytes of (a, b)
PRMT_7531 = gl.constexpr("prmt.b32 $0, $1, $2, 0x7531;")  # odd bytes of (a, b)


@gluon.constexpr_function
def valhalf_layout():
    """[32 halfwords G = w * 8 + q, 2 kb, 2 h, 4 tid] (today's planar8 value rows): lane q, warp w, thread tid, so that
    the halfword's 4 channels are the A operand's rows q + 8e + 16w + 64s of the thread."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 1, 0, 0]],
        lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, 2, 2, 4])


@gluon.jit
def _today_v(x):
    """x: byte j = token j's byte of one channel pair (natural 4-bit indices, low nibble e = 0) -> (selector word:
    low / high 16 bits = the 4 tokens' magnitudes of e = 0 / e = 1, sign words of e = 0 and e = 1: bit 7 of byte j)."""
    x4 = x >> 4
    xa = (x & 0x0F0F0F0F) | (x4 & 0xF0F0F0F0)
    xb = (x4 & 0x0F0F0F0F) | ((x >> 8) & 0xF0F0F0F0)
    y = gl.inline_asm_elementwise(PRMT_6420, "=r,r,r", [xa, xb], dtype=gl.uint32, is_pure=True, pack=1)
    nb = ~y & 0x88888888  # negative where bit 3 is clear (natural index < 8): magnitude rank 7 - i there
    return (y ^ (nb - (nb >> 3))) & 0x77777777, (~x << 4) & 0x80808080, ~x & 0x80808080


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
                             VTOK: gl.constexpr, P_SCALE: gl.constexpr, TODAY: gl.constexpr = False,
                             V_OFF: gl.constexpr = 0, SC_OFF: gl.constexpr = 0):
    """One program = one (request and KV head = block-table row, split): tokens [lo, hi) = [split * chunk, ...) of the
    row's pages (16 tokens a page; chunk a multiple of 64). QF8 [rows, 8, 128] e4m3 (queries rotated, pre-scaled, log2
    domain); KW / VW int32 pages (module docstring); SC fp16 [page, 2, 16] key and value scales; kt0/kt1, vt0/vt1 the
    e4m3 codebooks (key 8 entries, value 8 magnitudes) as two registers each. O [programs, 8, 128] fp32 normalised
    within the split, L [programs, 8] its log2-sum-exp2.
    TODAY: today's planar8 pages (``--today-layout``): KW int32, VW int16 and SC fp16 views of one page tensor (page
    strides KPAGE_W / VPAGE_W / SC_PAGE in their units), values at V_OFF halfwords, scales at SC_OFF halves."""
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
    if TODAY:
        vh_l: gl.constexpr = valhalf_layout()
        hg = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, vh_l))))
        hkb = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, vh_l))))
        hh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, vh_l))))
        htid = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, vh_l))))
        # halfword G of token row kb * 8 + h * 4 (+ j) of the thread's page (32 halfwords per token)
        hoff = V_OFF + (hkb[None, :, None] * 8 + hh[None, None, :] * 4) * 32 + hg[:, None, None]
        hoff = gl.expand_dims(hoff, 3)
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
        if TODAY:
            # planar8 planes P0, P1, P2 (bytes = groups 4 tid .. 4 tid + 3): field f of a group at bits 3f .. 3f + 2
            # of P0 | P1 << 8 | P2 << 16; selector words pair fields (0, 4), (1, 7), (3, 6), (2, 5) per byte lane
            w0 = w0.to(gl.uint32, bitcast=True)
            w1 = w1.to(gl.uint32, bitcast=True)
            w2 = w2.to(gl.uint32, bitcast=True)
            s0 = (w0 & 0x07070707) | (w1 & 0x70707070)
            s1 = ((w0 >> 3) & 0x07070707) | ((w2 >> 1) & 0x70707070)
            s2 = ((w1 >> 1) & 0x07070707) | ((w2 << 2) & 0x70707070)
            s3 = (((w0 >> 6) & 0x03030303) | ((w1 << 2) & 0x04040404) | ((w1 >> 3) & 0x10101010)
                  | ((w2 << 5) & 0x60606060))
        else:
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
        ksc = gl.load(SC + tpage * SC_PAGE + SC_OFF + ts % 16).to(gl.float32)
        vsc = gl.load(SC + tpage * SC_PAGE + SC_OFF + 16 + ts % 16).to(gl.float32)
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
        if TODAY:
            # planar8 values: halfword G = w * 8 + q of a token = channel pairs (2q + 32w, + 16), (2q + 1 + 32w, + 16),
            # natural indices; A row q + 8e + 16w + 64s = channel 2q + s + 32w + 16e (byte s, nibble e)
            hpage = gl.load(BT + pg0 + htid)
            hb = VW + (hpage * VPAGE_W)[None, None, None, :] + hoff
            u0 = gl.load(hb).to(gl.uint16, bitcast=True).to(gl.uint32)
            u1 = gl.load(hb + 32).to(gl.uint16, bitcast=True).to(gl.uint32)
            u2 = gl.load(hb + 64).to(gl.uint16, bitcast=True).to(gl.uint32)
            u3 = gl.load(hb + 96).to(gl.uint16, bitcast=True).to(gl.uint32)
            ua = u0 | (u1 << 16)
            ub = u2 | (u3 << 16)
            y0, sa0, sb0 = _today_v(gl.inline_asm_elementwise(PRMT_6420, "=r,r,r", [ua, ub], dtype=gl.uint32,
                                                              is_pure=True, pack=1))
            y1, sa1, sb1 = _today_v(gl.inline_asm_elementwise(PRMT_7531, "=r,r,r", [ua, ub], dtype=gl.uint32,
                                                              is_pure=True, pack=1))
            ysel = gl.join(y0, y1)  # [32 G, 2 kb, 2 h, 4 tid, 2 s]
            ysel = gl.join(ysel, ysel >> 16)  # [.., 2 s, 2 e]
            vsel = gl.reshape(gl.permute(gl.reshape(ysel, [4, 8, 2, 2, 4, 2, 2]), [5, 0, 6, 1, 2, 3, 4]),
                              [128, 2, 2, 4])
            vsgn = gl.join(gl.join(sa0, sa1), gl.join(sb0, sb1))  # [.., 2 s, 2 e]
            vsgn = gl.reshape(gl.permute(gl.reshape(vsgn, [4, 8, 2, 2, 4, 2, 2]), [5, 0, 6, 1, 2, 3, 4]),
                              [128, 2, 2, 4])
        elif VTOK:
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


def compile_kernel(vtok=False, today=False):
    """Compile for sm_90 (Triton's NVIDIA backend targets sm_90a for capability 90): the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(QF8="*fp8e4nv", KW="*i32", VW="*i16" if today else "*i32",
               SC="*fp16", BT="*i32", O="*fp32", L="*fp32", stride_bt="i32",
               n_tok="i32", chunk="i32", splits="i32", kt0="i32", kt1="i32", vt0="i32", vt1="i32", KPAGE_W="constexpr",
               VPAGE_W="constexpr", SC_PAGE="constexpr", VTOK="constexpr", P_SCALE="constexpr", TODAY="constexpr",
               V_OFF="constexpr", SC_OFF="constexpr")
    src = GluonASTSource(e4m3_wgmma_decode_kernel, sig, kernel_constexprs(vtok, today), {})
    return tcompile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


# ----------------------------------------------------------------------------------------------------------------------
# The page formats in plain numpy / torch (encoder, decoder, attention over the decoded values), and the GPU run.

KPAGE_W, VPAGE_W, SC_PAGE, PAGE = 192, 256, 32, 16
P_SCALE = 256.0  # p * v_scale * P_SCALE stays below e4m3's 448 and mostly above its subnormals (2^-6)
TODAY_PRESET = "turboquant_k3v4_nc"  # 3-bit keys, 4-bit values, planar8, one fp16 scale each


def today_layout():
    """Today's page layout of k3v4 at head_dim 128, block 16 (``ops.page_layout.paged_layout``)."""
    from turboquant_core.ops.page_layout import paged_layout

    lay = paged_layout(TODAY_PRESET, head_dim=128, block_size=PAGE)
    assert (lay.k_index_bytes, lay.v_index_bytes, lay.k_index_offset) == (48, 64, 0), lay
    assert lay.v_scale_offset == lay.k_scale_offset + 2 * PAGE and lay.head_page_bytes % 4 == 0, lay
    return lay


def kernel_constexprs(vtok=False, today=False):
    """The kernel's constexpr arguments of one page format."""
    if not today:
        return dict(KPAGE_W=KPAGE_W, VPAGE_W=VPAGE_W, SC_PAGE=SC_PAGE, VTOK=vtok, P_SCALE=P_SCALE, TODAY=False,
                    V_OFF=0, SC_OFF=0)
    lay = today_layout()
    return dict(KPAGE_W=lay.head_page_bytes // 4, VPAGE_W=lay.head_page_bytes // 2, SC_PAGE=lay.head_page_bytes // 2,
                VTOK=False, P_SCALE=P_SCALE, TODAY=True, V_OFF=lay.v_index_offset // 2, SC_OFF=lay.k_scale_offset // 2)


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


# Today's pages (``--today-layout``): the store kernel's planar8 bytes, read in place. A-operand orders: key column
# k = sw * 32 + h * 16 + tid * 4 + j <- dim TODAY_KEY_DIM[k]; V^T row R = q + 8e + 16w + 64s <- channel TODAY_V_CH[R].
TODAY_KEY_FIELDS = ((0, 4), (1, 7), (3, 6), (2, 5))  # the fields (low, high nibble) of selector word sw
TODAY_KEY_DIM = [4 * tid + 2 * h + (j >> 1) + 16 * TODAY_KEY_FIELDS[sw][j & 1]
                 for sw in range(4) for h in range(2) for tid in range(4) for j in range(4)]
TODAY_V_CH = [2 * (r & 7) + (r >> 6) + 32 * ((r >> 4) & 3) + 16 * ((r >> 3) & 1) for r in range(128)]


def encode_today_page(kidx, vidx, ksc, vsc):
    """[16, 128] key indices (3 bits), [16, 128] natural value indices (4 bits), [16] key / value scales -> one
    (block, KV head) page of today's cache, uint8 [head_page_bytes], with the product's own packing
    (``turboquant_core.packing.pack_indices``, planar8) at ``paged_layout``'s offsets."""
    import numpy as np
    import torch

    from turboquant_core.packing import pack_indices

    lay = today_layout()
    page = np.zeros(lay.head_page_bytes, np.uint8)
    page[lay.k_index_offset:lay.k_index_offset + PAGE * 48] = pack_indices(torch.as_tensor(kidx), 3).numpy().ravel()
    page[lay.v_index_offset:lay.v_index_offset + PAGE * 64] = pack_indices(torch.as_tensor(vidx), 4).numpy().ravel()
    page[lay.k_scale_offset:lay.k_scale_offset + 2 * PAGE] = np.asarray(ksc, np.float16).view(np.uint8)
    page[lay.v_scale_offset:lay.v_scale_offset + 2 * PAGE] = np.asarray(vsc, np.float16).view(np.uint8)
    return page


def _prmt(a, b, sel):
    """prmt.b32 (default mode) in numpy: byte i of the result = byte (sel >> 4i) & 7 of b:a."""
    import numpy as np

    ab = (a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32)))
    out = np.zeros_like(a, dtype=np.uint32)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        assert n < 8
        out |= (((ab >> np.uint64(8 * n)) & np.uint64(0xFF)).astype(np.uint32)) << np.uint32(8 * i)
    return out


def decode_today_keys(page):
    """The kernel's key decode of today's page in numpy: uint8 [head_page_bytes] -> [16, 128] indices in dim order
    (a selector nibble with bit 3 set, which prmt would read as a sign-replicate, comes out as 8 or more)."""
    import numpy as np

    w = page[:PAGE * 48].view(np.uint32).reshape(PAGE, 12)
    out = np.full((PAGE, 128), -1, np.int64)
    for tid in range(4):
        w0, w1, w2 = w[:, tid], w[:, 4 + tid], w[:, 8 + tid]
        s = [(w0 & 0x07070707) | (w1 & 0x70707070),
             ((w0 >> 3) & 0x07070707) | ((w2 >> 1) & 0x70707070),
             ((w1 >> 1) & 0x07070707) | ((w2 << 2) & 0x70707070),
             ((w0 >> 6) & 0x03030303) | ((w1 << 2) & 0x04040404) | ((w1 >> 3) & 0x10101010) | ((w2 << 5) & 0x60606060)]
        for sw in range(4):
            for h in range(2):
                for j in range(4):
                    k = sw * 32 + h * 16 + tid * 4 + j
                    out[:, TODAY_KEY_DIM[k]] = (s[sw].astype(np.uint32) >> np.uint32(16 * h + 4 * j)) & 0xF
    return out


def today_v_bits(x):
    """``_today_v`` in numpy (uint32 arrays): (selector word, sign word of e = 0, of e = 1)."""
    import numpy as np

    x = x.astype(np.uint32)
    x4 = x >> np.uint32(4)
    xa = (x & np.uint32(0x0F0F0F0F)) | (x4 & np.uint32(0xF0F0F0F0))
    xb = (x4 & np.uint32(0x0F0F0F0F)) | ((x >> np.uint32(8)) & np.uint32(0xF0F0F0F0))
    y = _prmt(xa, xb, 0x6420)
    nb = ~y & np.uint32(0x88888888)
    return ((y ^ (nb - (nb >> np.uint32(3)))) & np.uint32(0x77777777), (~x << np.uint32(4)) & np.uint32(0x80808080),
            ~x & np.uint32(0x80808080))


def decode_today_values(page):
    """The kernel's value decode of today's page in numpy: uint8 [head_page_bytes] -> [16, 128] sign-magnitude
    indices in channel order (bit 3 = negative, bits 0-2 = magnitude rank; a selector nibble with bit 3 set would
    come out as 16 or more)."""
    import numpy as np

    lay = today_layout()
    hw = page[lay.v_index_offset:lay.v_index_offset + PAGE * 64].view(np.uint16).reshape(PAGE, 32).astype(np.uint32)
    out = np.full((PAGE, 128), -1, np.int64)
    g = np.arange(32)
    q, w = g % 8, g // 8
    for kb in range(2):
        for h in range(2):
            u = [hw[kb * 8 + h * 4 + j] for j in range(4)]  # [32 G] each
            ua, ub = u[0] | (u[1] << np.uint32(16)), u[2] | (u[3] << np.uint32(16))
            for sb, sel in ((0, 0x6420), (1, 0x7531)):
                y, sa, sgb = today_v_bits(_prmt(ua, ub, sel))
                for e, sg in ((0, sa), (1, sgb)):
                    ch = np.array(TODAY_V_CH)[q + 8 * e + 16 * w + 64 * sb]
                    for j in range(4):
                        nib = (y >> np.uint32(16 * e + 4 * j)) & np.uint32(0xF)
                        neg = (sg >> np.uint32(8 * j + 7)) & np.uint32(1)
                        out[kb * 8 + h * 4 + j, ch] = np.where(nib > 7, 16 + nib, nib | (neg << np.uint32(3)))
    return out


def natural_to_sign_magnitude(vidx):
    """Natural 4-bit indices (symmetric codebook, c_i = -c_{15-i}) -> bit 3 = negative, bits 0-2 = magnitude rank."""
    import numpy as np

    vidx = np.asarray(vidx)
    return np.where(vidx >= 8, vidx - 8, (7 - vidx) | 8)


def check_page_codecs(n_pages=64, seed=1):
    """Every page format's encoder against the kernel's decode bit operations in numpy, for random indices: a dict of
    per-format booleans, plus whether one flipped bit of a today page is seen (the check can fail)."""
    import numpy as np

    g = np.random.default_rng(seed)
    res = dict(study_keys=True, study_values_channel_major=True, study_values_token_interleaved=True,
               today_keys=True, today_values=True)
    for _ in range(n_pages):
        kidx = g.integers(0, 8, (PAGE, 128))
        vnat = g.integers(0, 16, (PAGE, 128))
        vsm = natural_to_sign_magnitude(vnat)
        res["study_keys"] &= bool((decode_key_page(encode_key_page(kidx)) == kidx).all())
        res["study_values_channel_major"] &= bool((decode_value_page(encode_value_page(vsm)) == vsm).all())
        res["study_values_token_interleaved"] &= bool((decode_value_page_tok(encode_value_page_tok(vsm)) == vsm).all())
        page = encode_today_page(kidx, vnat, g.uniform(0.5, 1.5, PAGE), g.uniform(0.5, 1.5, PAGE))
        res["today_keys"] &= bool((decode_today_keys(page) == kidx).all())
        res["today_values"] &= bool((decode_today_values(page) == vsm).all())
    lay = today_layout()
    bad = page.copy()
    bad[g.integers(0, PAGE * 48)] ^= np.uint8(1 << int(g.integers(0, 8)))
    bad[lay.v_index_offset + g.integers(0, PAGE * 64)] ^= np.uint8(1 << int(g.integers(0, 8)))
    res["flipped_bits_detected"] = bool((decode_today_keys(bad) != kidx).any()
                                        and (decode_today_values(bad) != vsm).any())
    res["pages"] = n_pages
    return res


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


def make_case(rows, n_tok, seed=0, token_interleaved_v=False, today=False):
    """Random indices, scales and queries for ``rows`` (request, KV head) block-table rows of ``n_tok`` tokens, their
    pages (shuffled page ids), and the decoded float values the reference attends to. ``today``: today's pages
    (``encode_today_page``, natural value indices), the kernel's query in its key order ``TODAY_KEY_DIM``."""
    import numpy as np
    import torch

    g = np.random.default_rng(seed)
    kcb, vmag = e4m3_codebooks()
    pages_per_row = -(-n_tok // 64) * 4  # whole tiles: a tile's value loads touch its 4 pages
    n_pages = rows * pages_per_row
    perm = g.permutation(n_pages).astype(np.int32)
    bt = perm.reshape(rows, pages_per_row)
    kidx = g.integers(0, 8, (n_pages, PAGE, 128))
    vidx = g.integers(0, 16, (n_pages, PAGE, 128))  # sign-magnitude (study pages) or natural (today's pages)
    sc = (g.uniform(0.5, 1.5, (n_pages, 2, PAGE)) / 128 ** 0.5).astype(np.float16)
    q = torch.from_numpy(g.standard_normal((rows, 8, 128)).astype(np.float32)).to(torch.float8_e4m3fn)
    kf = kcb[torch.from_numpy(kidx)]
    if today:
        pages = np.stack([encode_today_page(kidx[p], vidx[p], sc[p, 0], sc[p, 1]) for p in range(n_pages)])
        for p in range(min(n_pages, 8)):  # the kernel's decode bit operations recover the indices
            assert (decode_today_keys(pages[p]) == kidx[p]).all() and \
                (decode_today_values(pages[p]) == natural_to_sign_magnitude(vidx[p])).all()
        vsm = natural_to_sign_magnitude(vidx)
        return dict(bt=bt, pages=pages, sc=sc, q=q, q_kernel=q[:, :, TODAY_KEY_DIM].contiguous(), kf=kf,
                    vf=vmag[torch.from_numpy(vsm & 7)] * torch.where(torch.from_numpy(vsm >= 8), -1.0, 1.0),
                    kidx=kidx, vidx=vidx, tables=table_words(kcb) + table_words(vmag))
    kw = np.stack([encode_key_page(kidx[p]) for p in range(n_pages)])
    encode_v = encode_value_page_tok if token_interleaved_v else encode_value_page
    vw = np.stack([encode_v(vidx[p]) for p in range(n_pages)])
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
    """A case's kernel inputs as CUDA tensors (today's pages: one uint8 tensor, read as int32 / int16 / fp16)."""
    import torch

    if "pages" in case:
        pages = torch.from_numpy(case["pages"]).to("cuda")
        return dict(q=case["q_kernel"].to("cuda"), kw=pages.view(torch.int32), vw=pages.view(torch.int16),
                    sc=pages.view(torch.float16), bt=torch.from_numpy(case["bt"]).to("cuda"), tables=case["tables"])

    return dict(q=case["q"].to("cuda"), kw=torch.from_numpy(case["kw"]).to("cuda"),
                vw=torch.from_numpy(case["vw"]).to("cuda"), sc=torch.from_numpy(case["sc"]).to("cuda"),
                bt=torch.from_numpy(case["bt"]).to("cuda"), tables=case["tables"])


def timing_case(rows, n_tok, today=False):
    """Random page words straight on the GPU (the time does not depend on the values: every lookup yields a codebook
    byte), shuffled page ids, and the real codebook tables."""
    import torch

    pages_per_row = -(-n_tok // 64) * 4
    n_pages = rows * pages_per_row
    kcb, vmag = e4m3_codebooks()
    if today:
        lay = today_layout()
        pages = torch.randint(-2 ** 31, 2 ** 31 - 1, (n_pages, lay.head_page_bytes // 4), dtype=torch.int32,
                              device="cuda")
        sc = pages.view(torch.float16)
        sc[:, lay.k_scale_offset // 2:lay.k_scale_offset // 2 + 4 * PAGE] = (
            torch.rand(n_pages, 4 * PAGE, device="cuda") / 8 + 0.05).half()
        return dict(q=torch.randn(rows, 8, 128, device="cuda").to(torch.float8_e4m3fn), kw=pages,
                    vw=pages.view(torch.int16), sc=sc,
                    bt=torch.randperm(n_pages, device="cuda").to(torch.int32).reshape(rows, pages_per_row),
                    tables=table_words(kcb) + table_words(vmag))
    return dict(q=torch.randn(rows, 8, 128, device="cuda").to(torch.float8_e4m3fn),
                kw=torch.randint(-2 ** 31, 2 ** 31 - 1, (n_pages, KPAGE_W), dtype=torch.int32, device="cuda"),
                vw=torch.randint(-2 ** 31, 2 ** 31 - 1, (n_pages, VPAGE_W), dtype=torch.int32, device="cuda"),
                sc=(torch.rand(n_pages, 2, PAGE, device="cuda") / 8 + 0.05).half(),
                bt=torch.randperm(n_pages, device="cuda").to(torch.int32).reshape(rows, pages_per_row),
                tables=table_words(kcb) + table_words(vmag))


def run_gpu(dcase, n_tok, chunk, reps=0, token_interleaved_v=False, today=False):
    """Launch the kernel over every (row, split): (O, L) on the CPU, and the mean time in us over ``reps`` launches
    when asked."""
    import torch

    rows = dcase["bt"].shape[0]
    splits = -(-n_tok // chunk)
    o = torch.empty(rows * splits, 8, 128, device="cuda")
    lse = torch.empty(rows * splits, 8, device="cuda")
    args = (dcase["q"], dcase["kw"], dcase["vw"], dcase["sc"], dcase["bt"], o, lse, dcase["bt"].stride(0), n_tok,
            chunk, splits, *dcase["tables"])
    kw_args = dict(kernel_constexprs(token_interleaved_v, today), num_warps=4)
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


def gpu_study(out: Path | None, variants=((False, False), (True, False), (False, True))) -> dict:
    """Correctness on small cases (every split against the reference), then the time at 8 requests x 8 KV heads x
    32768 tokens (Llama-3.1-8B / Qwen3-8B KV heads) as a share of the copy bandwidth. ``variants``: (token-interleaved
    V, today's pages) pairs, by default the study's two value layouts and today's pages."""
    import torch

    res = dict(device=torch.cuda.get_device_name(0), page_codecs=check_page_codecs(), checks=[], timings=[])
    for vtok, today in variants:
        for rows, n_tok, chunk in ((2, 64, 64), (3, 200, 64), (2, 1000, 256), (1, 4096, 1024)):
            case = make_case(rows, n_tok, seed=rows * 7919 + n_tok, token_interleaved_v=vtok, today=today)
            try:
                o, lse, _ = run_gpu(device_case(case), n_tok, chunk, token_interleaved_v=vtok, today=today)
            except Exception as e:  # recorded, the run goes on
                res["checks"].append(dict(token_interleaved_v=vtok, today_layout=today, rows=rows, tokens=n_tok,
                                          error=repr(e)[:500]))
                print(res["checks"][-1], flush=True)
                continue
            splits = -(-n_tok // chunk)
            worst_o = worst_l = 0.0
            for r in range(rows):
                kf, vf, ksc, vsc = row_values(case, r, n_tok)
                for sp, (ro, rl) in enumerate(reference(case["q"][r].float(), kf, vf, ksc, vsc, n_tok, chunk)):
                    got = o[r * splits + sp]
                    if today:  # V^T row R of the kernel is channel TODAY_V_CH[R]
                        ro = ro[:, TODAY_V_CH]
                    worst_o = max(worst_o, ((got - ro).abs().max() / ro.abs().max().clamp_min(1e-30)).item())
                    worst_l = max(worst_l, (lse[r * splits + sp] - rl).abs().max().item())
            res["checks"].append(dict(token_interleaved_v=vtok, today_layout=today, rows=rows, tokens=n_tok,
                                      chunk=chunk, max_rel_err_o=worst_o, max_abs_err_lse=worst_l,
                                      ok=bool(worst_o < 2e-2 and worst_l < 1e-2)))
            print(res["checks"][-1], flush=True)
    bw = copy_bandwidth()
    res["copy_bandwidth_gbs"] = bw / 1e9
    for vtok, today in variants:
        for rows, n_tok, chunk in ((64, 32768, 2048), (64, 32768, 4096), (64, 32768, 1024), (384 * 8, 2304, 2304)):
            try:
                _, _, us = run_gpu(timing_case(rows, n_tok, today), n_tok, chunk, reps=20, token_interleaved_v=vtok,
                                   today=today)
            except Exception as e:
                res["timings"].append(dict(token_interleaved_v=vtok, today_layout=today, rows=rows, tokens=n_tok,
                                           error=repr(e)[:500]))
                continue
            finally:
                torch.cuda.empty_cache()
            nbytes = rows * n_tok * (48 + 64 + 4)  # key words + value words + two fp16 scales per token and head
            res["timings"].append(dict(token_interleaved_v=vtok, today_layout=today, rows=rows, tokens=n_tok,
                                       chunk=chunk, programs=rows * -(-n_tok // chunk), us=us,
                                       gbs=nbytes / (us * 1e-6) / 1e9, of_copy=nbytes / (us * 1e-6) / bw))
            print(res["timings"][-1], flush=True)
    if out:
        out.write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--token-interleaved-v", action="store_true",
                    help="values in token-interleaved pages (one byte per token and channel pair: store-friendly)")
    ap.add_argument("--today-layout", action="store_true",
                    help="keys and values read from today's planar8 pages (what the store kernel writes)")
    ap.add_argument("--dump", type=Path, help="write the SASS listing here")
    ap.add_argument("--gpu", action="store_true", help="on a GPU: check against the reference, then time it")
    args = ap.parse_args(argv)
    if args.gpu:
        variants = ((False, args.today_layout),) if args.today_layout or args.token_interleaved_v else None
        if args.token_interleaved_v:
            variants = ((True, False),)
        gpu_study(args.out, *([variants] if variants else []))
        return 0
    import triton
    from sass_loop_mix import loop_mix

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    k = compile_kernel(args.token_interleaved_v, args.today_layout)
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
    pages = "today planar8" if args.today_layout else "study"
    values = "today planar8 (natural indices)" if args.today_layout else \
        "token-interleaved" if args.token_interleaved_v else "channel-major"
    out = dict(pages=pages, values=values, target=ptx_target,
               regs=int(re.search(r"REG:(\d+)", res).group(1)),
               stack=int(re.search(r"STACK:(\d+)", res).group(1)), shared=k.metadata.shared,
               loop=mix, per_token=round(mix["instructions"] / 64, 2),
               warp_instructions_per_token=round(4 * mix["instructions"] / 64, 2),
               alu_warp_instructions_per_token=round(4 * mix["pipes"].get("alu", 0) / 64, 2),
               qgmma=sum(n for op, n in mix["ops"].items() if "GMMA" in op), page_codecs=check_page_codecs())
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

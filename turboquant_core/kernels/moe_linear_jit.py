# SPDX-License-Identifier: Apache-2.0
"""Mixture-of-experts products over TurboQuant expert weights (jit only; launcher: ``ops.moe_linear.tq_moe_linear``,
plain-torch oracle: ``ops.moe_linear.moe_linear_reference``).

The experts of a layer are stacked: W uint8 [E, N, G, 16 * BITS] (each output row's groups of 128 inputs, planar8),
S fp16 [E, N, G]. Rows are routed as in vLLM's Triton ``fused_moe_kernel``: a routed row is the flat index
t * TOP_K + k of token t's k-th expert; ``moe_align_block_size`` (or ``ops.moe_linear.moe_align_block_size_torch``)
sorts them by expert into SORTED, padded per expert to a multiple of BLOCK_M with the index num_valid (= tokens x
TOP_K, never a real row), EXPERT_IDS[b] is the expert of block b of BLOCK_M rows, and NUM_POST_PAD the number of
sorted entries that blocks cover (later blocks are skipped).

y[r, n] = sqrt(2) * sum_g s[e, n, g] * < x[r // TOP_K, g] M, c[idx[e, n, g]] > (times the router weight of r with
MUL_ROUTED_WEIGHT), e the expert of r's block: the rotated-domain product of ``ops.linear`` (M the group's rotation
/ 16 in kernel order, ``ops.linear.rotation_operand``; sqrt(2) put back once at the end), with the weight rows of the
block's expert. Program (m, n) takes block m
of BLOCK_M routed rows and BLOCK_N output rows of its expert; per group it loads the block's activation rows
(masked past the input size and for padding entries), rotates them with one tensor-core product against M,
decodes the expert's [BLOCK_N, 128] weight tile in registers (``codebook_lookup_jit``), and adds the second product,
scaled per output row, to fp32 accumulators. Row r of Y receives its result (vLLM's order: Y is [tokens, TOP_K, N]
flattened), so the second product of an MoE layer (TOP_K = 1, its input the first one's rows) and the sum over the
top-k follow as in vLLM.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import INTERPRETING, _codebook_registers, _dequant_words, _load_words
from .linear_jit import _dot

GROUP = tl.constexpr(128)
SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _add_expert_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, n_mask, token_mask, d, in_features,
                      BITS: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """acc + (the block's activation rows of group gi, rotated) x (the expert's decoded weight tile of group gi)^T,
    scaled per output row, with the expert's rows (w_row) and the routed rows' activations (x_row)."""
    word = _load_words(W, (w_row + gi) * (16 * BITS), n_mask, 0, 16, 16, BITS)
    w_tile = _dequant_words(word, TABLE, cb, BLOCK_N, 16, BITS, DT)  # [BLOCK_N, 128], kernel order
    col = gi * GROUP + d
    x_tile = tl.load(X + x_row[:, None] + col[None, :], mask=token_mask[:, None] & (col < in_features)[None, :],
                     other=0.0)
    xr = _dot(x_tile, rot).to(DT)  # [BLOCK_M, 128] rotated / sqrt(2), kernel order
    part = _dot(xr, tl.trans(w_tile))  # [BLOCK_M, BLOCK_N] fp32
    s = tl.load(S + w_row + gi, mask=n_mask, other=0.0).to(tl.float32)
    return acc + part * s[None, :]


# num_valid (tokens x top-k) only masks rows: unspecialized, as linear_jit.tq_rotate_kernel's row count, so that a
# step of any token count runs the variant the engine's start-up compiled.
@triton.jit(do_not_specialize=["num_valid"])
def tq_moe_linear_kernel(X, ROT, W, S, TABLE, TOPK_W, Y, SORTED, EXPERT_IDS, NUM_POST_PAD, num_valid, in_features,
                         out_features, groups, stride_x, stride_y, TOP_K: tl.constexpr, BITS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """X [tokens, in_features] bf16 or fp16 (rows stride_x apart); ROT [128, 128] the rotation M / 16 in X's type;
    W uint8 [E, out_features, groups, 16 * BITS]; S fp16 [E, out_features, groups]; TABLE the codebook (2 ** BITS
    fp32); TOPK_W [tokens * TOP_K] fp32 router weights (read with MUL_ROUTED_WEIGHT); Y [tokens * TOP_K,
    out_features] (rows stride_y apart); SORTED, EXPERT_IDS, NUM_POST_PAD int32: the routing layout (module
    docstring). Program (m, n): block m of SORTED, outputs n * BLOCK_N onwards."""
    DT: tl.constexpr = X.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NUM_POST_PAD):
        return
    offs_token = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    token_mask = offs_token < num_valid
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < out_features
    y_ptr = Y + offs_token[:, None] * stride_y + rows[None, :]
    out_mask = token_mask[:, None] & n_mask[None, :]
    expert = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    if expert == -1:
        # A block of an expert this rank does not hold (vLLM's expert parallelism): its rows get zeros.
        tl.store(y_ptr, tl.zeros((BLOCK_M, BLOCK_N), Y.dtype.element_ty), mask=out_mask)
        return
    d = tl.arange(0, GROUP)
    rot = tl.load(ROT + d[:, None] * GROUP + d[None, :])
    cb = _codebook_registers(TABLE, BITS, DT)
    w_row = (expert * out_features + rows) * groups
    x_row = (offs_token // TOP_K) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if INTERPRETING:
        # The interpreter cannot take run-time bounds in range() (its scalars are 1-element arrays).
        gi = 0
        while gi < groups:
            acc = _add_expert_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, n_mask, token_mask, d,
                                    in_features, BITS, BLOCK_N, DT)
            gi += 1
    else:
        for gi in range(0, groups):
            acc = _add_expert_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, n_mask, token_mask, d,
                                    in_features, BITS, BLOCK_N, DT)
    acc = acc * SQRT2
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(TOPK_W + offs_token, mask=token_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=out_mask)

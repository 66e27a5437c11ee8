"""The split merge kernel of 97ff163 (one split per round trip, 32 rows per program), for ab_merge.py."""

import triton
import triton.language as tl

from turboquant_core.kernels.codec_jit import _unrotate_rows


@triton.jit(do_not_specialize=["num_splits", "num_rows", "stride_pos", "stride_pot", "stride_pls", "stride_lh"])
def tq_merge_unrotate_kernel(
    PART_O,
    stride_pos,
    stride_pot,
    stride_poh,
    PART_L,
    stride_pls,
    stride_plt,
    ROT_HI,
    ROT_LO,
    OUT,
    stride_ot,
    stride_oh,
    LSE,
    stride_lh,
    num_rows,
    num_splits,
    v_rot_scale,
    HQ: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    EXACT: tl.constexpr,
    BR: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Rows (token, head): merge the splits' partial outputs (V order) by their log2-sum-exp, then rotate
    back once: out = (y R_V) * v_rot_scale, y scaled to max |y| = 1 first so the fp16 product operands
    stay in range."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    mx = tl.full((BR,), float("-inf"), tl.float32)
    for s in range(0, num_splits):
        mx = tl.maximum(mx, tl.load(PART_L + s * stride_pls + t * stride_plt + h, mask=rmask, other=float("-inf")))
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    i = tl.arange(0, DP)
    y = tl.zeros((BR, DP), tl.float32)
    total = tl.zeros((BR,), tl.float32)
    for s in range(0, num_splits):
        ls = tl.load(PART_L + s * stride_pls + t * stride_plt + h, mask=rmask, other=float("-inf"))
        w = tl.where(ls == float("-inf"), 0.0, tl.exp2(ls - mx_safe))
        po = tl.load(
            PART_O + s * stride_pos + t[:, None] * stride_pot + h[:, None] * stride_poh + i[None, :],
            mask=(rmask & (w > 0))[:, None],
            other=0.0,
        )
        y += po * w[:, None]
        total += w
    y = y / tl.where(total > 0, total, 1.0)[:, None]
    amax = tl.max(tl.abs(y), axis=1)
    inv = tl.where(amax > 0, 1.0 / tl.maximum(amax, 1e-30), 0.0)
    o = _unrotate_rows(y * inv[:, None], ROT_HI, ROT_LO, 0, DP, DP, EXACT) * (amax * v_rot_scale)[:, None]
    tl.store(
        OUT + t[:, None] * stride_ot + h[:, None] * stride_oh + i[None, :],
        o.to(OUT.dtype.element_ty),
        mask=rmask[:, None] & (i < D)[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(
            total > 0, (mx_safe + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf")
        )
        tl.store(LSE + h * stride_lh + t, lse, mask=rmask)

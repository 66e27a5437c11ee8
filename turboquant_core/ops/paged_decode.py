# SPDX-License-Identifier: Apache-2.0
"""Decode attention with the dequantized tiles built in tensor-core registers (``kernels.paged_decode_jit``).

``TQAttentionPlan`` takes this path for decode batches it serves (``decode_path_applies``): causal queries
that are each request's last tokens, at most 16 (query token, head) pairs per KV head (one query per request,
or the few of speculative verification), no sliding window, codebook keys and values of one 2- to 4-bit
segment each, head_dim 64 or 128, a page size that is a multiple of the 16-token tile, a CUDA device (compute
capability 8.0 or newer; not the Triton interpreter). Three launches (four with key centering): the queries rotated into
the kernel's K order (``tq_rotate_queries_kernel``; and their centering operands,
``tq_center_queries_kernel``), the attention (one warp per request, KV head and split), and the split merge
with the rotation back (``tq_merge_unrotate_kernel``). Same math and reference as ``ops.paged_attention``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from .page_layout import PagedTQLayout, _ComponentTables
from .rotation_tables import codec_tables, rotation_rows_in_order

LN2 = math.log(2.0)
DECODE_HEAD_DIMS = (64, 128)  # d = 256: the accumulator and query alone fill a warp's registers
DECODE_BITS = (2, 3, 4)
DECODE_BLOCK_N = 16  # tokens per tile (benchmarks/results/2026-11-24-h100-register-tile-decode/)
DECODE_MAX_COLUMNS = 16  # (query token, head) pairs per KV head: the kernel's MMA columns
# One wave of decode programs per SM when splitting the KV range. The centred kernel's 142 registers let 14
# one-warp programs reside, but the split sweep is fastest at 12, a multiple of an SM's four schedulers (with 14,
# two schedulers hold four issue-bound warps and the wave waits for them); the plain kernel (16 resident) is within
# a few percent of its best there (benchmarks/results/2026-11-25-h100-decode-splits/).
DECODE_PROGRAMS_PER_SM = 12
# A split count whose waves are fuller by more than this is worth its extra splits; within it, fewer splits win
# (each split adds a prologue, partial outputs and merge work).
WAVE_FILL_SLACK = 0.05
# Each warp loads the next tile's keys and values before computing the current one: 2-10 % faster at every
# measured shape (loading its keys only needs more registers and is slower); the centred variant keeps two
# loop-invariant words on the stack (benchmarks/results/2026-11-25-h200-decode-prefetch/).
DECODE_PREFETCH = True
ROWS_PER_PROGRAM = 32  # rows (token, head) per program of the query rotation
# The split merge. Batches that split their KV ranges have few rows (token, head), so the merge runs on few programs
# and its time is the chain of memory round trips: 16 rows per program (the fewest its rotation product takes), 8
# warps, and 4 splits per round trip, 8 above MERGE_WIDE_FROM splits (a round trip of 8 takes about twice one of 4,
# but one or a few long requests' 64 splits would otherwise wait on two levels of four). An unsplit batch has many
# rows and nothing to merge: 32 rows per program, 4 warps (benchmarks/results/2026-11-27-h100-split-merge/ and
# 2026-11-27-h100-centre-logits-ahead/).
MERGE_ROWS_PER_PROGRAM = 16
MERGE_SPLITS_PER_LOAD = 4
MERGE_SPLITS_PER_WIDE_LOAD = 8
MERGE_WIDE_FROM = 16
MERGE_WARPS = 8
UNSPLIT_ROWS_PER_PROGRAM = 32
# More than this many loads' worth of splits are merged in two levels: groups of one load's splits side by side, then
# the groups, so that a batch of one or a few long requests (64 splits each) waits on two round trips, not eight.
MERGE_GROUPS_FROM = 2


def merge_splits_per_load(num_splits: int) -> int:
    """Splits the merge takes per round trip for a batch of ``num_splits`` splits."""
    return MERGE_SPLITS_PER_WIDE_LOAD if num_splits > MERGE_WIDE_FROM else MERGE_SPLITS_PER_LOAD


# The centering logits (``center_logits``): one per CENTER_GROUP_TOKENS tokens (the wgmma decode tile's row groups),
# whatever the page size; a program multiplies BG groups' table rows with HB heads' operands, so each row is read
# once per request for up to HB heads.
CENTER_GROUP_TOKENS = 16
CENTER_LOGITS_GROUPS = 64
CENTER_LOGITS_HEADS = 32


def decode_path_applies(layout: PagedTQLayout, group: int, device: torch.device, *, max_query_len: int,
                        causal: bool, sliding_window: int | None) -> bool:
    """Whether ``TQAttentionPlan`` runs this batch on the register-tile decode kernel (with or without key
    centering: a tile never spans a page, so the page centre is one value per tile). ``max_query_len`` > 1:
    speculative verification, each request's queries its last tokens (``causal``)."""
    fmt = layout.fmt
    one_segment = all(c.has_codebook and c.bits in DECODE_BITS for c in (fmt.key, fmt.value))
    return (one_segment and layout.head_dim in DECODE_HEAD_DIMS and max_query_len >= 1
            and group * max_query_len <= DECODE_MAX_COLUMNS and causal and sliding_window is None
            and layout.block_size % DECODE_BLOCK_N == 0 and _gluon_runs(str(device)))


@functools.lru_cache(maxsize=8)
def _gluon_runs(device: str) -> bool:
    import os

    dev = torch.device(device)
    if dev.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def decode_key_order(dim: int) -> torch.Tensor:
    """Rotated coordinate at each position of the decode kernel's K^T tile: field j of group g = GR*gl + gr
    at j0 + 2*gl + 8*j1 + 16*j2 + 32*gr (GR = dim/32; coordinate j*G + g, G = dim/8)."""
    g_count, gr_count = dim // 8, dim // 32
    pos = torch.empty(dim, dtype=torch.long)
    for g in range(g_count):
        gl, gr = divmod(g, gr_count)
        for j in range(8):
            pos[(j & 1) + 2 * gl + 8 * ((j >> 1) & 1) + 16 * (j >> 2) + 32 * gr] = j * g_count + g
    return pos


def decode_value_order(dim: int) -> torch.Tensor:
    """Rotated coordinate at each position of the decode kernel's V tile: field j of group g = GRV*gl + gr
    at gl + 8*j0 + 16*j1 + 32*j2 + 64*gr (GRV = dim/64)."""
    g_count, gr_count = dim // 8, max(dim // 64, 1)
    pos = torch.empty(dim, dtype=torch.long)
    for g in range(g_count):
        gl, gr = divmod(g, gr_count)
        for j in range(8):
            pos[gl + 8 * (j & 1) + 16 * ((j >> 1) & 1) + 32 * (j >> 2) + 64 * gr] = j * g_count + g
    return pos


@functools.lru_cache(maxsize=64)
def _ordered_rotation(dim: int, bits: float, seed: int, device: str, value: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rot_hi, rot_lo) rows of the codec's rotation in the decode kernel's K (or V) order."""
    order = (decode_value_order if value else decode_key_order)(dim)
    return rotation_rows_in_order(codec_tables(dim, bits, seed, device), order)


def _byte_word(bits: list[int], first: int, high: bool) -> int:
    """int32 value of the word whose byte e is the low (or high) byte of fp16 entry ``first + e`` of ``bits`` (the
    entries' 16-bit patterns; entries past the end are 0)."""
    w = 0
    for e in range(4):
        v = bits[first + e] if first + e < len(bits) else 0
        w |= ((v >> 8) if high else (v & 0xFF)) << (8 * e)
    return w - (1 << 32) if w >= 1 << 31 else w


def _entry_bits(cent_f16: torch.Tensor) -> list[int]:
    """16-bit patterns of the entries: fp16, or bf16 where the codebook comes as bf16."""
    c = cent_f16.detach().cpu()
    c = c if c.dtype == torch.bfloat16 else c.to(torch.float16)
    return c.flatten().view(torch.int16).to(torch.int64).bitwise_and(0xFFFF).tolist()


def codebook_permute_words(cent_f16: torch.Tensor) -> tuple[int, ...]:
    """The byte-permute lookup's 8 codebook words (``codebook_lookup_jit._codebook_bytes``) as int32 values:
    lo_k / hi_k hold the low / high bytes of fp16 entries 4k..4k+3; words past the codebook repeat lo0 / hi0."""
    bits = _entry_bits(cent_f16)
    firsts = [4 * k if 4 * k < len(bits) else 0 for k in range(4)]
    return tuple(_byte_word(bits, f, False) for f in firsts) + tuple(_byte_word(bits, f, True) for f in firsts)


def codebook_magnitude_words(cent_f16: torch.Tensor) -> tuple[int, int, int, int]:
    """``codebook_lookup_jit.SYMMETRIC_LOOKUP8_ASM``'s 4 codebook words as int32 values: the low bytes of the
    magnitudes m[k] = c[8 + k] (k = 0-3, then 4-7), then their high bytes. Only for 16 fp16 entries, ascending and
    symmetric about zero bit for bit (c[15 - i] = -c[i]), as the Lloyd-Max codebooks are. A bf16 codebook gives bf16
    words (the lookup only moves bytes and sets bit 15)."""
    if cent_f16.numel() != 16:
        raise ValueError(f"the symmetric lookup takes codebooks of 16 entries, not {cent_f16.numel()}")
    c = cent_f16.detach().cpu()
    c = (c if c.dtype == torch.bfloat16 else c.to(torch.float16)).flatten()
    if not (torch.equal(c.flip(0), -c) and bool((c[1:] > c[:-1]).all())):
        raise ValueError("the symmetric lookup needs an ascending codebook symmetric about zero (c[15 - i] = -c[i])")
    bits = _entry_bits(c)
    lo0, lo1, hi0, hi1 = (_byte_word(bits, first, high) for high in (False, True) for first in (8, 12))
    return lo0, lo1, hi0, hi1


def num_decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device, min_tokens: int,
                      max_splits: int, programs_per_sm: int = DECODE_PROGRAMS_PER_SM) -> int:
    """KV splits per (request, KV head) for a decode batch: none when the pairs alone fill a wave of programs
    (``programs_per_sm`` per SM); otherwise the fewest splits whose programs fill their waves within
    WAVE_FILL_SLACK of the best count (a batch of one wave and a few programs takes about two waves' time), at
    most one split per ``min_tokens`` of the longest sequence and ``max_splits``."""
    from .paged_attention import _sm_count

    pairs = max(num_reqs * num_kv_heads, 1)
    wave = programs_per_sm * _sm_count(str(device))
    most = max(1, min(max_seq_len // min_tokens, max_splits))
    if pairs >= wave or most == 1:
        return 1

    def fill(splits: int) -> float:
        programs = pairs * splits
        return programs / (triton.cdiv(programs, wave) * wave)

    # The fullest counts sit just below a whole number of waves: one or two (more waves only add splits).
    candidates = sorted({1, most, *(min(max(k * wave // pairs, 1), most) for k in (1, 2))})
    best = max(fill(s) for s in candidates)
    return next(s for s in candidates if fill(s) >= best - WAVE_FILL_SLACK)


# Workspace sections start on 64-byte boundaries: their pointers keep one alignment class whatever the batch, so
# the kernels compile one variant (and keep their vector loads) for every batch size.
_SECTION_FLOATS = 16


def _round_up(n: int) -> int:
    return -(-n // _SECTION_FLOATS) * _SECTION_FLOATS


def _workspace_sections(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int,
                        center_groups: int = 0, num_kv_heads: int = 0) -> tuple[int, ...]:
    """float32 offsets of (partial outputs, log-sum-exps, fp16 rotated queries, fp16 centering operands,
    centering scales, centering logits, end) in the workspace."""
    rows = num_tokens * num_q_heads
    part_o = 0
    part_l = _round_up(part_o + num_splits * rows * head_dim)
    qrot = _round_up(part_l + num_splits * rows)
    cwz = _round_up(qrot + (rows * head_dim + 1) // 2)
    cscale = _round_up(cwz + rows * head_dim)
    logits = _round_up(cscale + rows)
    return part_o, part_l, qrot, cwz, cscale, logits, logits + num_tokens * num_kv_heads * center_groups * 8


def decode_workspace_floats(num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int,
                            center_groups: int = 0, num_kv_heads: int = 0) -> int:
    """float32 elements the decode path needs: partial outputs and log-sum-exps per split, fp16 rotated
    queries, the key-centering operands (fp16 w and z, an fp32 scale per row) and, for ``center_groups`` > 0, the
    centering logits of that many 16-token groups per token and KV head (8 columns each)."""
    return _workspace_sections(num_tokens, num_q_heads, head_dim, num_splits, center_groups, num_kv_heads)[-1]


def decode_workspace_views(ws: torch.Tensor, num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int):
    """The decode path's views of the workspace (``_workspace_sections``): partial outputs [splits, T, Hq, d] and
    log-sum-exps [splits, T, Hq] (fp32), rotated queries [T, Hq, d] (fp16), centering operands [T, Hq, 2, d] (fp16)
    and scales [T, Hq] (fp32)."""
    tq, hq, d, s = num_tokens, num_q_heads, head_dim, num_splits
    o_off, l_off, q_off, c_off, s_off, _, _ = _workspace_sections(tq, hq, d, s)
    return (ws[o_off : o_off + s * tq * hq * d].view(s, tq, hq, d), ws[l_off : l_off + s * tq * hq].view(s, tq, hq),
            ws[q_off:c_off].view(torch.float16)[: tq * hq * d].view(tq, hq, d),
            ws[c_off : c_off + tq * hq * d].view(torch.float16).view(tq, hq, 2, d),
            ws[s_off : s_off + tq * hq].view(tq, hq))


def center_logits_view(ws: torch.Tensor, num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int,
                       center_groups: int, num_kv_heads: int) -> torch.Tensor:
    """The centering logits' section of the workspace: [T, KV heads, center_groups, 8] fp32, a KV head's query
    heads in the first columns of its 8 (``tq_center_logits_kernel``)."""
    g_off, end = _workspace_sections(num_tokens, num_q_heads, head_dim, num_splits, center_groups, num_kv_heads)[-2:]
    return ws[g_off:end].view(num_tokens, num_kv_heads, center_groups, 8)


def center_query_operands(plan, q: torch.Tensor, cwz: torch.Tensor, cscale: torch.Tensor, centering,
                          center_sums: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """With key centering: the queries' centering operands into ``cwz`` / ``cscale`` (``tq_center_queries_kernel``),
    and the decode kernels' page tables (fp16 cos, sin, page count); without: placeholders."""
    from ..kernels.paged_decode_jit import tq_center_queries_kernel

    if centering is None:
        return cscale, cscale, 1
    d, ql = plan.layout.head_dim, plan.max_query_len
    tq_center_queries_kernel[(plan.num_reqs, plan.num_kv_heads, ql)](
        q, q.stride(0), q.stride(1), plan.query_start_loc, center_sums, center_sums.stride(0),
        center_sums.stride(1), cwz, cwz.stride(0), cwz.stride(1), cscale, cscale.stride(0),
        plan.softmax_scale / LN2, GQ=plan.group, GQP=triton.next_power_of_2(plan.group), D=d, D_PAD=d,
        ROT_HALF=centering.rot_half, NEOX=centering.neox, QL=ql, num_warps=4)
    return centering.page_cos16, centering.page_sin16, centering.num_pages


def center_logits(plan, q: torch.Tensor, centering, center_sums: torch.Tensor, logits: torch.Tensor,
                  rotate: tuple | None = None, pdl: bool = False) -> None:
    """The centering logits of a decode batch (one query token per request) for every 16-token group of each
    request's sequence into ``logits`` [T, KV heads, groups, 8] (``tq_center_logits_kernel``), from the queries and
    the requests' first-page sums: the attention adds them per group instead of computing them. ``rotate`` =
    (rotation (hi, lo), qrot, scale, exact): the same launch writes the rotated queries, as
    ``tq_rotate_queries_kernel`` would. ``pdl``: the next launch is a programmatic dependent of this one."""
    from ..kernels.paged_decode_jit import tq_center_logits_kernel

    hq, d, groups = plan.num_q_heads, plan.layout.head_dim, logits.shape[2]
    hb = min(max(triton.next_power_of_2(hq), 16), CENTER_LOGITS_HEADS)
    grid = (plan.num_reqs, triton.cdiv(hq, hb), triton.cdiv(groups, CENTER_LOGITS_GROUPS))
    (rot_hi, rot_lo), qrot, rot_scale, exact = rotate if rotate is not None else ((logits, logits), logits, 1.0, True)
    tq_center_logits_kernel[grid](
        q, q.stride(0), q.stride(1), plan.query_start_loc, plan.seq_lens, center_sums, center_sums.stride(0),
        center_sums.stride(1), plan.softmax_scale / LN2, centering.page_cos16, centering.page_sin16,
        centering.num_pages, logits, logits.stride(0), logits.stride(1),
        rot_hi, rot_lo, qrot, qrot.stride(0), qrot.stride(1), rot_scale,
        HQ=hq, GQ=plan.group, HB=hb, D=d, PAGE=plan.layout.block_size, BG=CENTER_LOGITS_GROUPS,
        ROT_HALF=centering.rot_half, NEOX=centering.neox, ROTATE=rotate is not None, EXACT=exact, PDL=pdl,
        num_warps=4)


def center_logits_ref(cwz: torch.Tensor, cscale: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      centering, block_size: int, num_kv_heads: int, groups: int) -> torch.Tensor:
    """Plain-torch ``center_logits`` in float64 from the same fp16 operands and tables: [T, KV heads, groups, 8], the
    groups past a request's sequence and the columns past a KV head's query heads zero (the kernel leaves them
    unwritten)."""
    tq, hq, _, d = cwz.shape
    gq = hq // num_kv_heads
    out = torch.zeros(tq, num_kv_heads, groups, 8, dtype=torch.float64)
    pc, ps = centering.page_cos16.double().cpu(), centering.page_sin16.double().cpu()
    for r in range(seq_lens.shape[0]):
        t = int(query_start_loc[r])
        n = -(-int(seq_lens[r]) // CENTER_GROUP_TOKENS)
        rows = (torch.arange(n) * CENTER_GROUP_TOKENS // block_size).clamp(max=pc.shape[0] - 1)
        w, z = cwz[t, :, 0].double().cpu(), cwz[t, :, 1].double().cpu()  # [Hq, d]
        lg = (pc[rows] @ w.T + ps[rows] @ z.T) * cscale[t].double().cpu()[None, :]  # [n, Hq]
        out[t, :, :n, :gq] = lg.view(n, num_kv_heads, gq).permute(1, 0, 2)
    return out


def _pdl_launch(pdl: bool) -> dict:
    """Launch options of a programmatic dependent launch whose kernel waits for the grid before it (``PDL``)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def merge_unrotate(part_o: torch.Tensor, part_l: torch.Tensor, vrot: tuple[torch.Tensor, torch.Tensor],
                   out: torch.Tensor, lse: torch.Tensor | None, rows: int, num_splits: int, v_rot_scale: float,
                   num_q_heads: int, head_dim: int, exact_rot: bool, pdl: bool = False) -> None:
    """The split merge and rotation back of a decode batch's partial outputs (``tq_merge_unrotate_kernel``).
    ``pdl``: its launches are programmatic dependents of the launch before each (sm_90 and later)."""
    from ..kernels.paged_decode_jit import tq_merge_split_groups_kernel, tq_merge_unrotate_kernel

    write_lse = lse is not None
    lse_arg = lse if write_lse else out
    sc = merge_splits_per_load(num_splits)
    stride_pos, stride_pls = part_o.stride(0), part_l.stride(0)
    if num_splits > MERGE_GROUPS_FROM * sc:
        tq_merge_split_groups_kernel[(triton.cdiv(rows, MERGE_ROWS_PER_PROGRAM), triton.cdiv(num_splits, sc))](
            part_o, stride_pos, part_o.stride(1), part_o.stride(2), part_l, stride_pls, part_l.stride(1), rows,
            num_splits, HQ=num_q_heads, DP=head_dim, BR=MERGE_ROWS_PER_PROGRAM, SC=sc, num_warps=MERGE_WARPS,
            **_pdl_launch(pdl))
        num_splits, stride_pos, stride_pls = triton.cdiv(num_splits, sc), stride_pos * sc, stride_pls * sc
    one = num_splits == 1
    br = UNSPLIT_ROWS_PER_PROGRAM if one else MERGE_ROWS_PER_PROGRAM
    tq_merge_unrotate_kernel[(triton.cdiv(rows, br),)](
        part_o, stride_pos, part_o.stride(1), part_o.stride(2), part_l, stride_pls, part_l.stride(1),
        vrot[0], vrot[1], out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0), rows, num_splits,
        v_rot_scale, HQ=num_q_heads, D=head_dim, DP=head_dim, EXACT=exact_rot, BR=br, SC=sc,
        ONE_SPLIT=one, WRITE_LSE=write_lse, num_warps=4 if one else MERGE_WARPS, **_pdl_launch(pdl))


def run_decode(plan, q: torch.Tensor, cache_u8: torch.Tensor, cache_f16: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, centering=None, center_sums: torch.Tensor | None = None) -> None:
    """The launches for a planned decode batch (``TQAttentionPlan.run`` checked the arguments)."""
    from ..kernels.paged_decode_jit import tq_paged_decode_kernel, tq_rotate_queries_kernel

    lay: PagedTQLayout = plan.layout
    d = lay.head_dim
    kt: _ComponentTables = plan.k_tables
    vt: _ComponentTables = plan.v_tables
    tq, hq, hkv = q.shape[0], plan.num_q_heads, plan.num_kv_heads
    s = plan.decode_splits
    part_o, part_l, qrot, cwz, cscale = decode_workspace_views(plan.workspace, tq, hq, d, s)
    ql = plan.max_query_len
    page_cos, page_sin, num_pages = center_query_operands(plan, q, cwz, cscale, centering, center_sums)
    f = lay.fmt
    krot = _ordered_rotation(d, f.key.bits, f.key_seed, str(q.device), False)
    vrot = _ordered_rotation(d, f.value.bits, f.value_seed, str(q.device), True)
    rows = tq * hq
    grid_rows = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    tq_rotate_queries_kernel[grid_rows](
        q, q.stride(0), q.stride(1), krot[0], krot[1], qrot, qrot.stride(0), qrot.stride(1), rows,
        plan.softmax_scale * kt.codec.rot_scale / LN2,
        HQ=hq, D=d, DP=d, EXACT=kt.codec.exact_rot, BR=ROWS_PER_PROGRAM, num_warps=4)
    plan.last_compiled = tq_paged_decode_kernel[(plan.num_reqs, hkv, s)](
        qrot, qrot.stride(0), qrot.stride(1),
        cache_u8, cache_f16, cache_u8.stride(0), cache_u8.stride(1),
        plan.block_table, plan.block_table.stride(0), plan.query_start_loc, plan.seq_lens,
        *plan.decode_words[0], *plan.decode_words[1],
        part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
        s, cwz, cwz.stride(0), cwz.stride(1), cscale, cscale.stride(0), page_cos, page_sin, num_pages,
        DP=d, GQ=plan.group, BN=DECODE_BLOCK_N, PAGE=lay.block_size, KB=int(f.key.bits), VB=int(f.value.bits),
        KG=d // 8, VG=d // 8, K_IDX_OFF=lay.k_index_offset, V_IDX_OFF=lay.v_index_offset,
        K_SC_OFF=lay.k_scale_offset, V_SC_OFF=lay.v_scale_offset, K_ROW=lay.k_index_bytes, V_ROW=lay.v_index_bytes,
        CENTER=centering is not None, QL=ql, PREFETCH=DECODE_PREFETCH, num_warps=1,
    )
    merge_unrotate(part_o, part_l, vrot, out, lse, rows, s, vt.codec.rot_scale, hq, d, vt.codec.exact_rot)

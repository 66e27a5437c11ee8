# SPDX-License-Identifier: Apache-2.0
"""Decode attention with e4m3 operands through Hopper warpgroup MMA (``kernels.paged_decode_wgmma_jit``), on the
pages the store kernel writes.

``TQAttentionPlan`` takes this path where ``TQAttentionConfig.decode_kernel`` allows it (``"auto"``, the default, or
``"wgmma"``) and it serves the batch (``wgmma_decode_applies``): one query per request, 3-bit keys and 4-bit values of
one segment each (k3v4), head_dim 128, a GQA group of at most 8, no sliding window, pages a multiple of 16 tokens, on
an sm_90 GPU. Three launches: the queries rotated into the kernel's key order
(``tq_rotate_queries_kernel``), the attention (one warpgroup per request, KV head and split), and the split merge
with the rotation back from the value order (``tq_merge_unrotate_kernel``). Keys stored with key centering get their
page centres' score terms (logits) computed ahead for every 16-token group of each sequence where the workspace holds
them (``center_logits``, which rotates the queries in the same launch); the attention copies each 1024-token block's
logits into shared memory with the tile copies and adds 4 groups' worth per tile. Where they do not fit, one more
launch makes the queries' centering operands, and the attention computes the terms itself, as a small fp16 warpgroup
product per 1024 tokens. Elsewhere the plan keeps its other kernels. The keys, the query and the probabilities
enter the products as e4m3: the key codebook and the value codebook's magnitudes rounded to e4m3, each query column
at a power-of-two scale, P^T * v_scale at a power-of-two scale; ``wgmma_decode_reference`` computes the same thing
in plain torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

from ..kernels.paged_decode_wgmma_jit import WGMMA_KEY_ORDER, WGMMA_VALUE_ORDER
from .page_layout import PagedTQLayout
from .paged_decode import (
    LN2,
    ROWS_PER_PROGRAM,
    _gluon_runs,
    _pdl_launch,
    center_logits,
    center_logits_view,
    center_query_operands,
    decode_workspace_views,
    merge_unrotate,
)
from .rotation_tables import codec_tables, rotation_rows_in_order

WGMMA_HEAD_DIM = 128
WGMMA_KEY_BITS, WGMMA_VALUE_BITS = 3, 4
WGMMA_MAX_GROUP = 8  # the GQA group fills at most the kernel's 8 MMA columns
WGMMA_TILE = 64  # cached tokens per tile; a split's range is a whole number of tiles
# Warpgroup programs per SM a wave of splits is sized for: about 64 registers x 128 threads let 8 reside, and the
# study kernel needed them all to approach the copy bandwidth (benchmarks/results/2026-11-26-h100-e4m3-wgmma-decode/).
WGMMA_PROGRAMS_PER_SM = 8
# Waves of programs a split batch may fill. The split sweep's best counts fill one to three waves; the most splits that
# fit two are within 2 % of the best at 10 of the 11 shapes it measured, while one wave leaves SMs idle behind the
# programs that finish last and counts of more waves add merge work
# (benchmarks/results/2026-11-27-h100x4-issue-31-floors/).
WGMMA_WAVES = 2
# Registers per thread the kernel may use (0: no cap): 64 x 128 threads let WGMMA_PROGRAMS_PER_SM programs reside (the
# uncapped build takes 66, rounded up to 72 by the allocator, so only 7 fit); ptxas keeps it without spills, and the
# centred variant with a few loop-invariant values on the stack.
WGMMA_MAXNREG = 64
P_EXP = 8  # P^T * v_scale is stored in e4m3 at 2^(P_EXP - e): at most 2^8, below e4m3's 448


def wgmma_decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, device, min_tokens: int,
                        max_splits: int) -> int:
    """KV splits per (request, KV head) for a decode batch on this kernel: the most whose programs fit WGMMA_WAVES
    waves of WGMMA_PROGRAMS_PER_SM programs per SM, at most one split per ``min_tokens`` of the longest sequence and
    ``max_splits``; none where the pairs alone fill them."""
    from .paged_attention import _sm_count

    programs = WGMMA_WAVES * WGMMA_PROGRAMS_PER_SM * _sm_count(str(device))
    most = max(1, min(max_seq_len // min_tokens, max_splits))
    return max(1, min(programs // max(num_reqs * num_kv_heads, 1), most))


def wgmma_decode_applies(layout: PagedTQLayout, group: int, device: torch.device, *, max_query_len: int,
                         causal: bool, sliding_window: int | None) -> bool:
    """Whether the e4m3 warpgroup-MMA kernel serves this decode batch (with or without key centering)."""
    fmt = layout.fmt
    return (fmt.key.has_codebook and fmt.key.bits == WGMMA_KEY_BITS and fmt.value.has_codebook
            and fmt.value.bits == WGMMA_VALUE_BITS and len(_codec(layout, False).segments) == 1
            and len(_codec(layout, True).segments) == 1 and layout.head_dim == WGMMA_HEAD_DIM
            and group <= WGMMA_MAX_GROUP and max_query_len == 1 and causal and sliding_window is None
            and layout.block_size % 16 == 0 and _sm90(str(device)))


def _codec(layout: PagedTQLayout, value: bool):
    """The host-side codec tables of the layout's key (or value) component."""
    comp = layout.fmt.value if value else layout.fmt.key
    seed = layout.fmt.value_seed if value else layout.fmt.key_seed
    return codec_tables(layout.head_dim, comp.bits, seed, "cpu")


@functools.lru_cache(maxsize=8)
def _sm90(device: str) -> bool:
    """Where the Gluon decode kernels run (``paged_decode._gluon_runs``) on an sm_90 GPU: wgmma needs sm_90a."""
    return _gluon_runs(device) and torch.cuda.get_device_capability(torch.device(device)) == (9, 0)


@dataclass(frozen=True)
class E4m3Codebooks:
    """The kernel's codebooks in e4m3: ``key`` [8] the key centroids times ``key_factor``, ``value`` [8] the value
    codebook's magnitudes (entries 8-15 of its 16) times ``value_factor``, each rounded to e4m3 (float32 values).
    The factors (in [1, 2)) put the centroids where e4m3's 3-bit mantissa rounds them least; the query rotation
    divides ``key_factor`` out of the scores and the split merge ``value_factor`` out of the output."""

    key: torch.Tensor
    value: torch.Tensor
    key_factor: float
    value_factor: float

    def value_natural(self) -> torch.Tensor:
        """[16] the value codebook as the kernel sees it, in natural index order (times ``value_factor``)."""
        return torch.cat([-self.value.flip(0), self.value])


def _best_e4m3_factor(magnitudes: torch.Tensor, steps: int = 1024) -> float:
    """The factor in [1, 2) whose product with ``magnitudes`` has the smallest largest relative e4m3 rounding error
    (a power of two changes no relative error, so [1, 2) covers every choice)."""
    c = magnitudes.double()
    best = (math.inf, 1.0)
    for i in range(steps):
        f = 2.0 ** (i / steps)
        err = float(((c * f).float().to(torch.float8_e4m3fn).double() / f - c).abs().div(c).max())
        best = min(best, (err, f))
    return best[1]


def e4m3_codebooks(key_centroids: torch.Tensor, value_centroids: torch.Tensor) -> E4m3Codebooks:
    """The 8-entry key and the symmetric 16-entry value codebook as the kernel's e4m3 tables."""
    k = key_centroids.detach().double().cpu()
    v = value_centroids.detach().double().cpu()
    if k.numel() != 8 or v.numel() != 16:
        raise ValueError(f"need an 8-entry key and a 16-entry value codebook, got {k.numel()} and {v.numel()}")
    if not torch.allclose(v[8:], -v[:8].flip(0), rtol=1e-5, atol=1e-6):
        raise ValueError("the value codebook must be symmetric (c_i = -c_{15-i}) for sign-magnitude lookups")
    fk, fv = _best_e4m3_factor(k.abs()), _best_e4m3_factor(v[8:])
    return E4m3Codebooks((k * fk).float().to(torch.float8_e4m3fn).float(),
                         (v[8:] * fv).float().to(torch.float8_e4m3fn).float(), fk, fv)


def e4m3_table_words(values: torch.Tensor) -> tuple[int, int]:
    """8 values -> the two int32 registers a ``prmt`` selects from (entries 0-3 and 4-7 as little-endian e4m3
    bytes)."""
    b = values.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64).tolist()
    words = [b[4 * r] | b[4 * r + 1] << 8 | b[4 * r + 2] << 16 | b[4 * r + 3] << 24 for r in range(2)]
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


@functools.lru_cache(maxsize=32)
def layout_codebooks(layout: PagedTQLayout) -> E4m3Codebooks:
    """``e4m3_codebooks`` of a layout's key and value codecs."""
    return e4m3_codebooks(_codec(layout, False).centroids[0], _codec(layout, True).centroids[0])


def wgmma_table_words(layout: PagedTQLayout) -> tuple[int, int, int, int]:
    """(kt0, kt1, vt0, vt1): the kernel's e4m3 codebook registers for this layout (host ints)."""
    cb = layout_codebooks(layout)
    return (*e4m3_table_words(cb.key), *e4m3_table_words(cb.value))


@functools.lru_cache(maxsize=16)
def _ordered_rotation(bits: float, seed: int, device: str, value: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rot_hi, rot_lo) rows of the codec's rotation in the kernel's key (or value) order."""
    order = torch.tensor(WGMMA_VALUE_ORDER if value else WGMMA_KEY_ORDER, dtype=torch.long)
    return rotation_rows_in_order(codec_tables(WGMMA_HEAD_DIM, bits, seed, device), order)


def run_decode_wgmma(plan, q: torch.Tensor, cache_u8: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor | None, centering=None, center_sums: torch.Tensor | None = None) -> None:
    """The launches for a planned decode batch (``TQAttentionPlan.run`` checked the arguments)."""
    from ..kernels.paged_decode_jit import tq_rotate_queries_kernel
    from ..kernels.paged_decode_wgmma_jit import tq_paged_decode_wgmma_kernel

    lay: PagedTQLayout = plan.layout
    d = lay.head_dim
    kt, vt = plan.k_tables, plan.v_tables
    tq, hq, hkv = q.shape[0], plan.num_q_heads, plan.num_kv_heads
    s = plan.decode_splits
    part_o, part_l, qrot, cwz, cscale = decode_workspace_views(plan.workspace, tq, hq, d, s)
    f = lay.fmt
    cb = layout_codebooks(lay)
    krot = _ordered_rotation(f.key.bits, f.key_seed, str(q.device), False)
    vrot = _ordered_rotation(f.value.bits, f.value_seed, str(q.device), True)
    rows = tq * hq
    q_scale = plan.softmax_scale * kt.codec.rot_scale / LN2 / cb.key_factor
    center, logits, lstrides = 0, cscale, (0, 0)
    page_cos, page_sin, num_pages = cscale, cscale, 1
    # key centering: the logits of every 16-token group computed ahead, from the queries and the first-page sums,
    # where the workspace holds them (CENTER 2; that launch also rotates the queries); else the queries' centering
    # operands, from which the attention computes them per 1024 tokens (CENTER 1)
    if centering is not None and plan.center_groups:
        center = 2
        logits = center_logits_view(plan.workspace, tq, hq, d, s, plan.center_groups, plan.num_kv_heads)
        center_logits(plan, q, centering, center_sums, logits, rotate=(krot, qrot, q_scale, kt.codec.exact_rot),
                      pdl=True)
        lstrides = (logits.stride(0), logits.stride(1))
    else:
        if centering is not None:
            center = 1
            page_cos, page_sin, num_pages = center_query_operands(plan, q, cwz, cscale, centering, center_sums)
        tq_rotate_queries_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
            q, q.stride(0), q.stride(1), krot[0], krot[1], qrot, qrot.stride(0), qrot.stride(1), rows, q_scale,
            HQ=hq, D=d, DP=d, EXACT=kt.codec.exact_rot, BR=ROWS_PER_PROGRAM, PDL=True, num_warps=4)
    # The attention and the merge are programmatic dependent launches: each may start once every program of the
    # launch before it has triggered (the rotation at its start, the logits after their products, the attention after
    # its tile loop), and waits for that grid before reading its output.
    plan.last_compiled = tq_paged_decode_wgmma_kernel[(plan.num_reqs, hkv, s)](
        qrot, qrot.stride(0), qrot.stride(1),
        cache_u8, cache_u8.stride(0), cache_u8.stride(1),
        plan.block_table, plan.block_table.stride(0), plan.query_start_loc, plan.seq_lens,
        *plan.wgmma_words,
        part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
        s, cwz, cwz.stride(0), cwz.stride(1), cscale, cscale.stride(0), page_cos, page_sin, num_pages,
        logits, *lstrides,
        GQ=plan.group, PAGE=lay.block_size, K_IDX_OFF=lay.k_index_offset, V_IDX_OFF=lay.v_index_offset,
        K_SC_OFF=lay.k_scale_offset, V_SC_OFF=lay.v_scale_offset, P_EXP=P_EXP, CENTER=center, num_warps=4,
        **_pdl_launch(True),
        **({"maxnreg": WGMMA_MAXNREG} if WGMMA_MAXNREG else {}),
    )
    merge_unrotate(part_o, part_l, vrot, out, lse, rows, s, vt.codec.rot_scale / cb.value_factor, hq, d,
                   vt.codec.exact_rot, pdl=True)


def _e4m3(x: torch.Tensor, exact: bool = False) -> torch.Tensor:
    return x.double() if exact else x.to(torch.float8_e4m3fn).double()


def wgmma_decode_reference(q_rot: torch.Tensor, k_idx: torch.Tensor, k_scale: torch.Tensor, v_idx: torch.Tensor,
                           v_scale: torch.Tensor, key_table: torch.Tensor, value_table: torch.Tensor,
                           num_splits: int = 1, *, exact: bool = False,
                           center_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes for one (request, KV head), in plain torch (float64 sums), split by split.

    q_rot [G, 128]: the rotated, pre-scaled queries of the group (log2 domain, natural coordinate order); k_idx /
    v_idx [N, 128] the cached tokens' key and natural value indices, k_scale / v_scale [N] their scales; key_table
    [8] and value_table [16] (natural order) the codebooks the products use (``E4m3Codebooks``: the key and
    ``value_natural()``). Each query row is rounded to e4m3 at the kernel's power-of-two scale, and P^T * v_scale per
    64-token tile at the kernel's running power-of-two scale (the whole-number softmax maxima included); ``exact``
    rounds neither. ``center_logits`` [G, N] (log2 domain): the key-centering terms q . c_p added to the scores.
    Returns (O [splits, G, 128] normalized within each split, natural coordinate order; log2-sum-exp2 [splits, G],
    -inf where a split is empty)."""
    kc, vc = key_table.double().cpu(), value_table.double().cpu()
    q = q_rot.double().cpu()
    amax = q.abs().amax(-1)
    q_exp = torch.where(amax > 0, torch.floor(torch.log2(448.0 / torch.where(amax > 0, amax, 1.0))), 0.0)
    q_exp = torch.where(amax * torch.exp2(q_exp) >= 448.0, q_exp - 1, q_exp)
    q8 = _e4m3(q * torch.exp2(q_exp)[:, None], exact)
    kf = kc[k_idx.long().cpu()]
    vf = vc[v_idx.long().cpu()]
    k_scale, v_scale = k_scale.double().cpu(), v_scale.double().cpu()
    n, g = k_idx.shape[0], q.shape[0]
    per_split = -(-n // num_splits)  # as the kernel: a whole number of tiles per split
    chunk = -(-per_split // WGMMA_TILE) * WGMMA_TILE
    outs, lses = [], []
    for sp in range(num_splits):
        lo, hi = sp * chunk, min(n, sp * chunk + chunk)
        m = torch.full((g,), -math.inf, dtype=torch.float64)
        e_v = -64.0
        lsum = torch.zeros(g, dtype=torch.float64)
        acc = torch.zeros(g, WGMMA_HEAD_DIM, dtype=torch.float64)
        for start in range(lo, hi, WGMMA_TILE):
            t = slice(start, min(hi, start + WGMMA_TILE))
            sc = (q8 @ kf[t].T) * k_scale[t][None, :] * torch.exp2(-q_exp)[:, None]
            if center_logits is not None:
                sc = sc + center_logits[:, t].double().cpu()
            m_new = torch.maximum(m, torch.ceil(sc.amax(-1)))
            p = torch.exp2(sc - m_new[:, None])
            alpha = torch.exp2(m - m_new)
            vmax = float(v_scale[t].max())
            e_new = max(e_v, math.ceil(math.log2(vmax)) if vmax > 0 else e_v)
            lsum = lsum * alpha + p.sum(-1)
            acc = acc * (alpha * 2.0 ** (e_v - e_new))[:, None]
            m, e_v = m_new, e_new
            acc = acc + _e4m3(p * (v_scale[t] * 2.0 ** (P_EXP - e_v))[None, :], exact) @ vf[t]
        ok = lsum > 0
        outs.append(torch.where(ok[:, None], acc * 2.0 ** (e_v - P_EXP) / torch.where(ok, lsum, 1.0)[:, None], 0.0))
        lses.append(torch.where(ok, m + torch.log2(torch.where(ok, lsum, 1.0)), -math.inf))
    return torch.stack(outs), torch.stack(lses)


def tq_paged_decode_wgmma_ref(q: torch.Tensor, cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, num_splits: int = 1,
                              softmax_scale: float | None = None, exact: bool = False, centering=None,
                              center_sums: torch.Tensor | None = None):
    """The whole decode path in plain torch: each request's last query rotated and pre-scaled as
    ``tq_rotate_queries_kernel`` does (stored in fp16), ``wgmma_decode_reference`` per request and KV head over the
    indices and scales read from the pages, the splits merged and the output rotated back as
    ``tq_merge_unrotate_kernel`` does. Returns out [Tq, Hq, d] (q.dtype; rows of other tokens zero) and lse [Hq, Tq]
    float32, natural log (-inf for rows that see no token). ``exact``: no e4m3 rounding anywhere (then it is the
    attention ``ops.paged_reference.tq_paged_attention_ref`` computes, to float64 rounding). A cache stored with key
    centering is read with the same ``centering`` and ``center_sums``: the scores get q . c_p exactly."""
    from ..packing import unpack_indices
    from .key_centering import center_vectors_ref, token_centers_ref
    from .paged_reference import read_cached_tokens

    d, f = layout.head_dim, layout.fmt
    kt, vt = _codec(layout, False), _codec(layout, True)
    if exact:
        key_table, value_table, fk, fv = kt.centroids[0], vt.centroids[0], 1.0, 1.0
    else:
        cb = layout_codebooks(layout)
        key_table, value_table, fk, fv = cb.key, cb.value_natural(), cb.key_factor, cb.value_factor
    natural = torch.arange(d)
    krows = sum(t.double() for t in rotation_rows_in_order(kt, natural))  # [d, d]: row i = rotated coordinate i
    vrows = sum(t.double() for t in rotation_rows_in_order(vt, natural))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    tq, hq, _ = q.shape
    hkv = cache.shape[1]
    g = hq // hkv
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    lse = torch.full((hq, tq), -math.inf, dtype=torch.float64)
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    cache_cpu = cache.cpu()
    for r in range(block_table.shape[0]):
        nq, n = qsl[r + 1] - qsl[r], sl[r]
        if nq <= 0 or n <= 0:
            continue
        t = qsl[r + 1] - 1
        k_idx, k_scale, v_idx, v_scale = read_cached_tokens(cache_cpu, layout, block_table[r].cpu(), n)
        ki, vi = unpack_indices(k_idx, f.key.bits, d), unpack_indices(v_idx, f.value.bits, d)
        if centering is not None:
            mu, mup = center_vectors_ref(center_sums[r].cpu(), centering)  # [Hkv, dim_pad]
            centres = token_centers_ref(mu[None].expand(n, -1, -1), mup[None].expand(n, -1, -1), torch.arange(n),
                                        centering)  # [n, Hkv, d]
        for h in range(hkv):
            heads = slice(h * g, (h + 1) * g)
            qr = (q[t, heads].double().cpu() @ krows.T) * (scale * kt.rot_scale / LN2 / fk)
            if not exact:
                qr = qr.half().double()
            cl = None if centering is None else (q[t, heads].double().cpu() @ centres[:, h].T) * (scale / LN2)
            o, l2 = wgmma_decode_reference(qr, ki[:, h], k_scale[:, h], vi[:, h], v_scale[:, h], key_table, value_table,
                                           num_splits, exact=exact, center_logits=cl)
            mx = l2.amax(0)
            mx_safe = torch.where(torch.isfinite(mx), mx, 0.0)
            w = torch.where(torch.isfinite(l2), torch.exp2(l2 - mx_safe), 0.0)  # [splits, G]
            total = w.sum(0)
            o = (w[..., None] * o).sum(0) / torch.where(total > 0, total, 1.0)[:, None]
            out[t, heads] = (o @ vrows) * (vt.rot_scale / fv)
            lse[heads, t] = torch.where(total > 0, (mx_safe + torch.log2(torch.where(total > 0, total, 1.0))) * LN2,
                                        -math.inf)
    return out.to(q.dtype).to(q.device), lse.float().to(q.device)

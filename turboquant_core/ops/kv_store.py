# SPDX-License-Identifier: Apache-2.0
"""Store into a paged TurboQuant cache (page layout: ``ops.page_layout``).

- ``tq_store(key, value, cache, slot_mapping, layout)``: fused rotate + quantize + pack of K and V
  into their pages (one launch); slots < 0 are skipped (vLLM's padding).
- Key centering (``ops.key_centering``): ``tq_store(..., centering=...)`` stores each sequence's first
  page plain and later keys minus their page's centre; ``tq_key_center_sums`` derives the centres'
  sums from the first pages into a buffer made by ``new_center_sums``; attention and gather-dequant
  (``ops.paged_attention``) take the same ``centering`` and sums.
- Sums kept across steps: a first page's sums change only while it fills (or when a request gets
  another first page), so a caller that keeps one sums buffer per layer across steps passes tags
  (``new_center_tags``: which first block, at which epoch, each row's sums are of) and per-block
  epochs (``new_block_epochs``: bumped by the store for every first-page token it writes). The sums
  launch then recomputes only rows whose first page changed, with the same bits. This holds as long as
  every write of first-page keys into the cache goes through a store given those epochs (a write that
  bumps nothing, e.g. a store without centering into such a block, would go unseen).
Plain-torch references: ``ops.paged_reference`` (``tq_store_ref``, ``center_sums_ref``,
``center_sums_cached_ref``).
"""

from __future__ import annotations

import math

import torch
import triton

from ..kernels.key_centering_jit import tq_key_center_sums_kernel
from ..kernels.paged_store_jit import tq_paged_store_kernel
from .key_centering import KeyCentering
from .page_layout import (
    PagedTQLayout,
    _cache_views,
    _centering_args,
    _check_centering,
    _check_kv,
    _check_sums,
    _layout_tables,
)

STORE_SEARCH_STEPS = 16  # binary-search halvings of the store's token -> request lookup
MAX_CENTERED_REQS = (1 << STORE_SEARCH_STEPS) - 1


def new_center_sums(num_reqs: int, num_kv_heads: int, centering: KeyCentering, device) -> torch.Tensor:
    """A buffer for the per-(request, KV head) sums of key centering: [num_reqs, Hkv, 2, dim_pad] fp32."""
    return torch.zeros(max(num_reqs, 1), num_kv_heads, 2, centering.dim_pad, dtype=torch.float32, device=device)


def new_center_tags(num_reqs: int, num_kv_heads: int, device) -> torch.Tensor:
    """Tags of a sums buffer kept across steps: [num_reqs, Hkv, 2] int32, row (first block, its epoch) of
    what the sums row holds; made invalid ((-1, 0): nothing holds block -1), so every row is computed once."""
    tags = torch.zeros(max(num_reqs, 1), num_kv_heads, 2, dtype=torch.int32, device=device)
    tags[..., 0] = -1
    return tags


def new_block_epochs(num_blocks: int, device) -> torch.Tensor:
    """Per-block content counters [num_blocks] int32 (zeros) that the centred store bumps for every
    first-page token it writes. One array may serve every layer whose stores write those block ids
    (a bump any of them makes only costs a recomputation elsewhere)."""
    return torch.zeros(max(num_blocks, 1), dtype=torch.int32, device=device)


def _check_center_cache(center_tags: torch.Tensor | None, block_epochs: torch.Tensor | None, num_reqs: int,
                        num_kv_heads: int, num_blocks: int) -> None:
    if (center_tags is None) != (block_epochs is None):
        raise ValueError("sums kept across steps need both center_tags and block_epochs (or neither)")
    if center_tags is None:
        return
    if (center_tags.dtype != torch.int32 or center_tags.dim() != 3 or center_tags.shape[0] < num_reqs
            or tuple(center_tags.shape[1:]) != (num_kv_heads, 2) or center_tags.stride(2) != 1):
        raise ValueError(f"center_tags must be int32 [>= {num_reqs}, {num_kv_heads}, 2] with a contiguous last dim "
                         f"(new_center_tags), got {center_tags.dtype} {tuple(center_tags.shape)}")
    if (block_epochs.dtype != torch.int32 or block_epochs.dim() != 1 or block_epochs.shape[0] < num_blocks
            or block_epochs.stride(0) != 1):
        raise ValueError(f"block_epochs must be contiguous int32 [>= {num_blocks}] (one per cache block, "
                         f"new_block_epochs), got {block_epochs.dtype} {tuple(block_epochs.shape)}")


def tq_key_center_sums(cache: torch.Tensor, layout: PagedTQLayout, centering: KeyCentering,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                       center_tags: torch.Tensor | None = None,
                       block_epochs: torch.Tensor | None = None) -> torch.Tensor:
    """Sums (U, V) [R, Hkv, 2, dim_pad] of every request's first page into ``out`` (zeros for requests
    whose first page is not full yet). One launch, no host synchronization.

    ``center_tags`` (``new_center_tags``, kept with ``out``) and ``block_epochs`` (``new_block_epochs``, bumped
    by the centred stores into ``cache``): rows whose tag names their current first block at its current
    epoch are left as they are (they hold that page's sums already); the others are computed and tagged.
    The result is the same bits as without them."""
    num_kv_heads = cache.shape[1]
    _check_centering(centering, layout)
    u8, f16 = _cache_views(cache, layout, num_kv_heads)
    _check_sums(out, block_table.shape[0], num_kv_heads, centering)
    _check_center_cache(center_tags, block_epochs, block_table.shape[0], num_kv_heads, cache.shape[0])
    _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, out, center_tags, block_epochs)
    return out


def _launch_center_sums(u8, f16, layout: PagedTQLayout, centering: KeyCentering, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, out: torch.Tensor, center_tags: torch.Tensor | None,
                        block_epochs: torch.Tensor | None, before_store: bool = False) -> None:
    """``tq_key_center_sums`` without the checks (the store has made them). ``before_store``: launched before
    the step's single tokens per request are stored (a first page counts once full before the step)."""
    num_reqs, num_kv_heads = block_table.shape[0], u8.shape[1]
    if num_reqs == 0:
        return
    kt, _ = _layout_tables(layout, u8.device)
    kc = kt.codec
    lc = layout.kernel_constexprs()
    cached = center_tags is not None
    tags, epochs = (center_tags, block_epochs) if cached else (seq_lens, seq_lens)  # placeholders: not read
    tq_key_center_sums_kernel[(num_reqs, num_kv_heads)](
        u8, f16, u8.stride(0), u8.stride(1), block_table, block_table.stride(0), seq_lens,
        kc.rot_hi, kc.rot_lo, kc.centroids[0], kc.centroids[-1], centering.pos_cos, centering.pos_sin,
        out, out.stride(0), out.stride(1), kc.rot_scale,
        tags, tags.stride(0) if cached else 0, tags.stride(1) if cached else 0, epochs,
        D_PAD=kc.dim_pad, PAGE=layout.block_size, BN=16, num_warps=4, BEFORE_STORE=int(before_store),
        CACHED=cached, **kt.constexprs("K"), K_IDX_OFF=lc["K_IDX_OFF"], K_SC_OFF=lc["K_SC_OFF"], K_ROW=lc["K_ROW"],
    )


def tq_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
             layout: PagedTQLayout, *, centering: KeyCentering | None = None,
             query_start_loc: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
             block_table: torch.Tensor | None = None, center_sums: torch.Tensor | None = None,
             center_tags: torch.Tensor | None = None, block_epochs: torch.Tensor | None = None,
             single_token_requests: bool = False):
    """Quantize K/V [T, Hkv, d] and write them into ``cache`` at ``slot_mapping`` [T] (< 0: skipped).

    One launch for K and V; no host synchronization. With ``centering`` (``ops.key_centering``) the batch
    metadata is needed too (query_start_loc [R+1], seq_lens [R] including this step's tokens,
    block_table [R, *]: the tokens' requests and positions) and three launches run: V of every token
    and K of first-page tokens; the first pages' sums into ``center_sums`` (``new_center_sums``); K of
    later tokens minus their page's centre. Returns ``center_sums`` (which attention then reads).

    ``center_tags`` and ``block_epochs`` (``tq_key_center_sums``): ``center_sums`` is kept across steps (one
    buffer per layer); the store bumps the epoch of a block for every first-page key it writes into it, and
    the sums launch recomputes only the rows whose first page changed since their tag was set.

    ``single_token_requests`` (a host fact, e.g. a decode-only batch): every request has at most one new
    token, so no request stores a later token while its first page fills; the sums are then taken first,
    from the pages of earlier steps, and K and V are stored in one launch (two instead of three). Same
    bytes; a request whose first page fills in this very step gets zero sums, which its attention (first
    page only, stored plain) does not use."""
    _check_kv(key, "key", layout)
    _check_kv(value, "value", layout)
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} shapes differ")
    num_tokens, num_kv_heads, d = key.shape
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping must be 1-D with >= {num_tokens} entries, got {tuple(slot_mapping.shape)}")
    u8, f16 = _cache_views(cache, layout, num_kv_heads)
    if centering is not None:
        _check_centering(centering, layout)
        if query_start_loc is None or seq_lens is None or block_table is None or center_sums is None:
            raise ValueError("key centering needs query_start_loc, seq_lens, block_table and center_sums")
        num_reqs = block_table.shape[0]
        if num_reqs > MAX_CENTERED_REQS:
            raise ValueError(f"key centering stores at most {MAX_CENTERED_REQS} requests per batch, got {num_reqs}")
        _check_sums(center_sums, num_reqs, num_kv_heads, centering)
        _check_center_cache(center_tags, block_epochs, num_reqs, num_kv_heads, cache.shape[0])
    if num_tokens == 0:
        return center_sums
    kt, vt = _layout_tables(layout, key.device)
    kc, vc = kt.codec, vt.codec
    klev0, kbnd0, klev1, kbnd1 = kc.encode_tables()
    vlev0, vbnd0, vlev1, vbnd1 = vc.encode_tables()
    bn = 16  # rows per program: decode batches have few tokens, so more and shorter programs

    def launch(mode: int) -> None:
        cargs, cconst = _centering_args(centering if mode else None, center_sums, f16)
        bump = block_epochs is not None and mode in (1, 3)  # the launches that store first-page keys
        grid = (triton.cdiv(num_tokens, bn), num_kv_heads, 1 if mode == 2 else 2)
        # Mode 3 holds both key passes in one program: at 4 warps that needs more than the 128 registers per
        # thread ptxas gives it (a stack frame on sm_90); 8 warps halve each thread's share of the tiles.
        tq_paged_store_kernel[grid](
            key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), slot_mapping,
            u8, f16, u8.stride(0), u8.stride(1),
            kc.rot_hi, kc.rot_lo, kc.rot_bf16, klev0, kbnd0, klev1, kbnd1,
            vc.rot_hi, vc.rot_lo, vc.rot_bf16, vlev0, vbnd0, vlev1, vbnd1,
            num_tokens, kc.rot_scale, vc.rot_scale, math.sqrt(d),
            *((query_start_loc, seq_lens, block_table.shape[0]) if mode else (f16, f16, 0)), *cargs,
            block_epochs if bump else f16,
            D=d, D_PAD=kc.dim_pad, K_FP8=layout.key_is_fp8,
            K_NC=layout.fmt.key.norm_correction, V_NC=layout.fmt.value.norm_correction,
            BN=bn, CENTER_MODE=mode, SEARCH_STEPS=STORE_SEARCH_STEPS, BUMP_EPOCHS=bump,
            num_warps=8 if mode == 3 else 4, **cconst,
            **kt.constexprs("K", layout.key_is_fp8), **vt.constexprs("V"), **layout.kernel_constexprs(),
        )

    if centering is None:
        launch(0)
        return None
    if single_token_requests:
        _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, center_sums, center_tags,
                            block_epochs, before_store=True)
        launch(3)
        return center_sums
    launch(1)
    _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, center_sums, center_tags, block_epochs)
    launch(2)
    return center_sums


__all__ = ["MAX_CENTERED_REQS", "new_block_epochs", "new_center_sums", "new_center_tags", "tq_key_center_sums",
           "tq_store"]

# SPDX-License-Identifier: Apache-2.0
"""Store into a paged TurboQuant cache (page layout: ``ops.page_layout``).

- ``tq_store(key, value, cache, slot_mapping, layout)``: fused rotate + quantize + pack of K and V
  into their pages (one launch); slots < 0 are skipped (vLLM's padding).
- Key centering (``ops.key_centering``): ``tq_store(..., centering=...)`` stores each sequence's first
  page plain and later keys minus their page's centre; ``tq_key_center_sums`` derives the centres'
  sums from the first pages into scratch made by ``new_center_sums``; attention and gather-dequant
  (``ops.paged_attention``) take the same ``centering`` and sums.
Plain-torch references: ``ops.paged_reference`` (``tq_store_ref``, ``center_sums_ref``).
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
    """Scratch for the per-(request, KV head) sums of key centering: [num_reqs, Hkv, 2, dim_pad] fp32."""
    return torch.zeros(max(num_reqs, 1), num_kv_heads, 2, centering.dim_pad, dtype=torch.float32, device=device)


def tq_key_center_sums(cache: torch.Tensor, layout: PagedTQLayout, centering: KeyCentering,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sums (U, V) [R, Hkv, 2, dim_pad] of every request's first page into ``out`` (zeros for requests
    whose first page is not full yet). One launch, no host synchronization."""
    num_kv_heads = cache.shape[1]
    _check_centering(centering, layout)
    u8, f16 = _cache_views(cache, layout, num_kv_heads)
    _check_sums(out, block_table.shape[0], num_kv_heads, centering)
    _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, out)
    return out


def _launch_center_sums(u8, f16, layout: PagedTQLayout, centering: KeyCentering, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, out: torch.Tensor, before_store: bool = False) -> None:
    """``tq_key_center_sums`` without the checks (the store has made them). ``before_store``: launched before
    the step's single tokens per request are stored (a first page counts once full before the step)."""
    num_reqs, num_kv_heads = block_table.shape[0], u8.shape[1]
    if num_reqs == 0:
        return
    kt, _ = _layout_tables(layout, u8.device)
    kc = kt.codec
    lc = layout.kernel_constexprs()
    tq_key_center_sums_kernel[(num_reqs, num_kv_heads)](
        u8, f16, u8.stride(0), u8.stride(1), block_table, block_table.stride(0), seq_lens,
        kc.rot_hi, kc.rot_lo, kc.centroids[0], kc.centroids[-1], centering.pos_cos, centering.pos_sin,
        out, out.stride(0), out.stride(1), kc.rot_scale,
        D_PAD=kc.dim_pad, PAGE=layout.block_size, BN=16, num_warps=4, BEFORE_STORE=int(before_store),
        **kt.constexprs("K"), K_IDX_OFF=lc["K_IDX_OFF"], K_SC_OFF=lc["K_SC_OFF"], K_ROW=lc["K_ROW"],
    )


def tq_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
             layout: PagedTQLayout, *, centering: KeyCentering | None = None,
             query_start_loc: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
             block_table: torch.Tensor | None = None, center_sums: torch.Tensor | None = None,
             single_token_requests: bool = False):
    """Quantize K/V [T, Hkv, d] and write them into ``cache`` at ``slot_mapping`` [T] (< 0: skipped).

    One launch for K and V; no host synchronization. With ``centering`` (``ops.key_centering``) the batch
    metadata is needed too (query_start_loc [R+1], seq_lens [R] including this step's tokens,
    block_table [R, *]: the tokens' requests and positions) and three launches run: V of every token
    and K of first-page tokens; the first pages' sums into ``center_sums`` (``new_center_sums``); K of
    later tokens minus their page's centre. Returns ``center_sums`` (which attention then reads).

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
    if num_tokens == 0:
        return center_sums
    kt, vt = _layout_tables(layout, key.device)
    kc, vc = kt.codec, vt.codec
    klev0, kbnd0, klev1, kbnd1 = kc.encode_tables()
    vlev0, vbnd0, vlev1, vbnd1 = vc.encode_tables()
    bn = 16  # rows per program: decode batches have few tokens, so more and shorter programs

    def launch(mode: int) -> None:
        cargs, cconst = _centering_args(centering if mode else None, center_sums, f16)
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
            D=d, D_PAD=kc.dim_pad, K_FP8=layout.key_is_fp8,
            K_NC=layout.fmt.key.norm_correction, V_NC=layout.fmt.value.norm_correction,
            BN=bn, CENTER_MODE=mode, SEARCH_STEPS=STORE_SEARCH_STEPS, num_warps=8 if mode == 3 else 4, **cconst,
            **kt.constexprs("K", layout.key_is_fp8), **vt.constexprs("V"), **layout.kernel_constexprs(),
        )

    if centering is None:
        launch(0)
        return None
    if single_token_requests:
        _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, center_sums, before_store=True)
        launch(3)
        return center_sums
    launch(1)
    _launch_center_sums(u8, f16, layout, centering, block_table, seq_lens, center_sums)
    launch(2)
    return center_sums


__all__ = ["MAX_CENTERED_REQS", "new_center_sums", "tq_key_center_sums", "tq_store"]

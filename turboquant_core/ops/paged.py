# SPDX-License-Identifier: Apache-2.0
"""Paged TurboQuant KV cache: page layout, store and attention launchers, and their torch references.

Cache layout (one tensor per attention layer)
---------------------------------------------
``cache``: uint8 ``[num_blocks, num_kv_heads, head_page_bytes]``; the last dim must be contiguous,
the block and head strides may be larger (a view into a bigger allocation) but must be even. One
(block, kv head) region holds ``block_size`` tokens as a structure of arrays; every section starts
on a 16-byte boundary (padding is inserted only where a section would not; none for block sizes
that are multiples of 8, so then ``head_page_bytes == block_size * fmt.bytes_per_token_per_head(d)``):

====================  ==========================================  =======================================
section               bytes                                       content per token
====================  ==========================================  =======================================
K index rows          block_size * fmt.key.index_bytes(d)         planar8 codebook indices per segment
                                                                  (exactly ``ops.codec.encode``'s bytes);
                                                                  fp8 keys: d float8 e4m3fn bytes of R_K k
V index rows          block_size * fmt.value.index_bytes(d)       planar8 codebook indices per segment
K scales              block_size * 2 (MSE keys only)              fp16 scale (norm-corrected norm)
V scales              block_size * 2                              fp16 scale
====================  ==========================================  =======================================

A token at slot ``s`` lives in block ``s // block_size``, row ``s % block_size`` of every section.
Token t of request r is at slot ``block_table[r, t // block_size] * block_size + t % block_size``.

Ops
---
- ``tq_store(key, value, cache, slot_mapping, layout)``: fused rotate + quantize + pack of K and V
  into their pages (one launch); slots < 0 are skipped (vLLM's padding).
- ``TQAttentionPlan`` (plan once per batch, ``run`` once per layer) and the functional
  ``tq_paged_attention``: attention of queries over the cached tokens, in the rotated domain, with
  GQA sharing, tensor cores and split-KV; returns out and optionally the log-sum-exp.
- ``merge_attn_states``: combine two partial attentions (out, lse), e.g. cached context + fresh chunk.
- ``tq_gather_dequant``: cached tokens -> dense bf16/fp16 K, V (a fallback path and a test aid).
- Key centering (``ops.key_centering``): ``tq_store(..., centering=...)`` stores each sequence's first
  page plain and later keys minus their page's centre; ``tq_key_center_sums`` derives the centres'
  sums from the first pages; attention and gather-dequant take the same ``centering`` and sums.
Each has a plain-torch ``*_ref`` here.

Which path to use (H200, Qwen3-8B heads, see benchmarks/bench_paged_attention.py)
--------------------------------------------------------------------------------
- Decode and speculative verification (few queries per request): ``TQAttentionPlan`` with
  ``causal=True``. It reads the compressed pages once per GQA group; it is bound by dequantization
  instructions, not by memory (0.38 to 0.58 ms for 32 x 8448 tokens x 8 KV heads depending on the
  format, where torch SDPA over bf16 takes 0.26 ms).
- Context part of a long prefill chunk (hundreds of queries per request): ``tq_gather_dequant`` into a
  bounded bf16 workspace, then FlashAttention with lse and ``merge_attn_states``. The paged kernel
  also serves it (``causal=False``), but re-dequantizes the context once per query block (about 6x
  slower than gather + SDPA for 512-query chunks over 8k tokens); use it for short chunks only.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from ..formats import KVFormat, get_format
from ..kernels.key_centering_jit import tq_key_center_sums_kernel
from ..kernels.paged_attention_jit import (
    tq_merge_splits_kernel,
    tq_paged_attention_kernel,
    tq_paged_gather_dequant_kernel,
)
from ..kernels.paged_store_jit import tq_paged_store_kernel
from ..quantizer import FP8_MAX, FP8Quantizer
from ..rotation import check_head_dim
from .codec import decode_ref, encode_ref, permute_lookup_applies
from .key_centering import (
    KeyCentering,
    center_sums_from_keys_ref,
    center_vectors_ref,
    request_positions,
    token_centers_ref,
)
from .rotation_tables import CodecTables, codec_tables, kernel_coordinate_order, kernel_order_rotation

PAGE_SECTION_ALIGN = 16
# Head dims the attention kernel serves: d_pad = next power of two must fit the register tiles.
ATTENTION_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
LN2 = math.log(2.0)


def _align(n: int, a: int = PAGE_SECTION_ALIGN) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagedTQLayout:
    """Byte layout of one (block, kv head) region of a paged TurboQuant cache.

    Offsets are bytes from the start of the region; ``k_scale_offset`` is -1 for fp8 keys.

    >>> lay = paged_layout("turboquant_k3v4_nc", head_dim=128, block_size=16)
    >>> lay.head_page_bytes == 16 * lay.fmt.bytes_per_token_per_head(128)
    True
    """

    fmt: KVFormat
    head_dim: int
    block_size: int
    k_index_bytes: int  # per token
    v_index_bytes: int  # per token
    k_index_offset: int
    v_index_offset: int
    k_scale_offset: int
    v_scale_offset: int
    head_page_bytes: int

    @property
    def key_is_fp8(self) -> bool:
        return self.fmt.key.kind == "fp8"

    def sections(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes) per section, in page order."""
        bs = self.block_size
        out = [("k_index", self.k_index_offset, bs * self.k_index_bytes),
               ("v_index", self.v_index_offset, bs * self.v_index_bytes)]
        if self.k_scale_offset >= 0:
            out.append(("k_scale", self.k_scale_offset, 2 * bs))
        out.append(("v_scale", self.v_scale_offset, 2 * bs))
        return out

    def padding_bytes(self) -> int:
        return self.head_page_bytes - self.block_size * self.fmt.bytes_per_token_per_head(self.head_dim)

    def kernel_constexprs(self) -> dict:
        return dict(
            PAGE=self.block_size,
            K_IDX_OFF=self.k_index_offset, V_IDX_OFF=self.v_index_offset,
            K_SC_OFF=max(self.k_scale_offset, 0), V_SC_OFF=self.v_scale_offset,
            K_ROW=self.k_index_bytes, V_ROW=self.v_index_bytes,
        )


def _resolve_format(fmt: str | KVFormat) -> KVFormat:
    return fmt if isinstance(fmt, KVFormat) else get_format(fmt)


@functools.lru_cache(maxsize=256)
def _layout_cached(fmt: KVFormat, head_dim: int, block_size: int) -> PagedTQLayout:
    check_head_dim(head_dim)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if fmt.key.kind not in ("mse", "fp8"):
        raise ValueError(f"{fmt.name}: key kind must be 'mse' or 'fp8', got {fmt.key.kind!r}")
    if fmt.value.kind != "mse":
        raise ValueError(f"{fmt.name}: paged kernels need MSE (codebook) values, got {fmt.value.kind!r}")
    kb, vb = fmt.key.index_bytes(head_dim), fmt.value.index_bytes(head_dim)
    off = 0
    k_idx = off
    off = _align(off + block_size * kb)
    v_idx = off
    off = _align(off + block_size * vb)
    k_sc = -1
    if fmt.key.kind == "mse":
        k_sc = off
        off = _align(off + 2 * block_size)
    v_sc = off
    off = _align(off + 2 * block_size)
    return PagedTQLayout(fmt, head_dim, block_size, kb, vb, k_idx, v_idx, k_sc, v_sc, off)


def paged_layout(fmt: str | KVFormat, head_dim: int, block_size: int) -> PagedTQLayout:
    """The page layout of format ``fmt`` (a name from ``formats.KV_FORMATS`` or a ``KVFormat``)."""
    return _layout_cached(_resolve_format(fmt), head_dim, block_size)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   fmt_name: str) -> tuple[int, int, int]:
    """Shape of the uint8 cache tensor of one layer: (num_blocks, num_kv_heads, head_page_bytes)."""
    return (num_blocks, num_kv_heads, paged_layout(fmt_name, head_dim, block_size).head_page_bytes)


def page_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, fmt_name: str) -> int:
    """Bytes one block of ``block_size`` tokens takes in one layer (all kv heads)."""
    return num_kv_heads * paged_layout(fmt_name, head_dim, block_size).head_page_bytes


def allocate_kv_cache(num_blocks: int, num_kv_heads: int, layout: PagedTQLayout, device="cpu") -> torch.Tensor:
    """A zeroed cache tensor for ``layout``."""
    return torch.zeros(num_blocks, num_kv_heads, layout.head_page_bytes, dtype=torch.uint8, device=device)


def _cache_views(cache: torch.Tensor, layout: PagedTQLayout, num_kv_heads: int):
    if cache.dtype != torch.uint8 or cache.dim() != 3:
        raise ValueError(f"cache must be uint8 [num_blocks, num_kv_heads, head_page_bytes], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if cache.shape[1] != num_kv_heads or cache.shape[2] != layout.head_page_bytes:
        raise ValueError(f"cache shape {tuple(cache.shape)} does not match layout: expected "
                         f"[*, {num_kv_heads}, {layout.head_page_bytes}]")
    if cache.stride(2) != 1 or cache.stride(0) % 2 or cache.stride(1) % 2 or cache.storage_offset() % 2:
        raise ValueError(f"cache needs a contiguous last dim and even strides/offset, got strides "
                         f"{cache.stride()} offset {cache.storage_offset()}")
    return cache, cache.view(torch.float16)


# ----------------------------------------------------------------------------------------------
# Device tables
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ComponentTables:
    """Per component (K or V): the codec tables (store / gather-dequant kernels, natural padded order)
    and the attention kernel's tables (rotation rows in kernel order, fp16 codebooks)."""

    codec: CodecTables  # fp8 keys: a single-segment table whose rows only are used
    attn_rot_hi: torch.Tensor  # [rows, dim_pad] fp16, kernel order
    attn_rot_lo: torch.Tensor
    cent_f16: tuple[torch.Tensor, torch.Tensor]  # codebooks of segment 0 / 1 as fp16 (tensor-core operands)
    pairs_f16: tuple[torch.Tensor, torch.Tensor]  # [2**(2b), 2] fp16: entry a | b << b holds (c[a], c[b])

    def constexprs(self, prefix: str, fp8: bool = False) -> dict:
        s = self.codec.segments
        s1 = s[1] if len(s) > 1 else None
        out = {f"{prefix}G0": s[0].groups, f"{prefix}GP0": s[0].groups_pad, f"{prefix}B0": s[0].bits,
               f"{prefix}G1": s1.groups if s1 else 0, f"{prefix}GP1": s1.groups_pad if s1 else 1,
               f"{prefix}B1": s1.bits if s1 else 1, f"{prefix}_EXACT": self.codec.exact_rot}
        if fp8:
            out[f"{prefix}B0"] = 8
        return out


attention_coordinate_order = kernel_coordinate_order  # the attention kernel's tile order


@functools.lru_cache(maxsize=128)
def _component_tables(head_dim: int, kind: str, bits: float, seed: int, device: str) -> _ComponentTables:
    # fp8 keys reuse the single-segment rotation table of a 4-bit codec: only its rows are used.
    t = codec_tables(head_dim, 4 if kind == "fp8" else bits, seed, device)
    hi, lo = kernel_order_rotation(head_dim, 4 if kind == "fp8" else bits, seed, device, fp8=kind == "fp8")
    c = t.segment_tables()
    cents = (c[0].half().contiguous(), c[2].half().contiguous())
    pairs = tuple(_pair_table(x) for x in cents)
    return _ComponentTables(t, hi, lo, cents, pairs)


def _decode_operands(tables: _ComponentTables, permute: bool) -> tuple:
    """(rot_hi, rot_lo, codebook 0, codebook 1) for ``_mse_decode_rows``: kernel-order rows and fp16
    codebooks with ``permute``, else the codec's rows and fp32 codebooks."""
    if permute:
        return tables.attn_rot_hi, tables.attn_rot_lo, tables.cent_f16[0], tables.cent_f16[1]
    c = tables.codec
    return c.rot_hi, c.rot_lo, c.centroids[0], c.centroids[-1]


def _pair_table(cent: torch.Tensor) -> torch.Tensor:
    """[2**(2b), 2] fp16: row a | (b << bits) = (cent[a], cent[b])."""
    n = cent.numel()
    e = torch.arange(n * n, device=cent.device)
    return torch.stack((cent[e % n], cent[e // n]), dim=1).contiguous()


def _layout_tables(layout: PagedTQLayout, device) -> tuple[_ComponentTables, _ComponentTables]:
    f, d, dev = layout.fmt, layout.head_dim, str(torch.device(device))
    return (_component_tables(d, f.key.kind, f.key.bits, f.key_seed, dev),
            _component_tables(d, f.value.kind, f.value.bits, f.value_seed, dev))


# ----------------------------------------------------------------------------------------------
# Store
# ----------------------------------------------------------------------------------------------


def _check_kv(x: torch.Tensor, name: str, layout: PagedTQLayout) -> None:
    if x.dim() != 3 or x.shape[-1] != layout.head_dim:
        raise ValueError(f"{name} must be [num_tokens, num_kv_heads, {layout.head_dim}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


STORE_SEARCH_STEPS = 16  # binary-search halvings of the store's token -> request lookup
MAX_CENTERED_REQS = (1 << STORE_SEARCH_STEPS) - 1


def _check_centering(centering: KeyCentering, layout: PagedTQLayout) -> None:
    if layout.key_is_fp8:
        raise ValueError(f"key centering serves MSE keys; {layout.fmt.name} stores fp8 keys")
    if centering.page != layout.block_size or centering.head_dim != layout.head_dim:
        raise ValueError(f"key centering tables for page {centering.page} / head_dim {centering.head_dim} do not "
                         f"match the layout's block size {layout.block_size} / head_dim {layout.head_dim}")


def new_center_sums(num_reqs: int, num_kv_heads: int, centering: KeyCentering, device) -> torch.Tensor:
    """Scratch for the per-(request, KV head) sums of key centering: [num_reqs, Hkv, 2, dim_pad] fp32."""
    return torch.zeros(max(num_reqs, 1), num_kv_heads, 2, centering.dim_pad, dtype=torch.float32, device=device)


def _check_sums(center_sums: torch.Tensor, num_reqs: int, num_kv_heads: int, centering: KeyCentering) -> None:
    want = (num_kv_heads, 2, centering.dim_pad)
    if (center_sums.dtype != torch.float32 or center_sums.dim() != 4 or tuple(center_sums.shape[1:]) != want
            or center_sums.shape[0] < num_reqs or center_sums.stride(3) != 1
            or center_sums.stride(2) != centering.dim_pad):
        raise ValueError(f"center_sums must be float32 [>= {num_reqs}, {want[0]}, 2, {want[2]}] with contiguous "
                         f"last two dims (new_center_sums), got {center_sums.dtype} {tuple(center_sums.shape)}")


def _centering_args(centering: KeyCentering | None, center_sums: torch.Tensor | None, placeholder: torch.Tensor,
                    fp16_tables: bool = False) -> tuple[tuple, dict]:
    """The kernels' centering arguments (SUMS, its request and head strides, page tables, page count) and
    constexprs; unused placeholders without centering."""
    if centering is None:
        return (placeholder, 0, 0, placeholder, placeholder, 1), dict(ROT_HALF=0, NEOX=True)
    c = centering
    tables = (c.page_cos16, c.page_sin16) if fp16_tables else (c.page_cos, c.page_sin)
    return ((center_sums, center_sums.stride(0), center_sums.stride(1), *tables, c.num_pages),
            dict(ROT_HALF=c.rot_half, NEOX=c.neox))


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
    bn = 32 if kc.dim_pad <= 128 else 16
    grid = (triton.cdiv(num_tokens, bn), num_kv_heads)

    def launch(mode: int) -> None:
        cargs, cconst = _centering_args(centering if mode else None, center_sums, f16)
        tq_paged_store_kernel[grid](
            key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), slot_mapping,
            u8, f16, u8.stride(0), u8.stride(1),
            kc.rot_hi, kc.rot_lo, kc.rot_bf16, klev0, kbnd0, klev1, kbnd1,
            vc.rot_hi, vc.rot_lo, vc.rot_bf16, vlev0, vbnd0, vlev1, vbnd1,
            num_tokens, kc.rot_scale, vc.rot_scale, math.sqrt(d),
            *((query_start_loc, seq_lens, block_table.shape[0]) if mode else (f16, f16, 0)), *cargs,
            D=d, D_PAD=kc.dim_pad, K_FP8=layout.key_is_fp8,
            K_NC=layout.fmt.key.norm_correction, V_NC=layout.fmt.value.norm_correction,
            BN=bn, CENTER_MODE=mode, SEARCH_STEPS=STORE_SEARCH_STEPS, num_warps=4, **cconst,
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


def _encode_tokens_ref(key: torch.Tensor, value: torch.Tensor, layout: PagedTQLayout):
    """Reference encodings: (k_idx [.., KB] u8, k_scale fp16 or None, v_idx, v_scale)."""
    f, d = layout.fmt, layout.head_dim
    if layout.key_is_fp8:
        k_idx, k_scale = FP8Quantizer(d, f.key_seed).quantize(key), None
    else:
        k_idx, k_scale = encode_ref(key.float(), f.key.bits, f.key_seed, f.key.norm_correction)
    v_idx, v_scale = encode_ref(value.float(), f.value.bits, f.value_seed, f.value.norm_correction)
    return k_idx, k_scale, v_idx, v_scale


def _section(cache: torch.Tensor, layout: PagedTQLayout, name: str) -> torch.Tensor:
    """View of one section of every region: [num_blocks, Hkv, block_size, bytes per token]."""
    off, size = {n: (o, s) for n, o, s in layout.sections()}[name]
    sec = cache[:, :, off : off + size]
    return sec.unflatten(2, (layout.block_size, size // layout.block_size))


def tq_store_ref(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 layout: PagedTQLayout, *, centering: KeyCentering | None = None,
                 query_start_loc: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, center_sums: torch.Tensor | None = None):
    """Plain-torch reference of ``tq_store`` (quantizers + packing, indexed writes), same arguments.
    With centering and no ``center_sums``, the sums come from ``center_sums_ref`` after the first pass;
    given ones (e.g. the kernel's) are used as they are. Returns the sums used (or None)."""
    _check_kv(key, "key", layout)
    _cache_views(cache, layout, key.shape[1])
    n = key.shape[0]
    keep = slot_mapping[:n] >= 0
    if centering is None:
        _store_tokens_ref(key, value, cache, slot_mapping[:n], keep, keep, layout)
        return None
    _check_centering(centering, layout)
    pos = request_positions(query_start_loc, seq_lens, n)
    req = torch.searchsorted(query_start_loc.long()[1:], torch.arange(n, device=key.device), right=True)
    req = req.clamp_max(block_table.shape[0] - 1)
    first = keep & (pos >= 0) & (pos < layout.block_size)
    _store_tokens_ref(key, value, cache, slot_mapping[:n], first, keep, layout)
    if center_sums is None:
        center_sums = center_sums_ref(cache, layout, centering, block_table, seq_lens)
    later = keep & (pos >= layout.block_size)
    mu, mup = center_vectors_ref(center_sums[req], centering)
    centred = (key.double() - token_centers_ref(mu, mup, pos.clamp_min(0), centering)).float()
    _store_tokens_ref(centred, value, cache, slot_mapping[:n], later, torch.zeros_like(keep), layout)
    return center_sums


def _store_tokens_ref(key, value, cache, slots, k_keep, v_keep, layout: PagedTQLayout) -> None:
    """Encode and write the keys of tokens ``k_keep`` and the values of tokens ``v_keep`` [T] bool."""
    k_idx, k_scale, v_idx, v_scale = _encode_tokens_ref(key, value, layout)
    for keep, parts in ((k_keep, (("k_index", k_idx), ("k_scale", k_scale))),
                        (v_keep, (("v_index", v_idx), ("v_scale", v_scale)))):
        sl = slots[keep].long()
        blk, off = sl // layout.block_size, sl % layout.block_size
        for name, data in parts:
            if data is None:
                continue
            data = data[keep]
            if name.endswith("scale"):
                data = data.view(torch.uint8).view(*data.shape, 2)
            _section(cache, layout, name)[blk, :, off] = data


def center_sums_ref(cache: torch.Tensor, layout: PagedTQLayout, centering: KeyCentering,
                    block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Reference of ``tq_key_center_sums``: [R, Hkv, 2, dim_pad] float32 from the decoded first pages."""
    out = torch.zeros(block_table.shape[0], cache.shape[1], 2, centering.dim_pad, dtype=torch.float64,
                      device=cache.device)
    for r, n in enumerate(seq_lens.tolist()[: block_table.shape[0]]):
        if n >= layout.block_size:
            k, _ = dequant_cached_ref(cache, layout, block_table[r], layout.block_size)
            out[r] = center_sums_from_keys_ref(k.transpose(0, 1), centering)
    return out.float()


def read_slots(cache: torch.Tensor, layout: PagedTQLayout, slots: torch.Tensor):
    """Raw stored data at ``slots`` [n]: (k_idx [n, Hkv, KB] uint8, k_scale fp16 [n, Hkv] or None,
    v_idx [n, Hkv, VB] uint8, v_scale fp16 [n, Hkv])."""
    slots = slots.long()
    blk, off = slots // layout.block_size, slots % layout.block_size

    def scale(name):
        return _section(cache, layout, name)[blk, :, off].contiguous().view(torch.float16)[..., 0]

    k_idx = _section(cache, layout, "k_index")[blk, :, off]
    v_idx = _section(cache, layout, "v_index")[blk, :, off]
    k_scale = None if layout.key_is_fp8 else scale("k_scale")
    return k_idx, k_scale, v_idx, scale("v_scale")


def read_cached_tokens(cache: torch.Tensor, layout: PagedTQLayout, block_table_row: torch.Tensor, n: int):
    """``read_slots`` for tokens 0..n-1 of one request (its block table row)."""
    t = torch.arange(n, device=cache.device)
    return read_slots(cache, layout, block_table_row.long()[t // layout.block_size] * layout.block_size
                      + t % layout.block_size)


def dequant_cached_ref(cache: torch.Tensor, layout: PagedTQLayout, block_table_row: torch.Tensor, n: int, *,
                       centering: KeyCentering | None = None, center_sums_row: torch.Tensor | None = None):
    """Tokens 0..n-1 of one request dequantized by the references: K, V [n, Hkv, d] float32.
    With ``centering``, keys get their page's centre back (sums [Hkv, 2, dim_pad] of the request)."""
    f, d = layout.fmt, layout.head_dim
    k_idx, k_scale, v_idx, v_scale = read_cached_tokens(cache, layout, block_table_row, n)
    if layout.key_is_fp8:
        k = FP8Quantizer(d, f.key_seed).dequantize(k_idx.contiguous())
    else:
        k = decode_ref(k_idx, k_scale, d, f.key.bits, f.key_seed)
    v = decode_ref(v_idx, v_scale, d, f.value.bits, f.value_seed)
    k = k.double()
    if centering is not None:
        mu, mup = center_vectors_ref(center_sums_row, centering)  # [Hkv, dim_pad]
        t = torch.arange(n, device=cache.device)
        k = k + token_centers_ref(mu.expand(n, *mu.shape), mup.expand(n, *mup.shape), t, centering)
    return k.float(), v.float()


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TQAttentionConfig:
    """Fixed kernel configuration (no autotuning: nothing here depends on the batch size, so CUDA-graph
    capture at many batch sizes compiles one variant per (format, head_dim, mode), not per size).

    Zeros mean "chosen by ``plan``"; the choices come from an H200 sweep (64 x 1280, 32 x 8448 and
    8 x 32768 decode, Qwen3-8B heads): decode-sized blocks (block_m 16, d <= 128) use 128-token tiles,
    4 warps and a 128-register cap (occupancy over spills); larger blocks use 64-token tiles, no cap."""

    block_n: int = 0  # cached tokens per tile (0: 128 for decode-sized blocks, 64 otherwise, 32 for d > 128)
    num_warps: int = 0  # 0: 4 (8 for block_m 128)
    num_stages: int = 2
    block_m: int = 0  # 0: chosen from GQA group size x queries per request (16 for decode)
    q_hilo: bool = False  # True: rotated query as an fp16 hi + lo pair, fp32-level scores (~7% slower); fp16
    # alone already keeps 3 more mantissa bits than the bf16 query it comes from, far below the key error
    asm_lookup: bool = True  # codebook lookup as an elementwise PTX load (GPU only; ignored when interpreting)
    pair_bits: int = 4  # segments of at most this many bits look up two indices per load (table 2**(2b) x 4 B)
    # 2- to 4-bit codebooks looked up in registers with byte permutes (GPU only; with asm_lookup): no L1 load
    # per value. Off: the L1 loads above.
    permute_lookup: bool = True
    maxnreg: int = 0  # register cap per thread, GPU only (0: 128 for decode-sized blocks, else none)


def default_attention_config(head_dim: int) -> TQAttentionConfig:
    """The configuration used when none is given (its zeros are resolved per batch by ``plan``)."""
    return TQAttentionConfig()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MIN_TOKENS_PER_SPLIT = 256
DEFAULT_WORKSPACE_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def _sm_count(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 132  # H100/H200: keeps the CPU interpreter exercising the same split decisions


class TQAttentionPlan:
    """Paged attention over a TurboQuant cache: ``plan`` once per batch, ``run`` once per layer.

    Construction allocates the split-KV workspace (``workspace_bytes``). ``plan`` takes the batch
    metadata tensors (device, read only inside the kernels) plus host ints that bound them, and fixes
    every launch parameter, so ``run`` makes no host synchronization and can be captured in a CUDA
    graph (keep the metadata tensors' storage alive and update them in place between replays).

    >>> plan = TQAttentionPlan(layout, num_q_heads=32, num_kv_heads=8, device="cuda")   # doctest: +SKIP
    >>> plan.plan(block_table, query_start_loc, seq_lens, num_tokens=64, max_query_len=1,
    ...           max_seq_len=8192)                                                       # doctest: +SKIP
    >>> out = plan.run(q, cache)                                                          # doctest: +SKIP
    """

    def __init__(self, layout: PagedTQLayout, num_q_heads: int, num_kv_heads: int, device, *,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, max_num_splits: int = 64,
                 config: TQAttentionConfig | None = None):
        if layout.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"paged attention supports head_dim in {ATTENTION_HEAD_DIMS}, got {layout.head_dim}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.layout, self.num_q_heads, self.num_kv_heads = layout, num_q_heads, num_kv_heads
        self.group = num_q_heads // num_kv_heads
        if self.group > 128:
            raise ValueError(f"GQA group size {self.group} > 128 is not supported")
        self.device = torch.device(device)
        self.config = config or default_attention_config(layout.head_dim)
        self.max_num_splits = max_num_splits
        self.workspace = torch.empty(max(workspace_bytes // 4, 1), dtype=torch.float32, device=self.device)
        self.k_tables, self.v_tables = _layout_tables(layout, self.device)
        # Triton 3.6 cannot build a 64-row block whose segment products are 32 wide (two-segment
        # formats at head_dim 64: its dot-operand pass fails, and the inline-PTX variant compiles
        # into illegal addresses on an H100); such formats use blocks of at most 32 rows.
        cx = {**self.k_tables.constexprs("K", layout.key_is_fp8), **self.v_tables.constexprs("V")}
        widths = [8 * cx[f"{c}GP{s}"] for c in "KV" for s in "01" if cx[f"{c}G{s}"] > 0]
        self.max_auto_block_m = 32 if min(widths) < 64 else 64
        self._planned = False

    def plan(self, block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
             num_tokens: int, max_query_len: int, max_seq_len: int, causal: bool = True,
             sliding_window: int | None = None, softmax_scale: float | None = None,
             num_splits: int | None = None) -> TQAttentionPlan:
        """Fix the launch for one batch.

        block_table [R, max_blocks] int32; query_start_loc [R+1] int32 (cumulative query counts);
        seq_lens [R] int32: cached tokens request r's queries may see. ``causal``: the queries are
        the last tokens of the cached sequence (decode, speculative verification); otherwise they
        follow the cached context (context part of a chunked prefill / prefix hit). ``num_tokens``,
        ``max_query_len`` and ``max_seq_len`` are host ints bounding the batch (upper bounds are
        fine; CUDA-graph capture plans with the graph's sizes)."""
        if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(1) != 1:
            raise ValueError("block_table must be int32 [num_reqs, max_blocks] with a contiguous last dim")
        num_reqs = block_table.shape[0]
        if query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
            raise ValueError(f"query_start_loc needs {num_reqs + 1} entries and seq_lens {num_reqs}")
        if query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("query_start_loc and seq_lens must be int32")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
        d, g = self.layout.head_dim, self.group
        cfg = self.config
        max_query_len = max(int(max_query_len), 1)
        g_pad = triton.next_power_of_2(g)  # rows per query in a block (see the kernel's docstring)
        block_m = cfg.block_m or min(max(16, triton.next_power_of_2(g_pad * max_query_len)),
                                     self.max_auto_block_m)
        block_m = max(block_m, g_pad, 16)
        if block_m & (block_m - 1):
            raise ValueError(f"block_m must be a power of two, got {cfg.block_m}")
        qpb = block_m // g_pad
        one_qblock = max_query_len <= qpb
        est_qblocks = num_reqs if one_qblock else num_reqs + num_tokens // qpb
        if num_splits is None:
            span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len)
            target = 4 * _sm_count(str(self.device))
            num_splits = min(triton.cdiv(target, max(est_qblocks * self.num_kv_heads, 1)),
                             max(span // MIN_TOKENS_PER_SPLIT, 1), self.max_num_splits)
        per_split = max(num_tokens, 1) * self.num_q_heads * (d + 1)
        num_splits = max(1, min(int(num_splits), self.workspace.numel() // per_split))
        self.block_table, self.query_start_loc, self.seq_lens = block_table, query_start_loc, seq_lens
        self.num_reqs, self.num_tokens, self.max_query_len = num_reqs, num_tokens, max_query_len
        self.causal, self.sliding_window = causal, sliding_window
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.block_m, self.qpb, self.one_qblock, self.num_splits = block_m, qpb, one_qblock, num_splits
        decode_sized = block_m == 16 and d <= 128
        self.block_n = cfg.block_n or (128 if decode_sized else 64 if d <= 128 else 32)
        self.num_warps = cfg.num_warps or (4 if block_m <= 64 else 8)
        self.maxnreg = cfg.maxnreg or (128 if decode_sized else 0)
        self._planned = True
        return self

    def run(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False, lse: torch.Tensor | None = None, *,
            centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None):
        """q [Tq, Hq, d] (fp16/bf16, contiguous last dim) -> out [Tq, Hq, d] (and lse [Hq, Tq] fp32,
        natural log, -inf for rows that see no token). Rows of tokens outside query_start_loc's
        range are left unspecified. A cache stored with key centering is read with the same
        ``centering`` and the ``center_sums`` of the planned requests (row r: block_table row r)."""
        if not self._planned:
            raise RuntimeError("call plan() before run()")
        lay, d = self.layout, self.layout.head_dim
        if centering is not None:
            _check_centering(centering, lay)
            if center_sums is None:
                raise ValueError("key centering needs the center_sums that the store wrote")
            _check_sums(center_sums, self.num_reqs, self.num_kv_heads, centering)
        if q.dim() != 3 or q.shape[1] != self.num_q_heads or q.shape[2] != d or q.stride(-1) != 1:
            raise ValueError(f"q must be [Tq, {self.num_q_heads}, {d}] with a contiguous last dim, "
                             f"got {tuple(q.shape)}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
        tq = q.shape[0]
        if tq > max(self.num_tokens, 1) and self.num_splits > 1:
            raise ValueError(f"q has {tq} tokens but the plan was made for num_tokens={self.num_tokens}")
        u8, f16 = _cache_views(cache, lay, self.num_kv_heads)
        if out is None:
            out = torch.empty_like(q)
        if out.shape != q.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim")
        write_lse = return_lse or lse is not None
        if write_lse and lse is None:
            lse = torch.empty(self.num_q_heads, tq, dtype=torch.float32, device=q.device)
        if write_lse and (lse.shape != (self.num_q_heads, tq) or lse.stride(1) != 1):
            raise ValueError(f"lse must be float32 [{self.num_q_heads}, {tq}] with a contiguous last dim")
        lse_arg = lse if write_lse else out
        if tq == 0 or self.num_reqs == 0:
            return (out, lse) if return_lse else out
        s = self.num_splits
        if s > 1:
            n_o = s * tq * self.num_q_heads * d
            part_o = self.workspace[:n_o].view(s, tq, self.num_q_heads, d)
            part_l = self.workspace[n_o : n_o + s * tq * self.num_q_heads].view(s, tq, self.num_q_heads)
        else:
            part_o = part_l = self.workspace[:1].view(1, 1, 1, 1)
        kt, vt = self.k_tables, self.v_tables
        qblocks = self.num_reqs if self.one_qblock else self.num_reqs + tq // self.qpb
        cfg = self.config
        grid = (qblocks, self.num_kv_heads, s)
        cargs, cconst = _centering_args(centering, center_sums, f16, fp16_tables=True)
        self.last_compiled = tq_paged_attention_kernel[grid](
            q, q.stride(0), q.stride(1),
            u8, f16, u8.stride(0), u8.stride(1),
            self.block_table, self.block_table.stride(0), self.query_start_loc, self.seq_lens,
            kt.attn_rot_hi, kt.attn_rot_lo, kt.cent_f16[0], kt.cent_f16[1],
            vt.attn_rot_hi, vt.attn_rot_lo, vt.cent_f16[0], vt.cent_f16[1],
            kt.pairs_f16[0], kt.pairs_f16[1], vt.pairs_f16[0], vt.pairs_f16[1], 2, 4,
            out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0),
            part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
            self.num_reqs, s, self.softmax_scale * kt.codec.rot_scale / LN2, vt.codec.rot_scale,
            self.sliding_window or 0,
            *cargs, self.softmax_scale / LN2,
            D=d, D_PAD=kt.codec.dim_pad, GQ=self.group, GQ_PAD=self.block_m // self.qpb, QPB=self.qpb,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            K_FP8=lay.key_is_fp8, SPLIT=s > 1, ONE_QBLOCK=self.one_qblock, CAUSAL=self.causal,
            HAS_WINDOW=self.sliding_window is not None, WRITE_LSE=write_lse, WHILE_LOOP=_interpreting(),
            Q_HILO=cfg.q_hilo, ASM_LOOKUP=cfg.asm_lookup and not _interpreting(), PAIR_BITS=cfg.pair_bits,
            PERMUTE_LOOKUP=cfg.asm_lookup and cfg.permute_lookup and not _interpreting(),
            CENTER=centering is not None, **cconst, num_warps=self.num_warps, num_stages=cfg.num_stages,
            **({"maxnreg": self.maxnreg} if self.maxnreg and not _interpreting() else {}),
            **kt.constexprs("K", lay.key_is_fp8), **vt.constexprs("V"), **lay.kernel_constexprs(),
        )
        if s > 1:
            tq_merge_splits_kernel[(tq, self.num_q_heads)](
                part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0),
                part_l.stride(1), out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0), s,
                S_PAD=triton.next_power_of_2(self.max_num_splits), D=d, D_PAD=kt.codec.dim_pad, WRITE_LSE=write_lse,
                num_warps=4 if d <= 128 else 8,
            )
        return (out, lse) if return_lse else out


def warmup_kernels(cache: torch.Tensor, layout: PagedTQLayout, num_q_heads: int, num_kv_heads: int, *,
                   dtype: torch.dtype = torch.bfloat16, sliding_window: int | None = None,
                   softmax_scale: float | None = None, paths: tuple[str, ...] = ("decode", "context"),
                   block_id: int = 0, config: TQAttentionConfig | None = None,
                   centering: KeyCentering | None = None) -> list[dict]:
    """Launch every kernel variant a serving engine reaches once, so Triton compiles them at start-up
    and not inside the first requests. Returns the launches made (their plan parameters).

    Variants follow from ``TQAttentionPlan.plan``: the store; for "decode" (one query per request,
    causal, no lse) split and unsplit; for "context" (queries after cached context, with lse: chunked
    prefill, prefix hits) every (query block size, one-block) shape the query length can select,
    split and unsplit; the split merge with and without lse. Batch sizes and sequence lengths are
    run-time arguments, so these cover every batch. Writes one block (``block_id``; vLLM's block 0 is
    its never-read null block) of ``cache`` and reads only it: call before serving. With ``centering``
    the centred variants (the store's two passes and its single pass for single-token batches, both sums
    launches, centred attention) are compiled instead."""
    dev = cache.device
    d, bs = layout.head_dim, layout.block_size
    if not 0 <= block_id < cache.shape[0]:
        raise ValueError(f"block_id {block_id} outside the cache's {cache.shape[0]} blocks")
    zeros = torch.zeros(bs, num_kv_heads, d, dtype=dtype, device=dev)
    block_table = torch.full((1, 1), block_id, dtype=torch.int32, device=dev)
    seq_lens = torch.full((1,), bs, dtype=torch.int32, device=dev)
    sums = None
    if centering is not None:
        sums = new_center_sums(1, num_kv_heads, centering, dev)
        tq_store(zeros, zeros, cache, torch.arange(bs, device=dev) + block_id * bs, layout, centering=centering,
                 query_start_loc=torch.tensor([0, bs], dtype=torch.int32, device=dev), seq_lens=seq_lens,
                 block_table=block_table, center_sums=sums)
        # decode-only batches: sums first, then K and V in one pass (the block's last slot again)
        tq_store(zeros[:1], zeros[:1], cache, torch.full((1,), (block_id + 1) * bs - 1, device=dev), layout,
                 centering=centering, query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
                 seq_lens=seq_lens, block_table=block_table, center_sums=sums, single_token_requests=True)
    else:
        tq_store(zeros, zeros, cache, torch.arange(bs, device=dev) + block_id * bs, layout)
    launches = [dict(kernel="store")]
    plan = TQAttentionPlan(layout, num_q_heads, num_kv_heads, dev, workspace_bytes=2 * (d + 1) * 4 * num_q_heads * 160,
                           config=config)
    shapes: dict[tuple[int, bool], int] = {}
    if "context" in paths:
        # The first query length of every (block_m, one_qblock) the planner can choose.
        scan_qsl = seq_lens.new_tensor([0, 1])  # contents are not read while planning
        for qlen in range(1, 2 * 128 + 2):
            plan.plan(block_table, scan_qsl, seq_lens, num_tokens=qlen, max_query_len=qlen, max_seq_len=bs,
                      causal=False)
            shapes.setdefault((plan.block_m, plan.one_qblock), qlen)
    runs = [("decode", 1, True)] if "decode" in paths else []
    runs += [("context", qlen, False) for qlen in sorted(shapes.values())]
    for path, qlen, causal in runs:
        q = torch.zeros(qlen, num_q_heads, d, dtype=dtype, device=dev)
        for splits in (1, 2):
            plan.plan(block_table, seq_lens.new_tensor([0, qlen]), seq_lens, num_tokens=qlen, max_query_len=qlen,
                      max_seq_len=bs, causal=causal, sliding_window=sliding_window, softmax_scale=softmax_scale,
                      num_splits=splits)
            plan.run(q, cache, return_lse=not causal, centering=centering, center_sums=sums)
            launches.append(dict(kernel=path, query_len=qlen, block_m=plan.block_m, one_qblock=plan.one_qblock,
                                 num_splits=plan.num_splits))
    return launches


def tq_paged_attention(q: torch.Tensor, cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, max_query_len: int,
                       max_seq_len: int, causal: bool = True, sliding_window: int | None = None,
                       softmax_scale: float | None = None, out: torch.Tensor | None = None,
                       return_lse: bool = False, num_splits: int | None = None,
                       config: TQAttentionConfig | None = None, centering: KeyCentering | None = None,
                       center_sums: torch.Tensor | None = None):
    """One-shot ``TQAttentionPlan(...).plan(...).run(...)`` (allocates a workspace; for tests and one-off calls).

    q [Tq, Hq, d]; cache [num_blocks, Hkv, head_page_bytes] uint8; returns out [Tq, Hq, d]
    (and lse [Hq, Tq] fp32 when ``return_lse``)."""
    num_kv_heads = cache.shape[1]
    tq = q.shape[0]
    ws = max(tq, 1) * q.shape[1] * (layout.head_dim + 1) * 4 * (num_splits or 64)
    plan = TQAttentionPlan(layout, q.shape[1], num_kv_heads, q.device, workspace_bytes=ws, config=config)
    plan.plan(block_table, query_start_loc, seq_lens, num_tokens=tq, max_query_len=max_query_len,
              max_seq_len=max_seq_len, causal=causal, sliding_window=sliding_window,
              softmax_scale=softmax_scale, num_splits=num_splits)
    return plan.run(q, cache, out=out, return_lse=return_lse, centering=centering, center_sums=center_sums)


def tq_paged_attention_ref(q: torch.Tensor, cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, causal: bool = True,
                           sliding_window: int | None = None, softmax_scale: float | None = None,
                           centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None):
    """Reference: gather pages per request, dequantize with the references, naive float64 softmax
    attention with the same masking. Returns out (q.dtype, rows outside the requests zero) and
    lse [Hq, Tq] float32 (-inf for rows that see no token)."""
    tq, hq, d = q.shape
    hkv = cache.shape[1]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(tq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64, device=q.device)
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(block_table.shape[0]):
        q0, q1, n = qsl[r], qsl[r + 1], sl[r]
        nq = q1 - q0
        if nq <= 0 or n <= 0:
            continue
        k, v = dequant_cached_ref(cache, layout, block_table[r], n, centering=centering,
                                  center_sums_row=None if centering is None else center_sums[r])
        k = k.double().repeat_interleave(g, dim=1)  # [n, Hq, d]
        v = v.double().repeat_interleave(g, dim=1)
        pos = torch.arange(nq, device=q.device) + (n - nq if causal else n)
        t = torch.arange(n, device=q.device)
        mask = t[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= t[None, :] > pos[:, None] - sliding_window
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        lse_r = torch.logsumexp(s, dim=-1)  # [Hq, nq]
        p = torch.exp(s - torch.where(torch.isinf(lse_r), 0.0, lse_r)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
        lse[:, q0:q1] = lse_r
    return out.to(q.dtype), lse.float()


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      output: torch.Tensor | None = None):
    """Combine two attentions over disjoint key sets: out [T, H, d], lse [H, T] (natural log).

    A side with lse = -inf (no keys) contributes nothing; +inf (some kernels' "no keys") is read as
    -inf. Pure tensor ops, no host synchronization (CUDA-graph capturable). Returns (out, lse)."""
    la = torch.where(lse_a == float("inf"), float("-inf"), lse_a.float())
    lb = torch.where(lse_b == float("inf"), float("-inf"), lse_b.float())
    mx = torch.maximum(la, lb)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    wa, wb = torch.exp(la - mx), torch.exp(lb - mx)
    total = wa + wb
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    wa_t, wb_t = (wa * inv).t().unsqueeze(-1), (wb * inv).t().unsqueeze(-1)  # [T, H, 1]
    merged = out_a.float() * wa_t + out_b.float() * wb_t
    lse = torch.where(total > 0, mx + torch.log(total), torch.full_like(total, float("-inf")))
    if output is None:
        return merged.to(out_a.dtype), lse
    output.copy_(merged)
    return output, lse


# ----------------------------------------------------------------------------------------------
# Gather + dequantize
# ----------------------------------------------------------------------------------------------


def tq_gather_dequant(cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seq_lens: torch.Tensor, out_k: torch.Tensor,
                      out_v: torch.Tensor, *, max_seq_len: int, block_n: int = 32,
                      centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None,
                      permute_lookup: bool = True):
    """Dequantize cached tokens 0..seq_lens[r]-1 of every request into dense rows
    ``cu_seq_lens[r] + t`` of ``out_k``/``out_v`` [N, Hkv, d] (fp16/bf16/fp32, preallocated: the
    caller bounds N, e.g. by a fixed workspace and a chunked loop). No host synchronization.
    ``permute_lookup`` (bf16 outputs): codebook values by byte permutes in registers (fp16 codebooks, as
    attention uses), not gathered per index (fp32)."""
    num_kv_heads = cache.shape[1]
    u8, f16 = _cache_views(cache, layout, num_kv_heads)
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if o.dim() != 3 or o.shape[1:] != (num_kv_heads, layout.head_dim) or o.stride(-1) != 1:
            raise ValueError(f"{name} must be [N, {num_kv_heads}, {layout.head_dim}] with a contiguous last dim")
    num_reqs = block_table.shape[0]
    if centering is not None:
        _check_centering(centering, layout)
        if center_sums is None:
            raise ValueError("key centering needs the center_sums that the store wrote")
        _check_sums(center_sums, num_reqs, num_kv_heads, centering)
    if num_reqs == 0 or max_seq_len <= 0:
        return out_k, out_v
    kt, vt = _layout_tables(layout, cache.device)
    kc, vc = kt.codec, vt.codec
    # bf16 outputs only: their rounding (2**-9) hides the fp16 codebook values' (2**-12); fp16 / fp32 keep fp32.
    k_perm = (permute_lookup and out_k.dtype == torch.bfloat16 and not layout.key_is_fp8
              and permute_lookup_applies(kc))
    v_perm = permute_lookup and out_v.dtype == torch.bfloat16 and permute_lookup_applies(vc)
    grid = (num_reqs, triton.cdiv(max_seq_len, block_n), num_kv_heads)
    cargs, cconst = _centering_args(centering, center_sums, f16)
    tq_paged_gather_dequant_kernel[grid](
        u8, f16, u8.stride(0), u8.stride(1), block_table, block_table.stride(0), seq_lens, cu_seq_lens,
        *_decode_operands(kt, k_perm), *_decode_operands(vt, v_perm),
        out_k, out_k.stride(0), out_k.stride(1), out_v, out_v.stride(0), out_v.stride(1),
        kc.rot_scale, vc.rot_scale,
        *cargs, D=layout.head_dim, D_PAD=kc.dim_pad, K_FP8=layout.key_is_fp8, BN=block_n, num_warps=4,
        CENTER=centering is not None, K_PERMUTE=k_perm, V_PERMUTE=v_perm, **cconst,
        **kt.constexprs("K", layout.key_is_fp8), **vt.constexprs("V"), **layout.kernel_constexprs(),
    )
    return out_k, out_v


def tq_gather_dequant_ref(cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, *, centering: KeyCentering | None = None,
                          center_sums: torch.Tensor | None = None):
    """Reference: concatenated dequantized K, V [sum(seq_lens), Hkv, d] float32."""
    ks, vs = [], []
    for r, n in enumerate(seq_lens.tolist()):
        k, v = dequant_cached_ref(cache, layout, block_table[r], n, centering=centering,
                                  center_sums_row=None if centering is None else center_sums[r])
        ks.append(k)
        vs.append(v)
    return torch.cat(ks), torch.cat(vs)


__all__ = [
    "ATTENTION_HEAD_DIMS", "FP8_MAX", "PagedTQLayout", "TQAttentionConfig", "TQAttentionPlan", "allocate_kv_cache",
    "attention_coordinate_order", "center_sums_ref", "default_attention_config", "dequant_cached_ref",
    "kv_cache_shape", "merge_attn_states", "new_center_sums", "page_bytes_per_block", "paged_layout",
    "read_cached_tokens", "read_slots", "tq_key_center_sums",
    "tq_gather_dequant", "tq_gather_dequant_ref", "tq_paged_attention", "tq_paged_attention_ref", "tq_store",
    "tq_store_ref", "warmup_kernels",
]

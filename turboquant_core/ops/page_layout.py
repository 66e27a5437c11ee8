# SPDX-License-Identifier: Apache-2.0
"""Paged TurboQuant KV cache: the page layout, and what the store, attention and reference modules share.

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

Also here: the device tables per component (codec tables for the store and gather-dequant kernels,
kernel-order rotation rows and fp16 codebooks for attention) and the argument checks and key-centering
kernel arguments shared by ``ops.kv_store``, ``ops.paged_attention`` and ``ops.paged_reference``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import ComponentFormat, KVFormat, get_format
from ..rotation import check_head_dim
from .key_centering import KeyCentering
from .rotation_tables import CodecTables, codec_tables, kernel_coordinate_order, kernel_order_rotation

PAGE_SECTION_ALIGN = 16
# Head dims the attention kernel serves: d_pad = next power of two must fit the register tiles.
ATTENTION_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)


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
        return self.fmt.key.is_fp8

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
    if not (fmt.key.has_codebook or fmt.key.is_fp8):
        raise ValueError(f"{fmt.name}: paged kernels need codebook or fp8 keys, got {fmt.key.describe()}")
    if not fmt.value.has_codebook:
        raise ValueError(f"{fmt.name}: paged kernels need MSE (codebook) values, got {fmt.value.describe()}")
    kb, vb = fmt.key.index_bytes(head_dim), fmt.value.index_bytes(head_dim)
    off = 0
    k_idx = off
    off = _align(off + block_size * kb)
    v_idx = off
    off = _align(off + block_size * vb)
    k_sc = -1
    if fmt.key.stores_scale:
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
def _component_tables(head_dim: int, comp: ComponentFormat, seed: int, device: str) -> _ComponentTables:
    # fp8 keys: ``kernel_bits`` names a single-segment codec whose rotation rows only are used.
    t = codec_tables(head_dim, comp.kernel_bits, seed, device)
    hi, lo = kernel_order_rotation(head_dim, comp.kernel_bits, seed, device, fp8=comp.is_fp8)
    c = t.segment_tables()
    cents = (c[0].half().contiguous(), c[2].half().contiguous())
    return _ComponentTables(t, hi, lo, cents)


def _layout_tables(layout: PagedTQLayout, device) -> tuple[_ComponentTables, _ComponentTables]:
    f, d, dev = layout.fmt, layout.head_dim, str(torch.device(device))
    return (_component_tables(d, f.key, f.key_seed, dev),
            _component_tables(d, f.value, f.value_seed, dev))


# ----------------------------------------------------------------------------------------------
# Argument checks and key-centering kernel arguments (store, attention, references)
# ----------------------------------------------------------------------------------------------


def _check_kv(x: torch.Tensor, name: str, layout: PagedTQLayout) -> None:
    if x.dim() != 3 or x.shape[-1] != layout.head_dim:
        raise ValueError(f"{name} must be [num_tokens, num_kv_heads, {layout.head_dim}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def _check_centering(centering: KeyCentering, layout: PagedTQLayout) -> None:
    if layout.key_is_fp8:
        raise ValueError(f"key centering serves MSE keys; {layout.fmt.name} stores fp8 keys")
    if centering.page != layout.block_size or centering.head_dim != layout.head_dim:
        raise ValueError(f"key centering tables for page {centering.page} / head_dim {centering.head_dim} do not "
                         f"match the layout's block size {layout.block_size} / head_dim {layout.head_dim}")


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


__all__ = [
    "ATTENTION_HEAD_DIMS", "PAGE_SECTION_ALIGN", "PagedTQLayout", "allocate_kv_cache", "attention_coordinate_order",
    "kv_cache_shape", "page_bytes_per_block", "paged_layout",
]

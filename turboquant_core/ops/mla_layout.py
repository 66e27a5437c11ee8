# SPDX-License-Identifier: Apache-2.0
"""Paged TurboQuant MLA cache: the page layout, shared by the store and attention launchers (``ops.mla``) and the
plain-torch references (``ops.mla_reference``).

Cache layout (one tensor per MLA layer)
---------------------------------------
``cache``: uint8 ``[num_blocks, page_bytes]``; the last dim must be contiguous, the block stride may be larger (a
view into a bigger allocation) but must be even. A block holds ``block_size`` tokens' entries
(``formats.MLAFormat``) as a structure of arrays; every section starts on a 16-byte boundary (padding only where a
section would not: none for block sizes that are multiples of 8, so then ``page_bytes == block_size *
fmt.bytes_per_token()``):

====================  =========================================  ==========================================
section               bytes                                      content per token
====================  =========================================  ==========================================
latent index rows     block_size * fmt.latent_index_bytes()      planar8 codebook indices per segment of
                                                                 R kv_c (exactly ``ops.codec.encode``'s
                                                                 bytes); fp8 latents: e4m3fn bytes of R kv_c
k_pe rows             block_size * 2 * rope_dim                  rope_dim bf16 values
latent scales         block_size * 2 (codebook latents only)     fp16 norm-corrected scale
====================  =========================================  ==========================================

A token at slot ``s`` lives in block ``s // block_size``, row ``s % block_size`` of every section; token t of request
r is at slot ``block_table[r, t // block_size] * block_size + t % block_size`` (vLLM's slot mapping).

vLLM's own MLA cache is ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` in the cache dtype, one entry per
token row; this one is bytes, so that the integration's ``get_kv_cache_shape`` returns ``(num_blocks, page_bytes)``
and the spec's page size is ``page_bytes``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import MLA_KV_LORA_RANK, MLA_ROPE_DIM, KVFormat, MLAFormat, mla_format
from .rotation_tables import CodecTables, codec_tables, kernel_coordinate_order, kernel_order_rotation

MLA_SECTION_ALIGN = 16


def _align(n: int, a: int = MLA_SECTION_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class MLAPagedLayout:
    """Byte layout of one block of a paged TurboQuant MLA cache. Offsets are bytes from the start of the block;
    ``scale_offset`` is -1 for fp8 latents.

    >>> lay = mla_paged_layout("turboquant_k3v4_nc", block_size=64)
    >>> lay.page_bytes == 64 * 322
    True
    """

    fmt: MLAFormat
    block_size: int
    index_offset: int
    rope_offset: int
    scale_offset: int
    page_bytes: int

    @property
    def kv_lora_rank(self) -> int:
        return self.fmt.kv_lora_rank

    @property
    def rope_dim(self) -> int:
        return self.fmt.rope_dim

    @property
    def latent_is_fp8(self) -> bool:
        return self.fmt.latent.is_fp8

    @property
    def index_bytes(self) -> int:
        """Latent index bytes per token."""
        return self.fmt.latent_index_bytes()

    def sections(self) -> list[tuple[str, int, int]]:
        """(name, offset, bytes) per section, in page order."""
        bs = self.block_size
        out = [("latent_index", self.index_offset, bs * self.index_bytes),
               ("k_pe", self.rope_offset, bs * self.fmt.rope_bytes())]
        if self.scale_offset >= 0:
            out.append(("latent_scale", self.scale_offset, bs * self.fmt.latent_scale_bytes()))
        return out

    def padding_bytes(self) -> int:
        return self.page_bytes - self.block_size * self.fmt.bytes_per_token()

    def kernel_constexprs(self) -> dict:
        return dict(PAGE=self.block_size, IDX_OFF=self.index_offset, ROPE_OFF=self.rope_offset,
                    SC_OFF=max(self.scale_offset, 0), IDX_ROW=self.index_bytes, L=self.kv_lora_rank,
                    R=self.rope_dim, LATENT_FP8=self.latent_is_fp8,
                    NORM_CORRECTION=self.fmt.latent.norm_correction)


@functools.lru_cache(maxsize=256)
def _layout_cached(fmt: MLAFormat, block_size: int) -> MLAPagedLayout:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not (fmt.latent.has_codebook or fmt.latent.is_fp8):
        raise ValueError(f"{fmt.name}: MLA pages need a codebook or fp8 latent, got {fmt.latent.describe()}")
    off = 0
    idx = off
    off = _align(off + block_size * fmt.latent_index_bytes())
    rope = off
    off = _align(off + block_size * fmt.rope_bytes())
    scale = -1
    if fmt.latent.stores_scale:
        scale = off
        off = _align(off + block_size * fmt.latent_scale_bytes())
    return MLAPagedLayout(fmt, block_size, idx, rope, scale, off)


def mla_paged_layout(fmt: str | KVFormat | MLAFormat, block_size: int, kv_lora_rank: int = MLA_KV_LORA_RANK,
                     rope_dim: int = MLA_ROPE_DIM) -> MLAPagedLayout:
    """The MLA page layout of preset ``fmt`` (a name, a ``KVFormat`` or an ``MLAFormat``, whose own ranks count)."""
    m = fmt if isinstance(fmt, MLAFormat) else mla_format(fmt, kv_lora_rank, rope_dim)
    return _layout_cached(m, block_size)


def mla_kv_cache_shape(num_blocks: int, layout: MLAPagedLayout) -> tuple[int, int]:
    """Shape of the uint8 cache tensor of one MLA layer: (num_blocks, page_bytes)."""
    return (num_blocks, layout.page_bytes)


def allocate_mla_cache(num_blocks: int, layout: MLAPagedLayout, device="cpu") -> torch.Tensor:
    """A zeroed cache tensor for ``layout``."""
    return torch.zeros(mla_kv_cache_shape(num_blocks, layout), dtype=torch.uint8, device=device)


def mla_cache_views(cache: torch.Tensor, layout: MLAPagedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, fp16 view, bf16 view) of one layer's cache, after checking it against ``layout``: the kernels read
    the index rows as bytes, the scales through the fp16 view and k_pe through the bf16 view of the same memory."""
    if cache.dtype != torch.uint8 or cache.dim() != 2:
        raise ValueError(f"MLA cache must be uint8 [num_blocks, page_bytes], got {cache.dtype} {tuple(cache.shape)}")
    if cache.shape[1] != layout.page_bytes:
        raise ValueError(f"MLA cache shape {tuple(cache.shape)} does not match the layout: expected "
                         f"[*, {layout.page_bytes}]")
    if cache.stride(1) != 1 or cache.stride(0) % 2 or cache.storage_offset() % 2:
        raise ValueError(f"MLA cache needs a contiguous last dim and an even block stride and offset, got strides "
                         f"{cache.stride()} offset {cache.storage_offset()}")
    return cache, cache.view(torch.float16), cache.view(torch.bfloat16)


@dataclass(frozen=True)
class MLATables:
    """The latent's device tables: the codec's (store: natural padded order) and attention's (rotation rows in
    ``kernel_coordinate_order``, the order of ``codebook_lookup_jit`` tiles; fp16 codebooks)."""

    codec: CodecTables  # fp8 latents: a one-segment table whose rotation rows only are used
    attn_rot_hi: torch.Tensor  # [rows, dim_pad] fp16, kernel order
    attn_rot_lo: torch.Tensor
    order: torch.Tensor  # [rows] long: rotated coordinate of each kernel-order position (-1: padding)
    # [rows, kv_lora_rank] fp32: (hi + lo) * rot_scale, the orthogonal rotation in kernel order: y_rot = attn_rows @ y
    # rotates queries in, y = attn_rows^T @ y_rot outputs out
    attn_rows: torch.Tensor
    cent_f16: tuple[torch.Tensor, torch.Tensor]  # codebooks of segment 0 / 1 as fp16 (attention's lookups)

    def segment_constexprs(self, fp8: bool) -> dict:
        s = self.codec.segments
        s1 = s[1] if len(s) > 1 else None
        return dict(G0=s[0].groups, GP0=s[0].groups_pad, B0=8 if fp8 else s[0].bits,
                    G1=s1.groups if s1 else 0, GP1=s1.groups_pad if s1 else 1, B1=s1.bits if s1 else 1,
                    L_PAD=self.codec.dim_pad, EXACT_ROT=self.codec.exact_rot)


@functools.lru_cache(maxsize=64)
def _tables(fmt: MLAFormat, device: str) -> MLATables:
    latent = fmt.latent
    t = codec_tables(fmt.kv_lora_rank, latent.kernel_bits, fmt.seed, device)
    hi, lo = kernel_order_rotation(fmt.kv_lora_rank, latent.kernel_bits, fmt.seed, device, fp8=latent.is_fp8)
    order = kernel_coordinate_order(t, fp8=latent.is_fp8).to(device)
    rows = ((hi.float() + lo.float())[:, : fmt.kv_lora_rank] * t.rot_scale).contiguous()
    cents = (t.centroids[0].half().contiguous(), t.centroids[-1].half().contiguous())
    return MLATables(t, hi, lo, order, rows, cents)


def mla_tables(layout: MLAPagedLayout, device) -> MLATables:
    return _tables(layout.fmt, str(torch.device(device)))


__all__ = ["MLA_SECTION_ALIGN", "MLAPagedLayout", "MLATables", "allocate_mla_cache", "mla_cache_views",
           "mla_kv_cache_shape", "mla_paged_layout", "mla_tables"]

# SPDX-License-Identifier: Apache-2.0
"""KV-cache specs of TurboQuant layers that vLLM's own spec classes would misprice.

- Sliding-window layers (Gemma 2/3 style models). Stock vLLM gives a TurboQuant sliding layer a bf16-priced
  ``SlidingWindowSpec``, and its backend rejects sliding windows, so such models cannot start.
  ``TQSlidingWindowSpec`` is a ``SlidingWindowSpec`` priced like stock's ``TQFullAttentionSpec`` (``block_size *
  num_kv_heads * tq_slot_size``), so the sliding and full layers of a model share one page size at one block size,
  while the sliding-window block manager still frees blocks outside the window. Patch 0006 registers it with that
  manager and builds it for sliding layers with a ``turboquant_*`` dtype.
- MLA layers (DeepSeek V2/V3 style): ``MLAAttentionSpec`` prices a page as ``head_size`` bytes per token for a uint8
  cache dtype; ``TQMLAAttentionSpec`` prices it as the TurboQuant MLA page (patch 0011).
"""

from dataclasses import dataclass, replace
from typing import Self

from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec


@dataclass(frozen=True, kw_only=True)
class TQSlidingWindowSpec(SlidingWindowSpec):
    """SlidingWindowSpec whose page holds TurboQuant-compressed tokens (the page formula of TQFullAttentionSpec)."""

    tq_slot_size: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return super().real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class TQMLAAttentionSpec(MLAAttentionSpec):
    """MLAAttentionSpec whose page holds TurboQuant MLA entries: ``ops.mla_layout.MLAPagedLayout.page_bytes`` of the
    block size (the latent's kv_lora_rank is carried: the head size alone does not split latent from rope key).
    Patch 0011 builds it for MLA layers with a ``turboquant_*`` dtype and registers it with the full-attention
    manager, as vLLM registers MLAAttentionSpec."""

    tq_kv_lora_rank: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        from ..ops.mla_layout import mla_paged_layout

        lr = self.tq_kv_lora_rank
        if lr <= 0:  # (the base class's merge builds one without it before ours sets it)
            return super().real_page_size_bytes
        return mla_paged_layout(self.cache_dtype_str, self.storage_block_size, lr, self.head_size - lr).page_bytes

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        merged = super().merge(specs)
        if any(s.tq_kv_lora_rank != specs[0].tq_kv_lora_rank for s in specs):
            raise ValueError("all TurboQuant MLA layers of a KV-cache group must have one kv_lora_rank")
        return replace(merged, tq_kv_lora_rank=specs[0].tq_kv_lora_rank)

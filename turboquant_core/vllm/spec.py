# SPDX-License-Identifier: Apache-2.0
"""The KV-cache spec of TurboQuant sliding-window layers (Gemma 2/3 style models).

Stock vLLM gives a TurboQuant sliding layer a bf16-priced ``SlidingWindowSpec``, and its backend rejects sliding
windows, so such models cannot start. ``TQSlidingWindowSpec`` is a ``SlidingWindowSpec`` priced like stock's
``TQFullAttentionSpec`` (``block_size * num_kv_heads * tq_slot_size``), so the sliding and full layers of a model
share one page size at one block size, while the sliding-window block manager still frees blocks outside the
window. Patch 0006 registers it with that manager and builds it for sliding layers with a ``turboquant_*`` dtype.
"""

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import SlidingWindowSpec


@dataclass(frozen=True, kw_only=True)
class TQSlidingWindowSpec(SlidingWindowSpec):
    """SlidingWindowSpec whose page holds TurboQuant-compressed tokens (the page formula of TQFullAttentionSpec)."""

    tq_slot_size: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return super().real_page_size_bytes

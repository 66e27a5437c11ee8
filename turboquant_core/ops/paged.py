# SPDX-License-Identifier: Apache-2.0
"""Paged TurboQuant KV cache ops, re-exported from the modules that hold them (new code imports from those).

- ``ops.page_layout``: the page layout (``PagedTQLayout``, ``paged_layout``, ``kv_cache_shape``,
  ``page_bytes_per_block``, ``allocate_kv_cache``, ``ATTENTION_HEAD_DIMS``) and the device tables.
- ``ops.kv_store``: ``tq_store``, ``tq_key_center_sums``, ``new_center_sums`` (key centering's sums),
  ``new_center_tags``, ``new_block_epochs`` (sums kept across steps).
- ``ops.paged_attention``: ``TQAttentionConfig``, ``TQAttentionPlan``, ``tq_paged_attention``,
  ``merge_attn_states``, ``tq_gather_dequant``.
- ``ops.kernel_warmup``: ``warmup_kernels``.
- ``ops.paged_reference``: the plain-torch references (``tq_store_ref``, ``center_sums_ref``,
  ``center_sums_cached_ref``, ``dequant_cached_ref``, ``tq_paged_attention_ref``, ``tq_gather_dequant_ref``)
  and raw reads (``read_slots``, ``read_cached_tokens``).
"""

from ..quantizer import FP8_MAX
from .kernel_warmup import warmup_kernels
from .kv_store import MAX_CENTERED_REQS as MAX_CENTERED_REQS
from .kv_store import STORE_SEARCH_STEPS as STORE_SEARCH_STEPS
from .kv_store import new_block_epochs, new_center_sums, new_center_tags, tq_key_center_sums, tq_store
from .page_layout import (
    ATTENTION_HEAD_DIMS,
    PagedTQLayout,
    allocate_kv_cache,
    attention_coordinate_order,
    kv_cache_shape,
    page_bytes_per_block,
    paged_layout,
)
from .page_layout import PAGE_SECTION_ALIGN as PAGE_SECTION_ALIGN
from .paged_attention import DEFAULT_WORKSPACE_BYTES as DEFAULT_WORKSPACE_BYTES
from .paged_attention import LN2 as LN2
from .paged_attention import MIN_TOKENS_PER_SPLIT as MIN_TOKENS_PER_SPLIT
from .paged_attention import (
    TQAttentionConfig,
    TQAttentionPlan,
    merge_attn_states,
    tq_gather_dequant,
    tq_paged_attention,
)
from .paged_reference import (
    center_sums_cached_ref,
    center_sums_ref,
    dequant_cached_ref,
    read_cached_tokens,
    read_slots,
    tq_gather_dequant_ref,
    tq_paged_attention_ref,
    tq_store_ref,
)

__all__ = [
    "ATTENTION_HEAD_DIMS", "FP8_MAX", "PagedTQLayout", "TQAttentionConfig", "TQAttentionPlan", "allocate_kv_cache",
    "attention_coordinate_order", "center_sums_cached_ref", "center_sums_ref", "dequant_cached_ref",
    "kv_cache_shape", "merge_attn_states", "new_block_epochs", "new_center_sums", "new_center_tags",
    "page_bytes_per_block", "paged_layout",
    "read_cached_tokens", "read_slots", "tq_key_center_sums",
    "tq_gather_dequant", "tq_gather_dequant_ref", "tq_paged_attention", "tq_paged_attention_ref", "tq_store",
    "tq_store_ref", "warmup_kernels",
]

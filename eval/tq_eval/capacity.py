# SPDX-License-Identifier: Apache-2.0
"""KV-cache bytes per token from the format table (turboquant_core.formats) and plain dtypes."""

from __future__ import annotations

BF16_BYTES = 2


def bytes_per_token_per_head(dtype: str, head_dim: int) -> int | None:
    """K+V bytes one token takes in one KV head under ``dtype`` in this project's layout, or None
    where the table has no answer (an unsupported head_dim, an unknown dtype)."""
    if dtype in ("auto", "bfloat16", "float16"):
        return 2 * BF16_BYTES * head_dim
    if dtype.startswith("fp8"):
        return 2 * head_dim
    if dtype.startswith("turboquant_"):
        from turboquant_core.formats import get_format

        try:
            return get_format(dtype).bytes_per_token_per_head(head_dim)
        except ValueError:
            return None
    return None


def bytes_per_token(dtype: str, head_dim: int, num_kv_heads: int, num_layers: int) -> int | None:
    """All layers and KV heads, every layer in ``dtype`` (no full-precision boundary layers)."""
    per_head = bytes_per_token_per_head(dtype, head_dim)
    return None if per_head is None else per_head * num_kv_heads * num_layers

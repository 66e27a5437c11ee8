# SPDX-License-Identifier: Apache-2.0
"""Key centering for vLLM's TurboQuant layers: tables from each layer's rotary embedding, attached at start-up
(before any KV-cache write and before CUDA-graph capture) by ``.warmup``.

Every TurboQuant full-attention layer with MSE keys and a plain rotary embedding gets the tables of
``turboquant_core.ops.key_centering`` (RoPE angles read from the layer's ``rotary_emb`` cos/sin cache and checked to
be a per-pair rotation). Such a layer stores a sequence's first page plain and later keys minus their page's share of
the sequence's pre-RoPE key mean, which the first page's bytes define (no bytes per token are added, and sequences
that share that page through prefix caching agree); attention adds the removed part back, exactly. Not centred: fp8
keys, sliding-window layers (their first page is freed), RoPE that is not a per-pair rotation.
"""

import torch

from ..ops.key_centering import (
    KeyCentering,
    key_centering_tables,
    rope_theta_from_cos_sin_cache,
)
from .backend import TQAttentionImpl


def _centering_for(
    rope, impl: TQAttentionImpl, block_size: int, cache: dict
) -> tuple[KeyCentering | None, str]:
    """Key-centering tables for a layer with rotary embedding ``rope``, or (None, why not)."""
    if not impl.fmt.key.centerable:
        return None, f"{impl.fmt.key.describe()} keys"
    if impl.sliding_window is not None:
        return None, "sliding window (its first page is freed)"
    if rope is None or not isinstance(getattr(rope, "is_neox_style", None), bool):
        return None, "no rotary embedding found"
    key = (id(rope), block_size)
    if key not in cache:
        try:
            compute = getattr(rope, "_compute_cos_sin_cache", None)
            cos_sin = compute() if callable(compute) else rope.cos_sin_cache
            theta = rope_theta_from_cos_sin_cache(cos_sin.float())
            cache[key] = key_centering_tables(
                theta,
                impl.head_size,
                block_size,
                cos_sin.shape[0],
                neox=rope.is_neox_style,
                device=cos_sin.device
                if cos_sin.is_cuda
                else torch.accelerator.current_accelerator(),
            )
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:
            cache[key] = f"{type(rope).__name__}: {e}"
    got = cache[key]
    return (got, "") if isinstance(got, KeyCentering) else (None, got)


def attach_key_centering(model_runner) -> dict[str, str]:
    """Give every TurboQuant layer that can take it its key-centering tables (before any
    KV-cache write). Returns {layer: why not} for the others (all of them with
    --no-tq-key-centering)."""
    ctx = model_runner.compilation_config.static_forward_context
    skipped: dict[str, str] = {}
    tables: dict = {}
    model = model_runner.get_model()
    for module in model.modules():
        attn = getattr(module, "attn", None)
        impl = getattr(attn, "impl", None)
        if not isinstance(impl, TQAttentionImpl):
            continue
        name = getattr(attn, "layer_name", "?")
        if not impl.tq_config.key_centering:
            skipped[name] = "--no-tq-key-centering"
            continue
        kv_cache = ctx[name].kv_cache if name in ctx else None
        if isinstance(kv_cache, (list, tuple)):
            kv_cache = kv_cache[0]
        if kv_cache is None or kv_cache.numel() == 0:
            skipped[name] = "no KV cache"
            continue
        block_size = impl._layout_for(kv_cache).block_size
        impl.key_centering, why = _centering_for(
            getattr(module, "rotary_emb", None), impl, block_size, tables
        )
        if impl.key_centering is None:
            skipped[name] = why
    return skipped

# SPDX-License-Identifier: Apache-2.0
"""Start-up of vLLM's TurboQuant layers (called from vLLM's kernel warm-up, patch 0007): attach key centering, give the
centred layers their sums kept across steps, then compile every kernel variant the serving paths can reach (store;
decode split/unsplit; chunked-prefill context for every query-block shape; split merge), on the null block 0 of each
group's KV cache, before CUDA-graph capture. MLA groups (TURBOQUANT_MLA): store, decode with every split-merge
variant, and the prefill context's gather.

vLLM's profiling run gives attention no metadata and CUDA-graph capture covers only pure decode batches, so without
this the context kernels would compile inside the first requests that hit chunked prefill. The variants do not depend
on batch size or sequence length (run-time arguments), so this is all the compilation the backend needs.
"""

import time

import torch
from vllm.logger import init_logger

from ..ops.kv_store import new_block_epochs
from .backend import TQAttentionBackend, TQAttentionImpl
from .centering import attach_key_centering
from .mla_backend import TQMLABackend

# Under vLLM's logger so that its logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")


def warmup_tq_attention(model_runner) -> None:
    """Attach key centering, keep the centred layers' sums across steps, then launch the
    TurboQuant kernels of every TURBOQUANT attention group once, so that Triton compiles
    them during start-up instead of inside the first requests."""
    ctx = model_runner.compilation_config.static_forward_context
    dtype = model_runner.model_config.dtype
    skipped = attach_key_centering(model_runner)
    centred = [
        name
        for name, layer in ctx.items()
        if isinstance(getattr(layer, "impl", None), TQAttentionImpl)
        and layer.impl.key_centering is not None
    ]
    logger.info(
        "TurboQuant key centering: %d layers%s%s",
        len(centred),
        f" ({ctx[centred[0]].impl.key_centering.describe()})" if centred else "",
        f"; not on {len(skipped)}: {sorted(set(skipped.values()))}" if skipped else "",
    )
    t0, launches, kept_layers, kept_bytes = time.perf_counter(), 0, 0, 0
    for groups in getattr(model_runner, "attn_groups", None) or []:
        for group in groups:
            if group.backend not in (TQAttentionBackend, TQMLABackend) or not group.layer_names:
                continue
            kv_cache = ctx[group.layer_names[0]].kv_cache
            if isinstance(kv_cache, (list, tuple)):
                kv_cache = kv_cache[0]
            if kv_cache.numel() == 0:
                continue
            if group.backend is TQMLABackend:
                impl = ctx[group.layer_names[0]].impl
                launches += group.get_metadata_builder().warmup_kernels(
                    kv_cache, dtype, impl.num_heads, impl.scale, impl.rotation_folded
                )
                continue
            kept = _keep_center_sums(group, ctx, kv_cache.shape[0], kv_cache.device)
            kept_layers += kept[0]
            kept_bytes += kept[1]
            variants = {
                id(c): c
                for c in (ctx[n].impl.key_centering for n in group.layer_names)
            }
            for centering in variants.values():
                launches += group.get_metadata_builder().warmup_kernels(
                    kv_cache, dtype, centering
                )
    if kept_layers:
        logger.info(
            "TurboQuant key centering: first-page sums kept across steps for %d "
            "layers, %.1f MiB",
            kept_layers,
            kept_bytes / (1 << 20),
        )
    if launches:
        torch.accelerator.synchronize()
        logger.info(
            "TurboQuant attention: %d kernel launches compiled in %.1f s",
            launches,
            time.perf_counter() - t0,
        )


def _keep_center_sums(group, ctx, num_blocks: int, device) -> tuple[int, int]:
    """Sums kept across steps for the group's centred layers, in each of its builders (one
    per micro-batch), with one block-epoch array shared by them (any of them may store into
    a block). Returns (layers, bytes allocated)."""
    names = [n for n in group.layer_names if ctx[n].impl.key_centering is not None]
    if not names:
        return 0, 0
    builders = getattr(group, "metadata_builders", None) or [
        group.get_metadata_builder()
    ]
    epochs = new_block_epochs(num_blocks, device)
    nbytes = epochs.numel() * 4
    for builder in builders:
        kept = builder.keep_center_sums(names, epochs)
        if kept is not None:
            nbytes += kept.nbytes()
    return len(names), nbytes

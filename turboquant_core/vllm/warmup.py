# SPDX-License-Identifier: Apache-2.0
"""Start-up of vLLM's TurboQuant layers (called from vLLM's kernel warm-up, patch 0007): attach key centering, give the
centred layers their sums kept across steps, then compile every kernel variant the serving paths can reach (store;
decode split/unsplit; chunked-prefill context for every query-block shape; split merge), on the null block 0 of each
group's KV cache, before CUDA-graph capture. MLA groups (TURBOQUANT_MLA): store, decode with every split-merge
variant, the prefill context's gather, and vLLM's own context mask of its chunked-context prefill; MLA models with any
other cache get that mask compiled too (``warmup_mla_context_mask``). MoE models, whatever their cache, run one eager
step for each variant of vLLM's fused-MoE kernel that the steps past the CUDA graphs reach (``warmup_moe_eager_steps``).

vLLM's profiling run gives attention no metadata and CUDA-graph capture covers only pure decode batches, so without
this the context kernels would compile inside the first requests that hit chunked prefill. The variants do not depend
on batch size or sequence length (run-time arguments), so this is all the compilation the backend needs.

The variants are compiled in parallel worker processes first (``ops.compile_ahead``: the warm-up's launches are
recorded without running, the variants not in Triton's on-disk cache are compiled for the device's target on the
node's CPUs), and the warm-up then runs for real, loading each variant from the cache instead of compiling the
variants one after another in the engine process.
"""

import contextlib
import functools
import json
import time

import torch
from vllm.logger import init_logger

from ..config import TQConfig
from ..ops.compile_ahead import (
    compile_ahead,
    counting_compiles,
    default_workers,
    explain_recompile,
    loading_from,
)
from ..ops.kv_store import new_block_epochs
from .backend import TQAttentionBackend, TQAttentionImpl
from .centering import attach_key_centering
from .mla_backend import TQMLABackend, warmup_context_mask

# Under vLLM's logger so that its logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")


def warmup_tq_attention(model_runner) -> None:
    """Attach key centering, keep the centred layers' sums across steps, compile the
    TurboQuant kernel variants of every TurboQuant attention group in parallel processes,
    then launch each variant once, so that no kernel compiles inside the first requests."""
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
    kept_layers, kept_bytes = 0, 0
    jobs = []  # one warm-up call per group and layer variant; each returns its number of launches
    for groups in getattr(model_runner, "attn_groups", None) or []:
        for group in groups:
            if group.backend not in (TQAttentionBackend, TQMLABackend) or not group.layer_names:
                continue
            kv_cache = ctx[group.layer_names[0]].kv_cache
            if isinstance(kv_cache, (list, tuple)):
                kv_cache = kv_cache[0]
            if kv_cache.numel() == 0:
                continue
            builder = group.get_metadata_builder()
            if group.backend is TQMLABackend:
                impl = ctx[group.layer_names[0]].impl
                jobs.append(
                    functools.partial(
                        builder.warmup_kernels,
                        kv_cache,
                        dtype,
                        impl.num_heads,
                        impl.scale,
                        impl.rotation_folded,
                    )
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
                jobs.append(
                    functools.partial(builder.warmup_kernels, kv_cache, dtype, centering)
                )
    if kept_layers:
        logger.info(
            "TurboQuant key centering: first-page sums kept across steps for %d "
            "layers, %.1f MiB",
            kept_layers,
            kept_bytes / (1 << 20),
        )
    if not jobs:
        return
    # The variants compile in parallel processes first (no GPU needed), then the real
    # launches load them from Triton's cache instead of compiling one after another.
    ahead = None
    try:
        ahead = compile_ahead(
            lambda: [job() for job in jobs], _compile_workers(model_runner)
        )
        logger.info("TurboQuant attention: %s", ahead.describe())
    except Exception as e:  # only start-up time is at stake: the launches below compile
        logger.warning(
            "TurboQuant attention: compiling ahead failed (%s: %s); the warm-up "
            "compiles each kernel variant in this process",
            type(e).__name__,
            e,
        )
    t0 = time.perf_counter()
    with loading_from(ahead) if ahead is not None else contextlib.nullcontext() as moved, counting_compiles() as count:
        if moved:
            logger.info(
                "TurboQuant attention: Triton's cache directory changed from %s to %s after compiling ahead; "
                "the warm-up loads from the first",
                ahead.cache_dir,
                moved,
            )
        launches = sum(job() for job in jobs)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    logger.info(
        "TurboQuant attention: %d kernel launches in %.1f s (%d variants loaded "
        "from the cache, %d compiled here%s)",
        launches,
        time.perf_counter() - t0,
        count.loaded,
        len(count.compiled),
        f": {', '.join(sorted(set(count.compiled)))}" if count.compiled else "",
    )
    if ahead is not None and count.first_compiled is not None and ahead.compiled + ahead.cached:
        # Variants compiled ahead (or found cached) that the launches compiled anyway: say which part of Triton's
        # cache key or which cache directory parted them, so that the start-up time lost can be traced.
        try:
            why = explain_recompile(ahead, *count.first_compiled, count.first_lookup)
        except Exception as e:  # a diagnosis only
            why = f"{type(e).__name__}: {e}"
        logger.warning(
            "TurboQuant attention: %d of the variants prepared ahead were compiled again in "
            "this process; first: %s",
            len(count.compiled),
            why,
        )


def warmup_mla_context_mask(model_runner) -> int:
    """An MLA model with any other KV-cache dtype (bf16, fp8): compile vLLM's context mask of its chunked-context
    prefill (``mla_backend.warmup_context_mask``) for the layers' head count, before serving; vLLM's own MLA backends
    reach it in the first step that continues a chunked prompt beside new ones, where the compile would hold that
    step. Returns the launches."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = model_runner.compilation_config.static_forward_context
    heads = sorted({layer.num_heads for layer in ctx.values() if isinstance(layer, MLAAttention)})
    with counting_compiles() as count:
        launches = sum(warmup_context_mask(h, model_runner.device) for h in heads)
    if heads:
        logger.info("MLA context mask: %d launches for %s heads (%d variants compiled)", launches,
                    "/".join(map(str, heads)), len(count.compiled))
    return launches


def fused_moe_variant(m: int, config: dict, top_k: int, num_experts: int) -> tuple:
    """What picks the variant of vLLM 0.26.0's Triton ``fused_moe_kernel`` in a step of m tokens: the tile config,
    and Triton's specialization (divisible by 16, equal to 1) of the integer arguments that follow m, the routed rows
    (m * top_k) and the rows padded per expert (EM) of the gate/up and the down product, as
    ``invoke_fused_moe_triton_kernel``, ``moe_align_block_size`` and ``_prepare_expert_assignment`` compute them
    (no expert map)."""
    bm = config["BLOCK_SIZE_M"]
    rows = m * top_k
    if rows * 4 <= num_experts:  # naive block assignment: one block per routed row
        em = em_down = rows * bm
    else:
        em = rows + num_experts * (bm - 1)
        if rows < num_experts:
            em = min(em, rows * bm)
        em_down = min(em, rows * bm) if rows < bm else em  # the down product's A has the routed rows
        if m < bm:
            em = min(em, rows * bm)

    def spec(x: int) -> tuple[bool, bool]:
        return x % 16 == 0, x == 1

    return json.dumps(config, sort_keys=True), spec(rows), spec(em), spec(em_down)


def eager_moe_token_counts(config_for, top_k: int, num_experts: int, token_counts) -> list[int]:
    """The fewest of ``token_counts`` that reach every variant of the fused-MoE kernel those counts reach
    (``fused_moe_variant``); ``config_for(m)`` is the tile config a step of m tokens picks."""
    first: dict[tuple, int] = {}
    for m in token_counts:
        first.setdefault(fused_moe_variant(m, config_for(m), top_k, num_experts), m)
    return sorted(first.values())


def warmup_moe_eager_steps(model_runner) -> list[int]:
    """MoE layers whose experts run vLLM's Triton fused-MoE kernel: one eager dummy step for each variant of it that
    steps past the CUDA graphs can reach (``eager_moe_token_counts``). The profiling run compiles the variants of a
    full step and CUDA-graph capture those of the captured sizes, but the steps between them (a prefill chunk beside a
    few decodes) pick their tile config and Triton specialization by their token count, and the first such step
    compiled its variant while serving. Returns the token counts run."""
    from vllm.config import CUDAGraphMode
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    cc = getattr(model_runner, "compilation_config", None)
    if cc is None or not hasattr(model_runner, "_dummy_run"):
        return []
    ctx = cc.static_forward_context
    dtype = model_runner.model_config.dtype
    problems = set()  # (weights' shapes, top_k, experts, config dtype, block shape) of the layers
    for name in getattr(cc, "static_all_moe_layers", None) or []:
        experts_layer = getattr(ctx.get(name), "routed_experts", None)
        kernel = getattr(getattr(experts_layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, TritonExperts):
            continue
        top_k = experts_layer.moe_config.experts_per_token
        problems.add((tuple(experts_layer.w13_weight.shape), tuple(experts_layer.w2_weight.shape), top_k,
                      experts_layer.moe_config.num_experts, experts.quant_config.config_name(dtype),
                      tuple(experts.block_shape or ()) or None))
    if not problems:
        return []
    last = model_runner.scheduler_config.max_num_batched_tokens
    graphs = not model_runner.model_config.enforce_eager and cc.cudagraph_mode.mixed_mode() != CUDAGraphMode.NONE
    first = (cc.max_cudagraph_capture_size or 0) + 1 if graphs else 1
    counts = set()
    for w1, w2, top_k, experts, config_dtype, block_shape in problems:
        config_for = functools.partial(try_get_optimal_moe_config, w1, w2, top_k, config_dtype,
                                       block_shape=list(block_shape) if block_shape else None)
        counts.update(eager_moe_token_counts(config_for, top_k, experts, range(first, last + 1)))
    counts = sorted(counts)
    t0 = time.perf_counter()
    with counting_compiles() as count:
        for m in counts:
            model_runner._dummy_run(m, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True, remove_lora=False)
    logger.info("MoE steps past the CUDA graphs: %d eager dummy steps of %s tokens in %.1f s (%d kernel variants "
                "compiled)", len(counts), ", ".join(map(str, counts)), time.perf_counter() - t0, len(count.compiled))
    return counts


def _compile_workers(model_runner) -> int:
    """--tq-compile-workers, or with 0 (automatic) the CPUs this process may use shared among
    the engine processes of this node that warm up at the same time."""
    workers = TQConfig.from_vllm(getattr(model_runner, "vllm_config", None)).compile_workers
    if workers:
        return workers
    pc = getattr(model_runner, "parallel_config", None)
    try:
        ranks = max(1, int(pc.local_world_size) * int(pc.data_parallel_size_local))
    except (AttributeError, TypeError, ValueError):
        ranks = 1
    return default_workers(ranks)


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

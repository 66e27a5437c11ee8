# SPDX-License-Identifier: Apache-2.0
"""vLLM's TURBOQUANT attention backend (metadata, builder, backend, impl) on turboquant_core's paged kernels.

``AttentionBackendEnum.TURBOQUANT`` points here (patch 0003 of ``vllm_patches/v0.26.0``). The cache of one layer is a
uint8 tensor ``[num_blocks, num_kv_heads, head_page_bytes]`` whose byte layout (K indices, V indices, K scales,
V scales per block and KV head) is ``turboquant_core.ops.page_layout.PagedTQLayout``; every ``turboquant_*`` cache
dtype is a row of ``turboquant_core.formats.KV_FORMATS``. This module is glue: kernels, layouts and format math live
in ``turboquant_core.ops``.

One step:
- ``do_kv_cache_update`` (before ``forward``): ``tq_store`` rotates, quantizes and packs the step's K/V into their
  pages.
- decode requests (query length 1, or up to 1 + the draft tokens when speculative verification runs as decode; first
  in the batch after reordering): paged attention over the compressed pages, the tokens stored just before included.
- prefill requests: the fresh tokens attend to each other in bf16 with FlashAttention (causal, sliding window).
  Requests with cached context (a later chunk of a chunked prefill, a prefix-cache hit) also attend to that context
  ``[0, context_len)``. Chunks of at least ``CONTEXT_GATHER_MIN_QUERY_LEN`` queries (layers without a sliding
  window) have their context dequantized into a bf16 workspace next to their fresh K/V and run one causal
  FlashAttention pass (``TQContextGather``), as vLLM's MLA backends do; shorter chunks, windowed layers and steps
  whose rows do not fit the workspace attend to the context through the compressed kernel and merge both parts
  by their log-sum-exp. With
  ``--tq-prefill-from-cache`` they attend to their own tokens as stored too, like decode (one causal pass of the
  compressed kernel), so chunking and prefix-cache hits do not change a request's keys and values.

Options (``turboquant_core.config.TQConfig``, from vLLM's ``CacheConfig.turboquant``) reach the builder and the impl
at construction. Key centering (``.centering``, attached at start-up; ``--tq-key-centering``, on by default): a
centred layer's store runs two passes around a small launch that derives each request's pre-RoPE key mean per KV head
from its first page (a decode-only batch: the sums, then K and V in one pass), and attention adds the removed part
back to the logits (exact). No extra bytes per token. The sums are kept per layer across steps (``TQKeptCenterSums``,
set up by the warm-up before CUDA-graph capture): a row is recomputed only when its first page changed, which the
tags of the rows and the per-block epochs that the store bumps tell on the device, so a steady decode step's sums
launch only compares tags.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.config.cache import CacheDType
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.fa_utils import (
    get_flash_attn_version,
    is_flash_attn_varlen_func_available,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
from vllm.v1.kv_cache_interface import AttentionSpec

from ..config import TQConfig
from ..formats import KV_FORMATS, get_format
from ..ops.kernel_warmup import warmup_kernels
from ..ops.key_centering import KeyCentering
from ..ops.kv_store import new_center_tags, tq_store
from ..ops.page_layout import (
    ATTENTION_HEAD_DIMS,
    PagedTQLayout,
    kv_cache_shape,
    paged_layout,
)
from ..ops.paged_attention import (
    PREFILL_MIN_QUERY_LEN,
    TQAttentionConfig,
    TQAttentionPlan,
    tq_gather_dequant,
)

if is_flash_attn_varlen_func_available():
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

# Under vLLM's logger so that its logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")


def check_tq_dtype(cache_dtype_str: str, backend: str = "TURBOQUANT") -> None:
    if cache_dtype_str not in KV_FORMATS:
        raise ValueError(
            f"the {backend} attention backend serves turboquant_* KV-cache dtypes "
            f"only, got {cache_dtype_str!r}; valid: {', '.join(KV_FORMATS)}"
        )


class TQBackendTraits:
    """What every TurboQuant attention backend (TURBOQUANT, TURBOQUANT_MLA) takes: the
    turboquant_* cache dtypes and nothing else, fp16 / bf16 models, whole pages of 16 to
    128 tokens, Ampere and later; no KV connectors. Listed before vLLM's backend class."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(KV_FORMATS)  # type: ignore[assignment]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [16, 32, 64, 128]

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: CacheDType | None) -> bool:
        return kv_cache_dtype is not None and kv_cache_dtype in KV_FORMATS

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # KV connectors assume vLLM's own page layouts; not validated with ours.
        return False

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # Tensor-core tl.dot in the kernels and FlashAttention for prefill.
        return capability >= DeviceCapability(8, 0)


class TQAttentionBackend(TQBackendTraits, AttentionBackend):
    """Attention over a TurboQuant-compressed paged KV cache."""

    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        # Must stay an AttentionBackendEnum member name (attention.py looks it up).
        return "TURBOQUANT"

    @staticmethod
    def get_impl_cls() -> type["TQAttentionImpl"]:
        return TQAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["TQAttentionMetadataBuilder"]:
        return TQAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """(num_blocks, num_kv_heads, head_page_bytes), uint8."""
        check_tq_dtype(cache_dtype_str)
        layout = paged_layout(cache_dtype_str, head_size, block_size)
        if layout.padding_bytes():
            # The KV-cache spec prices a page as block_size * bytes_per_token;
            # a padded layout would not fit the allocation.
            raise ValueError(
                f"{cache_dtype_str}: block size {block_size} with head size "
                f"{head_size} needs {layout.padding_bytes()} padding bytes per "
                f"page; use a block size that is a multiple of 16"
            )
        return kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(ATTENTION_HEAD_DIMS)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class TQLayerPlans:
    """Launch plans of one (num_heads, window, scale) layer variant for this batch."""

    decode: TQAttentionPlan  # decode requests over their whole cached sequence
    context: TQAttentionPlan  # prefill requests over their cached context only


@dataclass
class TQContextGather:
    """This step's prefill requests as one FlashAttention pass over dense rows: request r's rows
    ``cu_seqlens_k[r]:cu_seqlens_k[r + 1]`` of ``keys``/``values`` (the builder's workspace) hold its cached
    context, dequantized, then its fresh tokens (rows ``fresh_rows``)."""

    keys: torch.Tensor  # [rows, Hkv, D], the model's dtype
    values: torch.Tensor
    cu_seqlens_k: torch.Tensor  # [num_prefills + 1] int32
    context_lens: torch.Tensor  # [num_prefills] int32
    fresh_rows: torch.Tensor  # [num_prefill_tokens] int64
    block_table: torch.Tensor  # the prefill requests' rows
    max_context_len: int
    max_seqlen_k: int


@dataclass
class TQKeptCenterSums:
    """Key-centering sums of a group's centred layers, kept across steps (tq_store's
    ``center_tags`` and ``block_epochs``); each layer has its own rows, as its sums are
    of its own first pages."""

    sums: torch.Tensor  # [layers, max_num_seqs, Hkv, 2, dim_pad] fp32
    # [layers, max_num_seqs, Hkv, 2] int32: (first block, its epoch) of each sums row
    tags: torch.Tensor
    # [num_blocks] int32, bumped by every store of a first-page token: one array per
    # group, shared by the group's builders (micro-batches), as any of them may write
    # a block
    block_epochs: torch.Tensor
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> its (sums, tags)

    def nbytes(self) -> int:
        return (self.sums.numel() + self.tags.numel()) * 4


@dataclass
class TQAttentionMetadata(AttentionMetadata):
    # Tokens of real requests; rows past it are CUDA-graph padding.
    num_actual_tokens: int
    # Requests with query length <= the builder's reorder threshold (1, or 1 + the
    # speculative tokens: verification runs as decode); the batch is reordered so
    # they come first. Each decode's queries are its last tokens.
    num_decodes: int
    num_decode_tokens: int
    # Queries per decode the decode plan was made for (upper bound; 1: single tokens).
    decode_query_len: int
    # Requests after the decodes, with their real token count (from the CPU copy of
    # query_start_loc, so padding rows are excluded).
    num_prefills: int
    num_prefill_tokens: int
    # Slot of every token in the paged cache (< 0: padding, not stored).
    slot_mapping: torch.Tensor
    # (num_heads, sliding_window, scale) of a layer -> its planned launches.
    plans: dict[tuple[int, int | None, float], TQLayerPlans]
    # Prefill part, [num_prefills + 1] int32, rebased to start at 0 (FlashAttention's
    # cu_seqlens for the fresh tokens and the context kernel's query_start_loc).
    prefill_query_start_loc: torch.Tensor | None = None
    # Longest fresh chunk among the prefill requests (host int, no device sync).
    max_prefill_query_len: int = 0
    # Whether some prefill request has cached context to attend to.
    prefill_has_context: bool = False
    # Set when the context is dequantized for one FlashAttention pass (layers without
    # a sliding window); the other layers take the context plan.
    context_gather: TQContextGather | None = None
    # Prefill chunks attend to their own tokens as stored (TQConfig.prefill_from_cache):
    # the context plan covers whole sequences, causal; no FlashAttention pass.
    prefill_from_cache: bool = False
    # Whole-batch metadata for key centering (token positions, first pages) and the
    # per-(request, KV head) sums its store writes and attention reads: a layer's own
    # rows kept across steps, or (a layer without them) scratch recomputed each step.
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    center_sums: torch.Tensor | None = None
    kept_center_sums: TQKeptCenterSums | None = None


class TQAttentionMetadataBuilder(AttentionMetadataBuilder[TQAttentionMetadata]):
    # Uniform decode batches (one query per request, or 1 + the speculative tokens
    # when verifying drafts) replay as full CUDA graphs: the decode plan makes no
    # host sync and reads only persistent metadata buffers. Mixed batches
    # (FlashAttention prefill + context merge) run piecewise.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Verification batches whose drafts differ in length (1 to 1 + the speculative
    # tokens queries per request) may replay the uniform graph of as many requests,
    # padded to it (vLLM patch 0009): the decode kernel and the query centering read
    # each request's query length from query_start_loc, and the padding requests
    # have none.
    supports_ragged_uniform_decode: ClassVar[bool] = True
    # Prefill chunks of at least this many queries read their context as dense rows:
    # dequantizing the context once costs less than the compressed kernel, which
    # reads it once per block of queries (1.3-5.5x faster per layer from 16 queries
    # on, benchmarks/results/2026-11-25-h200-long-prefill/).
    CONTEXT_GATHER_MIN_QUERY_LEN: ClassVar[int] = 16
    # Rows (context + fresh tokens of a step's prefill requests) of that workspace, at
    # most: one sequence of max_model_len tokens and a step's chunk fit when the model
    # allows it; longer steps take the compressed kernel.
    CONTEXT_GATHER_MAX_ROWS: ClassVar[int] = 1 << 16

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, then prefills: one decode launch and one prefill pass. With
        # speculative decoding, verification (1 + draft tokens per request) is decode.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

        self.cache_dtype = vllm_config.cache_config.cache_dtype
        check_tq_dtype(self.cache_dtype)
        self.layout: PagedTQLayout = paged_layout(
            self.cache_dtype, kv_cache_spec.head_size, kv_cache_spec.block_size
        )
        self.max_model_len = vllm_config.model_config.max_model_len

        self.tq_config = TQConfig.from_vllm(vllm_config)
        # Split-KV scratch shared by all plans of this builder (layers run one after
        # another on one stream). The plans cap their split count to what fits.
        workspace_mb = self.tq_config.attention_workspace_mb
        self.workspace = torch.empty(
            max(workspace_mb << 20, 4) // 4, dtype=torch.float32, device=device
        )
        self.plans = {
            key: TQLayerPlans(self._new_plan(key[0]), self._new_plan(key[0]))
            for key in self._layer_variants(vllm_config, layer_names)
        }
        # Dense context rows for long prefill chunks (TQContextGather), shared by all
        # layers of this builder; none when every layer has a sliding window, or
        # prefill chunks attend to their stored tokens.
        self.context_keys = self.context_values = None
        gather_rows = min(
            self.max_model_len + vllm_config.scheduler_config.max_num_batched_tokens,
            self.CONTEXT_GATHER_MAX_ROWS,
        )
        if not self.tq_config.prefill_from_cache and any(
            window is None for _, window, _ in self.plans
        ):
            shape = (gather_rows, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size)
            dtype = vllm_config.model_config.dtype
            self.context_keys = torch.empty(shape, dtype=dtype, device=device)
            self.context_values = torch.empty(shape, dtype=dtype, device=device)
        # Key-centering sums shared by the group's layers (each layer's store
        # rewrites them before its attention reads them), for a centred layer that
        # has no sums kept across steps (keep_center_sums).
        self.center_sums = None
        self.kept_center_sums: TQKeptCenterSums | None = None
        if not self.layout.key_is_fp8:
            self.center_sums = torch.zeros(
                vllm_config.scheduler_config.max_num_seqs,
                kv_cache_spec.num_kv_heads,
                2,
                1 << (kv_cache_spec.head_size - 1).bit_length(),
                dtype=torch.float32,
                device=device,
            )
        logger.info_once(
            "TurboQuant attention: %s, head size %d, kernel block %d, "
            "%d B per token per KV head, split-KV workspace %d MiB per group, "
            "prefill context workspace %d MiB per group",
            self.cache_dtype,
            kv_cache_spec.head_size,
            kv_cache_spec.block_size,
            self.layout.fmt.bytes_per_token_per_head(kv_cache_spec.head_size),
            workspace_mb,
            0 if self.context_keys is None else 2 * self.context_keys.nbytes >> 20,
        )

    def keep_center_sums(
        self, layer_names: list[str], block_epochs: torch.Tensor
    ) -> TQKeptCenterSums | None:
        """Keep the key-centering sums of the centred layers ``layer_names`` across
        steps: each gets its own sums rows and tags, and its store then recomputes only
        the rows whose first page changed (turboquant_core.ops.kv_store.tq_store).
        ``block_epochs`` (new_block_epochs, one per cache block): the group's counters,
        shared by all of the group's builders. Call before CUDA-graph capture (the
        captured launches keep these buffers), once: a later call with the same layers
        and epochs returns the same buffers."""
        kept = self.kept_center_sums
        if kept is not None and list(kept.layers) == list(layer_names) and (
            kept.block_epochs is block_epochs
        ):
            return kept
        if self.center_sums is None or not layer_names:
            return None
        rows, num_kv_heads, _, dim_pad = self.center_sums.shape
        n = len(layer_names)
        sums = torch.zeros(
            n, rows, num_kv_heads, 2, dim_pad, dtype=torch.float32, device=self.device
        )
        tags = new_center_tags(n * rows, num_kv_heads, self.device).view(
            n, rows, num_kv_heads, 2
        )
        self.kept_center_sums = TQKeptCenterSums(
            sums,
            tags,
            block_epochs,
            {name: (sums[i], tags[i]) for i, name in enumerate(layer_names)},
        )
        return self.kept_center_sums

    def _layer_variants(
        self, vllm_config: VllmConfig, layer_names: list[str]
    ) -> set[tuple[int, int | None, float]]:
        # One plan per distinct (heads, window, scale): each layer then finds
        # launches that match it even when a KV-cache group mixes windowed and
        # global layers (hybrid KV-cache manager disabled).
        layers = vllm_config.compilation_config.static_forward_context
        variants = {
            (impl.num_heads, impl.sliding_window, impl.scale)
            for impl in (
                getattr(layers.get(name), "impl", None) for name in layer_names
            )
            if isinstance(impl, TQAttentionImpl)
        }
        if not variants:
            raise ValueError(
                f"no TurboQuant attention layers among {layer_names[:4]}..."
            )
        return variants

    def _new_plan(self, num_heads: int) -> TQAttentionPlan:
        return TQAttentionPlan(
            self.layout,
            num_heads,
            self.kv_cache_spec.num_kv_heads,
            self.device,
            workspace=self.workspace,
            config=TQAttentionConfig(decode_kernel=self.tq_config.decode_kernel),
        )

    def warmup_kernels(
        self,
        kv_cache: torch.Tensor,
        dtype: torch.dtype,
        centering: KeyCentering | None = None,
    ) -> int:
        """Compile every kernel variant of every layer variant before serving (see
        turboquant_core.ops.kernel_warmup.warmup_kernels); writes only the null block 0."""
        per_token = self.layout.fmt.bytes_per_token_per_head(self.layout.head_dim)
        layout = paged_layout(
            self.layout.fmt, self.layout.head_dim, kv_cache.shape[-1] // per_token
        )
        launches = 0
        # With prefill from the cache, chunks never take the context path.
        paths = ("decode", "prefill" if self.tq_config.prefill_from_cache else "context")
        threshold = self.reorder_batch_threshold or 1
        decode_query_lens = (1, threshold) if threshold > 1 else (1,)
        for num_heads, window, scale in self.plans:
            gather = ("gather",) if window is None and self.context_keys is not None else ()
            launches += len(
                warmup_kernels(
                    kv_cache,
                    layout,
                    num_heads,
                    self.kv_cache_spec.num_kv_heads,
                    dtype=dtype,
                    sliding_window=window,
                    softmax_scale=scale,
                    centering=centering,
                    decode_query_lens=decode_query_lens,
                    paths=paths + gather,
                    config=TQAttentionConfig(decode_kernel=self.tq_config.decode_kernel),
                )
            )
        return launches

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TQAttentionMetadata:
        # The captured launch keeps its split count for every replay: size it for
        # the longest sequence the model serves, not for the dummy capture batch.
        return self._build(common_attn_metadata, decode_max_seq_len=self.max_model_len)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TQAttentionMetadata:
        return self._build(common_attn_metadata, common_attn_metadata.max_seq_len)

    def _build(
        self, cam: CommonAttentionMetadata, decode_max_seq_len: int
    ) -> TQAttentionMetadata:
        assert self.reorder_batch_threshold is not None
        # CPU-only split (query_start_loc_cpu): no device sync.
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold
        )
        num_reqs = cam.num_reqs
        qsl_cpu = cam.query_start_loc_cpu

        # Queries per decode: 1, else the threshold (one compiled variant for every
        # verification batch, whatever its drafts' lengths).
        decode_query_len = 1
        if num_decode_tokens > num_decodes:
            decode_query_len = self.reorder_batch_threshold
        if num_decodes > 0:
            for (_, window, scale), plans in self.plans.items():
                plans.decode.plan(
                    cam.block_table_tensor[:num_decodes],
                    cam.query_start_loc[: num_decodes + 1],
                    cam.seq_lens[:num_decodes],
                    num_tokens=num_decode_tokens,
                    max_query_len=decode_query_len,
                    max_seq_len=decode_max_seq_len,
                    causal=True,
                    sliding_window=window,
                    softmax_scale=scale,
                )

        metadata = TQAttentionMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_query_len=decode_query_len,
            num_prefills=num_prefills,
            num_prefill_tokens=0,
            slot_mapping=cam.slot_mapping,
            plans=self.plans,
            query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            center_sums=self.center_sums,
            kept_center_sums=self.kept_center_sums,
        )
        if num_prefills == 0:
            return metadata

        first, end = num_decodes, num_reqs
        query_lens_cpu = qsl_cpu[first + 1 : end + 1] - qsl_cpu[first:end]
        metadata.num_prefill_tokens = int(qsl_cpu[end] - qsl_cpu[first])
        metadata.max_prefill_query_len = int(query_lens_cpu.max())
        metadata.prefill_query_start_loc = (
            cam.query_start_loc[first : end + 1] - num_decode_tokens
        )
        upper = cam.seq_lens_cpu_upper_bound
        if self.tq_config.prefill_from_cache:
            # The store ran before attention: each chunk's queries are the last tokens
            # of its stored sequence, as for decode (causal over the whole sequence).
            metadata.prefill_from_cache = True
            kv_lens = cam.seq_lens[first:end]
            max_kv_len = (
                int(upper[first:end].max()) if upper is not None else cam.max_seq_len
            )
            max_query_len = max(metadata.max_prefill_query_len, PREFILL_MIN_QUERY_LEN)
        else:
            # Context = tokens computed before this step. The CPU upper bound of
            # seq_lens is exact for prefill rows; without it, assume context.
            if upper is not None:
                max_kv_len = int((upper[first:end] - query_lens_cpu).max())
            else:
                max_kv_len = cam.max_seq_len
            metadata.prefill_has_context = max_kv_len > 0
            if not metadata.prefill_has_context:
                return metadata
            query_lens = (
                cam.query_start_loc[first + 1 : end + 1]
                - cam.query_start_loc[first:end]
            )
            kv_lens = (cam.seq_lens[first:end] - query_lens).to(torch.int32)
            max_query_len = metadata.max_prefill_query_len
            if upper is not None:
                metadata.context_gather = self._context_gather(
                    cam, first, end, upper[first:end] - query_lens_cpu, query_lens_cpu,
                    kv_lens, metadata.max_prefill_query_len,
                )
        for (_, window, scale), plans in self.plans.items():
            if window is None and metadata.context_gather is not None:
                continue
            plans.context.plan(
                cam.block_table_tensor[first:end],
                metadata.prefill_query_start_loc,
                kv_lens,
                num_tokens=metadata.num_prefill_tokens,
                max_query_len=max_query_len,
                max_seq_len=max_kv_len,
                causal=metadata.prefill_from_cache,
                sliding_window=window,
                softmax_scale=scale,
            )
        return metadata

    def _context_gather(
        self,
        cam: CommonAttentionMetadata,
        first: int,
        end: int,
        context_lens_cpu: torch.Tensor,
        query_lens_cpu: torch.Tensor,
        context_lens: torch.Tensor,
        max_query_len: int,
    ) -> TQContextGather | None:
        """The prefill requests [first, end) as one FlashAttention pass over their
        dequantized context and fresh tokens, when the chunks are long enough and the
        rows fit the workspace (host tensors exact: no device sync)."""
        if self.context_keys is None or max_query_len < self.CONTEXT_GATHER_MIN_QUERY_LEN:
            return None
        seq_lens_cpu = context_lens_cpu + query_lens_cpu
        rows = int(seq_lens_cpu.sum())
        if rows > self.context_keys.shape[0]:
            return None
        cu = torch.zeros(end - first + 1, dtype=torch.int32)
        torch.cumsum(seq_lens_cpu, 0, out=cu[1:])
        # Fresh token j of request r goes after all context rows up to r's own.
        fresh_rows = torch.arange(int(query_lens_cpu.sum())) + torch.repeat_interleave(
            torch.cumsum(context_lens_cpu, 0), query_lens_cpu
        )
        dev = self.device
        return TQContextGather(
            keys=self.context_keys[:rows],
            values=self.context_values[:rows],
            cu_seqlens_k=cu.to(dev, non_blocking=True),
            context_lens=context_lens,
            fresh_rows=fresh_rows.to(dev, non_blocking=True),
            block_table=cam.block_table_tensor[first:end],
            max_context_len=int(context_lens_cpu.max()),
            max_seqlen_k=int(seq_lens_cpu.max()),
        )


class TQAttentionImpl(AttentionImpl[TQAttentionMetadata]):
    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args,
    ) -> None:
        check_tq_dtype(kv_cache_dtype)
        if head_size not in ATTENTION_HEAD_DIMS:
            raise ValueError(
                f"TurboQuant attention supports head sizes {ATTENTION_HEAD_DIMS}, "
                f"got {head_size}"
            )
        if alibi_slopes is not None:
            raise NotImplementedError("TurboQuant attention does not support ALiBi")
        if logits_soft_cap:
            raise NotImplementedError(
                "TurboQuant attention does not support attention logit soft-capping "
                f"(logits_soft_cap={logits_soft_cap})"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                "TurboQuant attention supports decoder self-attention only, "
                f"got {attn_type}"
            )
        if kv_sharing_target_layer_name is not None:
            # Prefill reads the fresh K/V of the layer itself, which a layer that
            # borrows another layer's cache does not have.
            raise NotImplementedError(
                "TurboQuant attention does not support cross-layer KV sharing"
            )
        if extra_impl_args.get("sinks") is not None:
            raise NotImplementedError(
                "TurboQuant attention does not support attention sinks"
            )

        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.fmt = get_format(kv_cache_dtype)
        if not is_flash_attn_varlen_func_available():
            raise RuntimeError(
                "TurboQuant attention needs vLLM's FlashAttention for prefill"
            )
        self.fa_version = get_flash_attn_version(head_size=head_size)
        # FlashAttention's window is (left, right) inclusive of the query itself.
        self.fa_window = None if sliding_window is None else [sliding_window - 1, 0]
        self._plan_key = (num_heads, sliding_window, self.scale)
        self._layouts: dict[int, PagedTQLayout] = {}
        # The engine's TurboQuant options (vLLM sets the current config while it
        # builds the model's layers; without one, the defaults).
        self.tq_config = TQConfig.from_vllm(get_current_vllm_config_or_none())
        # Set before serving by attach_key_centering (needs the model's RoPE) when
        # self.tq_config.key_centering is on.
        self.key_centering: KeyCentering | None = None

    def _layout_for(self, kv_cache: torch.Tensor) -> PagedTQLayout:
        """Page layout of this layer's cache, from its (host-known) shape."""
        head_page_bytes = kv_cache.shape[-1]
        layout = self._layouts.get(head_page_bytes)
        if layout is None:
            per_token = self.fmt.bytes_per_token_per_head(self.head_size)
            layout = paged_layout(
                self.fmt, self.head_size, head_page_bytes // per_token
            )
            if layout.head_page_bytes != head_page_bytes:
                raise ValueError(
                    f"KV cache with {head_page_bytes} bytes per (block, head) does not "
                    f"match {self.kv_cache_dtype} at head size {self.head_size}"
                )
            self._layouts[head_page_bytes] = layout
        return layout

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # slot_mapping covers the real tokens; key/value may carry padding rows.
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        md = _layer_metadata(layer) if self.key_centering is not None else None
        if md is None:
            # (profiling runs have no metadata and no cache contents to keep)
            tq_store(
                key[:num_tokens],
                value[:num_tokens],
                kv_cache,
                slot_mapping,
                self._layout_for(kv_cache),
            )
            return
        center_sums, kept = _center_sums_of(md, layer)
        tq_store(
            key[:num_tokens],
            value[:num_tokens],
            kv_cache,
            slot_mapping,
            self._layout_for(kv_cache),
            centering=self.key_centering,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            center_sums=center_sums,
            # single-token decodes only: the centres first, then K and V in one launch
            single_token_requests=md.num_prefills == 0 and md.decode_query_len == 1,
            **kept,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TQAttentionMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] (this step's tokens, bf16/fp16),
        kv_cache [num_blocks, Hkv, head_page_bytes] uint8 -> output [T, Hq, D]."""
        assert output is not None, "TurboQuant attention writes into a given output"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "fused output quantization is not supported by TurboQuant attention"
            )
        if attn_metadata is None:
            # Profiling run: no cache yet.
            return output.fill_(0)

        plans = attn_metadata.plans.get(self._plan_key)
        if plans is None:
            raise RuntimeError(
                f"no TurboQuant plan for layer variant {self._plan_key}; planned: "
                f"{sorted(attn_metadata.plans, key=str)}"
            )
        num_decode_tokens = attn_metadata.num_decode_tokens
        if num_decode_tokens > 0:
            plans.decode.run(
                query[:num_decode_tokens],
                kv_cache,
                out=output[:num_decode_tokens],
                **self._centering_args(
                    attn_metadata, layer, 0, attn_metadata.num_decodes
                ),
            )
        if attn_metadata.num_prefills > 0:
            self._prefill(
                layer, query, key, value, kv_cache, attn_metadata, plans, output
            )
        return output

    def _centering_args(
        self, md: TQAttentionMetadata, layer, first: int, end: int
    ) -> dict:
        if self.key_centering is None:
            return {}
        center_sums, _ = _center_sums_of(md, layer)
        return dict(centering=self.key_centering, center_sums=center_sums[first:end])

    def _prefill(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: TQAttentionMetadata,
        plans: TQLayerPlans,
        output: torch.Tensor,
    ) -> None:
        start = md.num_decode_tokens
        end = start + md.num_prefill_tokens
        q, k, v = query[start:end], key[start:end], value[start:end]
        out = output[start:end]
        first = md.num_decodes
        if md.prefill_from_cache:
            plans.context.run(
                q,
                kv_cache,
                out=out,
                **self._centering_args(md, layer, first, first + md.num_prefills),
            )
            return
        cu_seqlens = md.prefill_query_start_loc
        max_len = md.max_prefill_query_len
        has_context = md.prefill_has_context
        gather = md.context_gather
        if gather is not None and self.sliding_window is None:
            # Context dequantized next to the fresh K/V: one causal pass (the keys'
            # count exceeds the queries', so each query sees its context and the
            # chunk's tokens up to its own).
            tq_gather_dequant(
                kv_cache,
                self._layout_for(kv_cache),
                gather.block_table,
                gather.context_lens,
                gather.cu_seqlens_k,
                gather.keys,
                gather.values,
                max_seq_len=gather.max_context_len,
                **self._centering_args(md, layer, first, first + md.num_prefills),
            )
            gather.keys.index_copy_(0, gather.fresh_rows, k)
            gather.values.index_copy_(0, gather.fresh_rows, v)
            flash_attn_varlen_func(
                q=q,
                k=gather.keys,
                v=gather.values,
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=gather.cu_seqlens_k,
                max_seqlen_q=max_len,
                max_seqlen_k=gather.max_seqlen_k,
                softmax_scale=self.scale,
                causal=True,
                out=out,
                fa_version=self.fa_version,
            )
            return
        # Both partial results get the same contiguous [tokens, heads, head]
        # layout, as the merge kernel requires.
        fresh_out = (
            torch.empty(q.shape, dtype=q.dtype, device=q.device) if has_context else out
        )
        # Fresh tokens attend to each other in full precision.
        fresh = flash_attn_varlen_func(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_len,
            max_seqlen_k=max_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=self.fa_window,
            return_softmax_lse=has_context,
            out=fresh_out,
            fa_version=self.fa_version,
        )
        if not has_context:
            return
        fresh_lse = fresh[1]
        # Cached context [0, context_len) from the compressed pages; requests
        # without context give lse = -inf and drop out of the merge.
        context_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _, context_lse = plans.context.run(
            q,
            kv_cache,
            out=context_out,
            return_lse=True,
            **self._centering_args(md, layer, first, first + md.num_prefills),
        )
        # vLLM's fused merge writes straight into the output rows (no fp32
        # temporaries); lse tensors are [num_heads, num_tokens], natural log.
        merge_attn_states(out, context_out, context_lse, fresh_out, fresh_lse)


def _center_sums_of(
    md: TQAttentionMetadata, layer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sums ``layer``'s store writes and its attention reads, and the tq_store
    arguments that keep them across steps: the layer's own rows when its builder keeps
    them, else the group's scratch (recomputed every step) and none."""
    kept = md.kept_center_sums
    name = getattr(layer, "layer_name", None)
    rows = None if kept is None else kept.layers.get(name)
    if rows is None:
        return md.center_sums, {}
    sums, tags = rows
    return sums, dict(center_tags=tags, block_epochs=kept.block_epochs)


def _layer_metadata(layer) -> TQAttentionMetadata | None:
    """This step's metadata of ``layer`` from the forward context (None when absent)."""
    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # speculative decoding: [0] is the base model's
        md = md[0] if md else None
    if isinstance(md, dict):
        md = md.get(layer.layer_name)
    return md if isinstance(md, TQAttentionMetadata) else None

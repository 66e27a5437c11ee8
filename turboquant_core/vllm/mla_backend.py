# SPDX-License-Identifier: Apache-2.0
"""vLLM's TURBOQUANT_MLA attention backend: MLA layers (DeepSeek V2/V3 style) with a ``turboquant_*`` KV cache.

``AttentionBackendEnum.TURBOQUANT_MLA`` points here and the CUDA platform selects it for MLA models whose cache dtype
is a ``turboquant_*`` preset (patch 0011 of ``vllm_patches/v0.26.0``). vLLM's MLA layer (``MLAAttention``) and its
common implementation (``MLACommonImpl``: the absorbed decode query, W_UV, the dense prefill through the selected MLA
prefill backend, chunked context) stay as they are; this backend replaces what touches the cache:

- the page: one uint8 row ``[num_blocks, page_bytes]`` per layer (``ops.mla_layout.MLAPagedLayout``, the preset's
  ``formats.MLAFormat``: the latent with the preset's key encoding, k_pe in bf16), sized by ``TQMLAAttentionSpec``;
- the store (``do_kv_cache_update``, vLLM's ``concat_and_cache_mla`` contract): ``ops.mla.mla_store``;
- decode (``forward_mqa``): ``ops.mla.mla_decode_attention``, attention straight from the compressed pages with the
  absorbed query in the rotated domain, split-KV, all heads of a request sharing each page read; requests of up to
  ``MLA_DECODE_MAX_QUERY_LEN`` query tokens decode too, one causal row per token (``mla_decode_query_rows``, made by
  the metadata builder once per step); the latent's rotation is folded into the layer's absorbed weights W_UK_T and
  W_UV when vLLM makes them (``absorb_latent_basis``, called from ``MLAAttention.process_weights_after_loading``), so
  no rotation runs per step;
- the prefill context (``_gather_context_chunk``, vLLM's ``gather_and_maybe_dequant_cache`` contract):
  ``ops.mla.mla_gather_dequant`` into vLLM's chunked-context workspace, then vLLM's own MLA prefill path.

Not covered, refused at start-up: sparse (indexer) MLA, decode context parallelism, the TurboQuant options that act on
per-head keys (boundary layers kept in bf16, prefill from the cache).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.ops.triton_merge_attn_states import mask_empty_context
from vllm.v1.kv_cache_interface import KVQuantMode

from ..config import TQConfig
from ..formats import mla_format
from ..ops.mla import (
    MLA_DECODE_MAX_QUERY_LEN,
    mla_absorbed_weights,
    mla_decode_attention,
    mla_decode_kernel,
    mla_decode_query_rows,
    mla_decode_splits,
    mla_gather_dequant,
    mla_store,
    mla_warmup_kernels,
)
from ..ops.mla_layout import MLAPagedLayout, mla_kv_cache_shape, mla_paged_layout
from .backend import TQBackendTraits, check_tq_dtype
from .spec import TQMLAAttentionSpec

# Under vLLM's logger so that its logging configuration (handlers, VLLM_LOGGING_LEVEL) applies.
logger = init_logger(f"vllm.{__name__}")

# head_size (kv_lora_rank + rope_dim) -> (kv_lora_rank, rope_dim) of the MLA layers built in this process. vLLM shapes
# a cache from its head size alone (get_kv_cache_shape), which does not tell the two parts apart; the layers know.
_MLA_DIMS: dict[int, tuple[int, int]] = {}
_MLA_DIMS_WITHOUT_A_LAYER = {576: (512, 64)}  # DeepSeek V2/V3, Kimi K2


def register_mla_dims(kv_lora_rank: int, rope_dim: int) -> None:
    """Record the (kv_lora_rank, rope_dim) split of an MLA layer's head size for ``mla_dims``."""
    head_size = kv_lora_rank + rope_dim
    known = _MLA_DIMS.setdefault(head_size, (kv_lora_rank, rope_dim))
    if known != (kv_lora_rank, rope_dim):
        raise ValueError(
            f"two MLA layer shapes with head size {head_size}: {known} and {(kv_lora_rank, rope_dim)}"
        )


def mla_dims(head_size: int) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) of the MLA layers whose cache head size is ``head_size``."""
    found = _MLA_DIMS.get(head_size, _MLA_DIMS_WITHOUT_A_LAYER.get(head_size))
    if found is None:
        known = sorted({**_MLA_DIMS_WITHOUT_A_LAYER, **_MLA_DIMS})
        raise ValueError(
            f"no TurboQuant MLA layer with head size {head_size} was built; known head sizes: "
            f"{', '.join(map(str, known))}"
        )
    return found


def tq_mla_kv_cache_spec(layer, vllm_config: VllmConfig) -> TQMLAAttentionSpec:
    """The KV-cache spec of vLLM MLA layer ``layer`` (``MLAAttention``) with a ``turboquant_*`` cache dtype: one page
    is ``MLAPagedLayout.page_bytes`` for the block size."""
    check_tq_dtype(layer.kv_cache_dtype, "TURBOQUANT_MLA")
    register_mla_dims(layer.kv_lora_rank, layer.qk_rope_head_dim)
    return TQMLAAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=layer.head_size,
        dtype=torch.uint8,
        cache_dtype_str=layer.kv_cache_dtype,
        kv_quant_mode=KVQuantMode.NONE,
        tq_kv_lora_rank=layer.kv_lora_rank,
    )


class TQMLABackend(TQBackendTraits, MLACommonBackend):
    """MLA attention over a TurboQuant-compressed paged latent cache."""

    @staticmethod
    def get_name() -> str:
        # Must stay an AttentionBackendEnum member name.
        return "TURBOQUANT_MLA"

    @staticmethod
    def get_impl_cls() -> type[TQMLAImpl]:
        return TQMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TQMLAMetadataBuilder]:
        return TQMLAMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """(num_blocks, page_bytes), uint8."""
        check_tq_dtype(cache_dtype_str, "TURBOQUANT_MLA")
        layout = mla_paged_layout(cache_dtype_str, block_size, *mla_dims(head_size))
        if layout.padding_bytes():
            # The spec prices a page as MLAPagedLayout.page_bytes of its own block size; a kernel block of another
            # size would not tile it.
            raise ValueError(
                f"{cache_dtype_str}: MLA block size {block_size} needs {layout.padding_bytes()} padding bytes per "
                f"page; use a block size that is a multiple of 16"
            )
        return mla_kv_cache_shape(num_blocks, layout)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (0, 1, 2) if include_num_layers_dimension else (0, 1)



@dataclass
class TQMLADecodeMetadata(MLACommonDecodeMetadata):
    # KV splits per request of this step's decode launch (host int: the grid).
    num_splits: int = 1


class TQMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # Pure single-token decode batches replay as full CUDA graphs (the decode launch
    # reads only persistent metadata buffers and makes no host sync); batches with
    # prefills or several query tokens per decode run piecewise, as with vLLM's other MLA backends.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # Requests of up to MLA_DECODE_MAX_QUERY_LEN query tokens (a chunked prompt's last ones beside decodes, draft
    # verification) decode from the pages, one row per token, instead of gathering their context for vLLM's prefill.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    reorder_batch_threshold: int = MLA_DECODE_MAX_QUERY_LEN

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.dcp_world_size > 1 or self.use_pcp:
            raise NotImplementedError(
                "TurboQuant MLA caches do not support decode or prefill context parallelism "
                f"(decode_context_parallel_size={self.dcp_world_size})"
            )
        self.max_model_len = vllm_config.model_config.max_model_len
        self._decode_max_seq_len: int | None = None
        self.layout = mla_paged_layout(
            vllm_config.cache_config.cache_dtype,
            kv_cache_spec.block_size,
            self.mla_dims.kv_lora_rank,
            self.mla_dims.qk_rope_head_dim,
        )
        logger.info_once(
            "TurboQuant MLA attention: %s, kv_lora_rank %d, rope %d, block %d, %d B per token "
            "(bf16 %d B), latent %s",
            vllm_config.cache_config.cache_dtype,
            self.mla_dims.kv_lora_rank,
            self.mla_dims.qk_rope_head_dim,
            kv_cache_spec.block_size,
            self.layout.fmt.bytes_per_token(),
            2 * (self.mla_dims.kv_lora_rank + self.mla_dims.qk_rope_head_dim),
            self.layout.fmt.latent.describe(),
        )
        self.decode_kernel = mla_decode_kernel(self.layout, device)  # fixed for the engine: sizes every step's splits

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> TQMLADecodeMetadata:
        longest = max_seq_len if self._decode_max_seq_len is None else self._decode_max_seq_len
        rows = seq_lens_device.shape[0]
        if num_decode_tokens != rows:
            # Requests with several query tokens: one causal row per token, made here once for all layers. New
            # tensors each step: never inside a captured graph (vLLM captures full graphs of one-token decodes only
            # for this backend's UNIFORM_SINGLE_TOKEN_DECODE).
            if self._decode_max_seq_len is not None:
                raise RuntimeError("TurboQuant MLA: a CUDA-graph capture of decodes with several query tokens")
            block_table_tensor, seq_lens_device = mla_decode_query_rows(
                block_table_tensor, seq_lens_device, query_start_loc_device, num_decode_tokens)
            rows = num_decode_tokens
        return TQMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            num_splits=mla_decode_splits(rows, self.num_heads, longest, self.device, self.decode_kernel),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> MLACommonMetadata:
        # The captured launch keeps its split count for every replay: size it for the
        # longest sequence the model serves, not for the dummy capture batch.
        self._decode_max_seq_len = self.max_model_len
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._decode_max_seq_len = None

    def warmup_kernels(self, kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int, scale: float,
                       rotated: bool = False) -> int:
        """Compile our kernels (``ops.mla.mla_warmup_kernels``: store, decode, split merge, context gather) and
        vLLM's context mask of the chunked-context prefill (``warmup_context_mask``) before serving; writes only the
        null block 0 (vLLM never hands it to a request). Returns the launches."""
        return (mla_warmup_kernels(kv_cache, self.layout, dtype, num_heads, scale, rotated)
                + warmup_context_mask(num_heads, kv_cache.device))


# (prefill tokens, prefill requests) of the context-mask warm-up: Triton specializes the token count (the LSE's head
# stride) and the request count on divisibility by 16, so these four cover every variant a step can make (a step
# masks only when some of its two or more prefills has no context in a chunk).
CONTEXT_MASK_SHAPES = ((16, 2), (17, 2), (16, 16), (17, 16))


def warmup_context_mask(num_heads: int, device: torch.device) -> int:
    """Compile vLLM's ``mask_empty_context`` kernel, which its MLA chunked-context prefill runs when a step continues a
    chunked prompt beside new ones, for every ``CONTEXT_MASK_SHAPES`` variant; returns the launches. Such a step comes
    with the first batch of prompts longer than a step's token budget (a continued prompt with more tokens left than
    ``MLA_DECODE_MAX_QUERY_LEN`` is a prefill), and the compile would hold it. Patch 0007 runs it for MLA models with
    any other cache too (``warmup.warmup_mla_context_mask``)."""
    for tokens, reqs in CONTEXT_MASK_SHAPES:
        lse = torch.zeros(num_heads, tokens, dtype=torch.float32, device=device)
        out = torch.zeros(tokens, num_heads, 8, dtype=torch.bfloat16, device=device)
        per_req = [1] * (reqs - 1) + [tokens - reqs + 1]
        starts = torch.tensor([0, *itertools.accumulate(per_req)], dtype=torch.int32, device=device)
        mask_empty_context(lse, out, starts, torch.zeros(reqs + 1, dtype=torch.int32, device=device))
    return len(CONTEXT_MASK_SHAPES)


class TQMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA specific arguments
        **mla_args,
    ) -> None:
        check_tq_dtype(kv_cache_dtype, "TURBOQUANT_MLA")
        if mla_args.get("indexer") is not None:
            raise NotImplementedError("TurboQuant MLA caches do not support sparse (indexer) MLA")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError(
                "TurboQuant MLA attention does not support ALiBi, sliding windows or logit soft-capping"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"TurboQuant MLA attention supports decoder self-attention only, got {attn_type}")
        super().__init__(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
            logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args,
        )
        tq_config = TQConfig.from_vllm(get_current_vllm_config_or_none())
        if tq_config.boundary_layers:
            raise NotImplementedError(
                f"--tq-boundary-layers {tq_config.boundary_layers}: MLA layers cannot keep some layers' latents in "
                "bf16 next to TurboQuant ones (one page size per model); leave it at 0"
            )
        if tq_config.prefill_from_cache:
            raise NotImplementedError(
                "--tq-prefill-from-cache is not supported on MLA layers (they prefill through vLLM's MLA prefill path)"
            )
        register_mla_dims(self.kv_lora_rank, self.qk_rope_head_dim)
        self.fmt = mla_format(kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)
        # The queries are rotated into the latent's domain in float32 by our launcher;
        # nothing is quantized to fp8 on the way in.
        self.supports_quant_query_input = False
        self._layouts: dict[int, MLAPagedLayout] = {}
        # Set by absorb_latent_basis: the layer's W_UK_T / W_UV carry the latent's rotation.
        self.rotation_folded = False

    def absorb_latent_basis(self, w_uk_t: torch.Tensor, w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's absorbed weights (W_UK_T [H, P, kv_lora_rank], W_UV [H, kv_lora_rank, V]) for this cache: with
        the latent's rotation folded in (``ops.mla.mla_absorbed_weights``), so that decode queries arrive rotated and
        the rotated-domain output goes straight to W_UV. Latent sizes that pad (not a power of two) keep vLLM's
        weights and rotate per step. Called by MLAAttention.process_weights_after_loading (patch 0011), each time it
        remakes them."""
        layout = mla_paged_layout(self.fmt, 16)  # (the rotation does not depend on the block size)
        try:
            folded = mla_absorbed_weights(layout, w_uk_t, w_uv)
        except ValueError as e:
            logger.info_once("TurboQuant MLA: the latent's rotation runs per decode step (%s)", e)
            self.rotation_folded = False
            return w_uk_t, w_uv
        self.rotation_folded = True
        return folded

    def layout_for(self, kv_cache: torch.Tensor) -> MLAPagedLayout:
        """Page layout of this layer's cache, from its (host-known) shape."""
        page_bytes = kv_cache.shape[-1]
        layout = self._layouts.get(page_bytes)
        if layout is None:
            per_token = self.fmt.bytes_per_token()
            layout = mla_paged_layout(self.fmt, page_bytes // per_token)
            if layout.page_bytes != page_bytes:
                raise ValueError(
                    f"MLA cache rows of {page_bytes} bytes are no {self.fmt.name} page ({per_token} B per token)"
                )
            self._layouts[page_bytes] = layout
        return layout

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.flatten()
        # slot_mapping covers the real tokens; kv_c / k_pe may carry CUDA-graph padding rows.
        n = slots.shape[0]
        mla_store(kv_c_normed[:n], k_pe.reshape(k_pe.shape[0], -1)[:n], kv_cache, slots, self.layout_for(kv_cache))

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            ql_nope, q_pe = q
        else:
            ql_nope, q_pe = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        num_splits = decode.num_splits if isinstance(decode, TQMLADecodeMetadata) else None
        return mla_decode_attention(
            ql_nope,
            q_pe,
            kv_c_and_k_pe_cache,
            self.layout_for(kv_c_and_k_pe_cache),
            decode.block_table,
            decode.seq_lens,
            self.scale,
            max_seq_len=attn_metadata.max_seq_len,
            num_splits=num_splits,
            rotated=self.rotation_folded,
        )

    def _gather_context_chunk(
        self,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        chunk_idx: int,
        k_scale: torch.Tensor,
        use_fp8_prefill: bool,
    ) -> None:
        prefill = attn_metadata.prefill
        assert prefill is not None and prefill.chunked_context is not None
        chunked = prefill.chunked_context
        mla_gather_dequant(
            kv_c_and_k_pe_cache,
            self.layout_for(kv_c_and_k_pe_cache),
            chunked.workspace,
            prefill.block_table,
            chunked.cu_seq_lens[chunk_idx],
            chunked.token_to_seq[chunk_idx],
            chunked.chunk_total_token[chunk_idx],
            seq_starts=chunked.starts[chunk_idx],
        )

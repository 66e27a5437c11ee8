# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weights for vLLM's linear layers and MoE experts (vLLM patch 0010 registers the names):
``--quantization tq3|tq4`` encodes a full-precision checkpoint at load; a checkpoint written by ``tq quantize``
(``quant_method`` "turboquant" in its config.json) loads as it is stored.

Each linear layer (``LinearBase``: the attention and MLP projections) loads its full-precision weight through the
loaders of vLLM's unquantized method, onto the meta device: vLLM's layerwise loading keeps a layer's shards until
the last arrives, materializes the layer and calls ``process_weights_after_loading``, which encodes it in the format
(``ops.weight_codec``: groups of 128 along the input dimension, rotated, Lloyd-Max indices + an fp16 scale) and
frees the full-precision tensor, so the model never exists whole in full precision. The forward pass is one
``turboquant::tq_linear`` op (``ops.linear``). Embeddings and the output head stay as they are, unless
``--tq-weights-lm-head`` asks for the head (``ParallelLMHead``, the logits' product) to be encoded alike (an input
slice that 128 does not divide gets a zero-padded last group). MoE experts (``FusedMoE``'s ``RoutedExperts``) are
encoded alike, expert by expert (``moe_method.TQFusedMoEMethod``).

``TQCheckpointConfig`` reads the checkpoint's ``quantization_config`` (checked against the format table: a
checkpoint that disagrees with its format, or a version this code does not know, is refused) and gives every
converted linear layer ``weight_packed`` and ``weight_scale`` parameters that vLLM's loaders shard like any group-
quantized weight (output rows for column-parallel layers and fused q/k/v or gate/up shards, groups of the input
for row-parallel ones). MoE experts load as stored too (``moe_method.TQPackedFusedMoEMethod``: vLLM's expert loader
maps ``experts.N.gate_proj|up_proj|down_proj.weight_packed`` / ``.weight_scale`` to ``w13_weight_packed`` /
``w2_weight_packed`` and their scales, shard by shard, and the layer runs ``TQFusedMoEMethod``'s kernel). A layer
whose experts ``tq quantize`` did not convert (all of them in ``modules_not_converted``, or stored in a form it does
not convert) gets vLLM's unquantized experts; one whose experts are partly converted is refused, and so are the
converted experts of a version 1 checkpoint (stored in a layout vLLM's expert loader cannot read). Routers
(``ROUTER_GATES``) stay in full precision, as ``tq quantize`` leaves them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from ..formats import WEIGHT_FORMATS, WeightFormat, get_weight_format
from ..integrations.quantize_checkpoint import ROUTER_GATES  # MoE routers: full precision, online and in checkpoints
from ..ops.linear import tq_linear_op
from .moe_method import TQFusedMoEMethod, TQPackedFusedMoEMethod


class _TQQuantizationConfig(QuantizationConfig):
    """What the TurboQuant weight methods share: fp16/bf16 activations, Ampere or newer (the kernel's
    tensor-core products), nothing to read beyond config.json."""

    def __init__(self) -> None:
        super().__init__()
        self._decode_int8_option: bool | None = None  # --tq-weights-decode-int8, read at the first layer

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    def _decode_int8(self) -> bool:
        """The engine's ``--tq-weights-decode-int8`` (``TQConfig.weights_decode_int8``), read at the first layer."""
        if self._decode_int8_option is None:
            from vllm.config import get_current_vllm_config

            from ..config import TQConfig

            self._decode_int8_option = TQConfig.from_vllm(get_current_vllm_config()).weights_decode_int8
        return self._decode_int8_option


class TQWeightConfig(_TQQuantizationConfig):
    """The base of ``TQ3Config`` and ``TQ4Config`` (one format each)."""

    format_name: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.fmt: WeightFormat = get_weight_format(self.format_name)
        self._encode_head: bool | None = None  # --tq-weights-lm-head, read at the first layer

    def get_name(self) -> str:
        return self.format_name

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TQWeightConfig:
        method = config.get("quant_method", "?")
        raise ValueError(f"--quantization {cls.format_name} encodes a full-precision checkpoint at load, but this "
                         f"checkpoint is already quantized ({method}); serve it without --quantization, or start "
                         "from its full-precision weights")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        encode_head = self._encodes_output_head()
        if isinstance(layer, LinearBase):
            if prefix.rpartition(".")[2] in ROUTER_GATES:
                return UnquantizedLinearMethod()
            return TQLinearMethod(self.fmt, prefix, self._decode_int8())
        if isinstance(layer, RoutedExperts):
            return TQFusedMoEMethod(self.fmt, layer, prefix)
        if isinstance(layer, ParallelLMHead) and encode_head:
            return TQLinearMethod(self.fmt, prefix, self._decode_int8())
        return None

    def _encodes_output_head(self) -> bool:
        """Whether the engine's options (``--tq-weights-lm-head``, ``TQConfig.weights_lm_head``) ask for the output
        head to be encoded, read once, at the model's first layer; a model whose head shares the input embedding's
        weight is refused then (some models never build a head of their own when it does)."""
        if self._encode_head is None:
            from vllm.config import get_current_vllm_config

            from ..config import TQConfig

            vllm_config = get_current_vllm_config()
            encode = TQConfig.from_vllm(vllm_config).weights_lm_head
            text_config = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
            if encode and getattr(text_config, "tie_word_embeddings", False):
                raise ValueError("--tq-weights-lm-head: this model's output head shares the input embedding's weight "
                                 f"(tie_word_embeddings), which --quantization {self.fmt.name} leaves as it is; serve "
                                 "it without --tq-weights-lm-head")
            self._encode_head = encode
        return self._encode_head


class TQ4Config(TQWeightConfig):
    format_name = "tq4"


class TQ3Config(TQWeightConfig):
    format_name = "tq3"


class TQLinearMethod(LinearMethodBase):
    """A linear layer whose weight is encoded in ``fmt`` once loaded (see the module docstring)."""

    # The full-precision weight is created on the meta device; vLLM's layerwise loading (model_loader.reload)
    # materializes a layer when its shards arrive and calls process_weights_after_loading as soon as all have: one
    # layer at a time exists in full precision, never the whole model.
    uses_meta_device = True

    def __init__(self, fmt: WeightFormat, prefix: str = "", decode_int8: bool = True):
        self.fmt, self.prefix, self.decode_int8 = fmt, prefix, decode_int8

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

        # The full-precision weight loads exactly as with the unquantized method (same loaders, same sharding).
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype, device="meta"),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from ..ops.weight_codec import quantize_weight, served_layout

        if not layer.weight.dtype.is_floating_point:  # encoded when its last shard loaded (layerwise), or earlier
            return
        q = served_layout(quantize_weight(layer.weight.data, self.fmt))
        # The packed indices (as the kernels take them) take the weight's place; the full-precision tensor is freed.
        layer.weight = torch.nn.Parameter(q.packed, requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(q.scales, requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return tq_linear_op(x, layer.weight, layer.weight_scale, self.fmt.name, bias, self.decode_int8)

    def dequantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The encoded weight decoded [out, in] (fp32): what the layer computes with (key smoothing's row norms)."""
        from ..ops.weight_codec import TQWeight, dequantize_weight

        return dequantize_weight(TQWeight(self.fmt.name, layer.weight, layer.weight_scale,
                                          layer.input_size_per_partition))


CHECKPOINT_METHOD = "turboquant"
CHECKPOINT_VERSIONS = (1, 2)
EXPERTS_SINCE_VERSION = 2  # version 1 stored experts' packed indices 3-D, which vLLM's expert loader takes as fused


class TQCheckpointConfig(_TQQuantizationConfig):
    """A checkpoint written by ``tq quantize`` (``turboquant_core.integrations.quantize_checkpoint``)."""

    def __init__(self, fmt: WeightFormat, not_converted: Iterable[str], quantized: Iterable[str] = (),
                 version: int = CHECKPOINT_VERSIONS[-1]) -> None:
        super().__init__()
        self.fmt, self.not_converted, self.quantized, self.version = fmt, set(not_converted), set(quantized), version

    def get_name(self) -> str:
        return CHECKPOINT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TQCheckpointConfig:
        name = config.get("format")
        if name not in WEIGHT_FORMATS:
            raise ValueError(f"TurboQuant checkpoint: unknown weight format {name!r}; valid formats: "
                             f"{', '.join(WEIGHT_FORMATS)}")
        if config.get("version") not in CHECKPOINT_VERSIONS:
            raise ValueError(f"TurboQuant checkpoint: version {config.get('version')!r} is not one this code reads "
                             f"({', '.join(map(str, CHECKPOINT_VERSIONS))})")
        fmt = get_weight_format(name)
        want = {"bits": fmt.bits, "group_size": fmt.group_size, "rotation_seed": fmt.seed, "packing": fmt.packing}
        wrong = [f"{k} {config.get(k)!r} (the format's: {v!r})" for k, v in want.items() if config.get(k) != v]
        if wrong:
            raise ValueError(f"TurboQuant checkpoint: its config disagrees with format {name}: {', '.join(wrong)}")
        return cls(fmt, list(config.get("modules_not_converted", [])), list(config.get("quantized", [])),
                   config["version"])

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return None
        parent, _, last = prefix.rpartition(".")
        if last in ROUTER_GATES:
            return UnquantizedLinearMethod()
        shards = [f"{parent}.{s}" if parent else s for s in self.packed_modules_mapping.get(last, [last])]
        kept = [s in self.not_converted for s in shards]
        if all(kept):
            return UnquantizedLinearMethod()
        if any(kept):
            raise ValueError(f"TurboQuant checkpoint: {prefix} fuses {', '.join(shards)}, of which only some are "
                             "quantized; quantize them alike (tq quantize --keep all or none of them)")
        return TQPackedLinearMethod(self.fmt, prefix, self._decode_int8())

    def _experts_method(self, layer: RoutedExperts, prefix: str) -> QuantizeMethodBase:
        """A MoE layer's experts (``prefix``: ``...experts``; the checkpoint names their projections
        ``prefix.N.<projection>``, listed in ``quantized`` or ``modules_not_converted``): all converted
        (``TQPackedFusedMoEMethod``), none (vLLM's unquantized experts: kept by ``--keep``, or stored in a form
        ``tq quantize`` does not convert, such as experts fused into 3-D tensors) or refused."""
        inside = f"{prefix}."
        kept = sorted(m for m in self.not_converted if m.startswith(inside))
        converted = sorted(m for m in self.quantized if m.startswith(inside))
        if kept and converted:
            raise ValueError(f"TurboQuant checkpoint: the experts of MoE layer {prefix} are partly quantized "
                             f"({len(converted)} projections, e.g. {converted[0]}; {len(kept)} kept, e.g. {kept[0]}); "
                             "quantize a layer's experts alike (tq quantize --keep all or none of them)")
        if not converted:
            return UnquantizedFusedMoEMethod(layer.moe_config)
        if self.version < EXPERTS_SINCE_VERSION:
            raise ValueError(f"TurboQuant checkpoint: version {self.version} stored the experts of MoE layer {prefix} "
                             "in a layout vLLM's expert loader cannot read; quantize the model again with this "
                             f"tq quantize (version {CHECKPOINT_VERSIONS[-1]})")
        return TQPackedFusedMoEMethod(self.fmt, layer, prefix)


class TQPackedLinearMethod(LinearMethodBase):
    """A linear layer stored in ``fmt`` in the checkpoint: ``weight_packed`` and ``weight_scale`` as written."""

    def __init__(self, fmt: WeightFormat, prefix: str = "", decode_int8: bool = True):
        self.fmt, self.prefix, self.decode_int8 = fmt, prefix, decode_int8

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        gs = self.fmt.group_size
        if input_size_per_partition != input_size and input_size_per_partition % gs:
            raise ValueError(f"TurboQuant checkpoint: {self.prefix} has {input_size_per_partition} inputs per "
                             f"tensor-parallel rank, not a multiple of the group size {gs}; use fewer ranks")
        weight_loader = extra_weight_attrs.pop("weight_loader")
        rows, groups = sum(output_partition_sizes), self.fmt.groups(input_size_per_partition)
        packed = ModelWeightParameter(
            data=torch.empty(rows, groups, gs * self.fmt.bits // 8, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        scale = GroupQuantScaleParameter(
            data=torch.empty(rows, groups, dtype=torch.float16), input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight_packed", packed)
        layer.register_parameter("weight_scale", scale)
        set_weight_attrs(packed, extra_weight_attrs)
        set_weight_attrs(scale, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from ..ops.weight_codec import TQWeight, served_layout

        if layer.weight_packed.dtype != torch.uint8:  # already served
            return
        w = served_layout(TQWeight(self.fmt.name, layer.weight_packed.data, layer.weight_scale.data,
                                   layer.input_size_per_partition))
        layer.weight_packed = torch.nn.Parameter(w.packed, requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return tq_linear_op(x, layer.weight_packed, layer.weight_scale, self.fmt.name, bias, self.decode_int8)

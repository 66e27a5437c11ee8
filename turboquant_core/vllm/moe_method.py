# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weights for vLLM 0.26's MoE experts under ``--quantization tq3|tq4`` (``quant_config.TQWeightConfig``
returns ``TQFusedMoEMethod`` for the ``RoutedExperts`` module that ``FusedMoE`` builds to hold a layer's expert
weights) and in checkpoints written by ``tq quantize`` (``TQPackedFusedMoEMethod``, last paragraph).

The experts load their full-precision weights as vLLM's unquantized method does (``w13_weight`` [E, 2 I, H]: gate
rows then up rows, ``w2_weight`` [E, H, I], vLLM's loaders and tensor-parallel sharding unchanged); once the layer is
loaded, ``process_weights_after_loading`` encodes them expert by expert in the format (``ops.moe_linear.TQExperts``:
each expert like one TurboQuant linear weight, groups of 128 along its input dimension) and frees the full-precision
tensors: ``w13_weight`` / ``w2_weight`` become the packed indices (uint8 [E, rows, G, 16 * bits]) and
``w13_weight_scale`` / ``w2_weight_scale`` the fp16 scales [E, rows, G].

vLLM's runner routes (its router: top-k ids and weights, renormalisation, scaling factor, grouped top-k) and runs
shared experts; ``apply`` takes the routed tokens through ``ops.moe_linear.tq_fused_moe``: vLLM's
``moe_align_block_size`` layout, the w13 kernel, vLLM's SiLU-and-mul, the w2 kernel with the router weights, the sum
over the top-k (on the CPU, where vLLM's two ops do not exist, their plain-torch twins). The experts are not one of
vLLM's modular kernels: there is no ``FusedMoEQuantConfig`` and no prepare/finalize of its own
(``maybe_make_prepare_finalize`` finds none without expert parallelism), which is what the runner expects of a method
without one.

Covered: gated SiLU experts (``activation="silu"``) without biases, tensor and data parallelism (the runner's naive
dispatch), the router weight on either product (``apply_router_weight_on_input``). Refused at start-up with the
layer's name: other activations, expert biases, SwiGLU limits or scales, expert parallelism and EPLB, LoRA on the
experts.

A checkpoint written by ``tq quantize`` (``quant_config.TQCheckpointConfig``) stores each expert's projections
already encoded: ``experts.N.gate_proj`` / ``up_proj`` / ``down_proj`` (or the model's names for them) as
``weight_packed`` uint8 [out, G * 16 * bits] (the indices of ``ops.weight_codec.TQWeight`` with the group axis
flattened into the bytes: vLLM's expert loader takes any 3-D tensor for all of a layer's experts fused) and
``weight_scale`` float16 [out, G]. vLLM's expert mapping (``RoutedExperts.build_expert_params_mapping``) turns
``experts.N.gate_proj.weight_packed`` into the parameter ``w13_weight_packed``, shard w1 of expert N (it replaces
``experts.N.gate_proj.`` by ``experts.w13_``, or ``experts.routed_experts.w13_`` in models that map names
themselves through ``make_expert_params_mapping``; up_proj: w13, shard w3; down_proj: w2, shard w2);
``TQPackedFusedMoEMethod`` creates ``w13_weight_packed`` [E, 2 I, G * 16 * bits], ``w13_weight_scale`` [E, 2 I, G],
``w2_weight_packed`` [E, H, G' * 16 * bits] and ``w2_weight_scale`` [E, H, G'] and lets vLLM's expert loader fill
them (``RoutedExperts.weight_loader``, the path of group-quantized experts: gate rows, then up rows of w13, each
the rank's slice of the output rows under tensor parallelism; w2 the rank's slice of the input groups, which needs
the rank's intermediate size to be a multiple of 128). Once loaded, the packed tensors are viewed as
[E, rows, G, 16 * bits]: the tensors ``TQFusedMoEMethod`` encodes at load, run by the same ``apply``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import (
    FusedMoEMethodBase,
    FusedMoeWeightScaleSupported,
    MoEActivation,
    RoutedExperts,
    apply_moe_activation,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
from vllm.model_executor.utils import set_weight_attrs

from ..formats import WeightFormat
from ..ops.moe_linear import TQExperts, quantize_experts, tq_fused_moe

SUPPORTED = ("gated SiLU experts without biases, tensor or data parallelism (no expert parallelism or EPLB), "
             "no LoRA on the experts")


def _silu_and_mul_cuda(h: torch.Tensor) -> torch.Tensor:
    """vLLM's fused SiLU-and-mul (one pass; a CUDA op): what its Triton MoE experts run between the products."""
    out = h.new_empty(h.shape[0], h.shape[1] // 2)
    apply_moe_activation(MoEActivation.SILU, out, h)
    return out


def unsupported_moe_features(layer: RoutedExperts) -> list[str]:
    """What of ``layer``'s configuration the TurboQuant experts do not cover (empty: all of it is)."""
    moe = layer.moe_config
    parallel = moe.moe_parallel_config
    out = []
    if moe.activation != MoEActivation.SILU:
        out.append(f"activation {moe.activation.value!r}")
    if moe.has_bias:
        out.append("expert biases")
    limits = [n for n in ("swiglu_limit", "swiglu_alpha", "swiglu_beta") if getattr(layer, n, None) is not None]
    if limits:
        out.append(f"SwiGLU {', '.join(limits)}")
    if parallel.use_ep or parallel.enable_eplb:
        out.append("expert parallelism" + (" with EPLB" if parallel.enable_eplb else ""))
    if moe.is_lora_enabled:
        out.append("LoRA")
    return out


class TQFusedMoEMethod(FusedMoEMethodBase):
    """The experts of one MoE layer, encoded in ``fmt`` once loaded (see the module docstring)."""

    packed_name = "weight"  # the encoded indices are ``w13_<packed_name>`` and ``w2_<packed_name>``

    def __init__(self, fmt: WeightFormat, layer: RoutedExperts, prefix: str = ""):
        super().__init__(layer.moe_config)
        self.fmt, self.prefix = fmt, prefix
        unsupported = unsupported_moe_features(layer)
        if unsupported:
            source, remedy = self.origin()
            raise ValueError(f"{source}: MoE layer {prefix or layer.layer_name} uses {'; '.join(unsupported)}, "
                             f"which TurboQuant experts do not cover (supported: {SUPPORTED}); {remedy}")

    def origin(self) -> tuple[str, str]:
        """Where the encoded experts come from and what to do instead when they cannot be served (refusals)."""
        return f"--quantization {self.fmt.name}", f"serve this model without --quantization {self.fmt.name}"

    # Online: the full-precision experts are created on the meta device and encoded layer by layer as vLLM's
    # layerwise loading completes each (as ``quant_config.TQLinearMethod``); checkpoints load packed (False there).
    uses_meta_device = True

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing

        # The full-precision experts load exactly as with vLLM's unquantized method (same loaders, same sharding).
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size_per_partition
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate_size_per_partition, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, intermediate_size_per_partition))):
            param = torch.nn.Parameter(torch.empty(*shape, dtype=params_dtype, device="meta"), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("w13", "w2"):
            weight = getattr(layer, f"{name}_weight")
            if weight.dtype == torch.uint8:  # encoded already
                continue
            q = quantize_experts(weight.data, self.fmt)
            # The packed indices take the weight's place; the full-precision tensor is freed here.
            setattr(layer, f"{name}_weight", torch.nn.Parameter(q.packed, requires_grad=False))
            setattr(layer, f"{name}_weight_scale", torch.nn.Parameter(q.scales, requires_grad=False))
            del weight, q

    def experts(self, layer: torch.nn.Module) -> tuple[TQExperts, TQExperts]:
        """The layer's encoded (w13, w2)."""
        w13, w2 = (getattr(layer, f"{name}_{self.packed_name}") for name in ("w13", "w2"))
        return (TQExperts(self.fmt.name, w13, layer.w13_weight_scale, self.hidden_size),
                TQExperts(self.fmt.name, w2, layer.w2_weight_scale, self.intermediate_size))

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        return None  # not one of vLLM's modular kernels (module docstring)

    def apply(self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        # vLLM's routing layout and activation on a GPU; their plain-torch twins elsewhere (both are CUDA ops)
        cuda = x.is_cuda
        w13, w2 = self.experts(layer)
        return tq_fused_moe(x, w13, w2, topk_weights, topk_ids,
                            apply_router_weight_on_input=layer.apply_router_weight_on_input,
                            align=moe_align_block_size if cuda else None, act=_silu_and_mul_cuda if cuda else None)


class TQPackedFusedMoEMethod(TQFusedMoEMethod):
    """The experts of one MoE layer stored in ``fmt`` in a ``tq quantize`` checkpoint: loaded as stored, run as
    ``TQFusedMoEMethod`` runs its experts (see the module docstring)."""

    packed_name = "weight_packed"
    uses_meta_device = False

    def origin(self) -> tuple[str, str]:
        return ("TurboQuant checkpoint", "quantize the model again with its experts kept in full precision "
                "(tq quantize --keep '*.experts.*')")

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        fmt, inter = self.fmt, intermediate_size_per_partition
        if layer.moe_config.moe_parallel_config.tp_size > 1 and inter % fmt.group_size:
            raise ValueError(f"TurboQuant checkpoint: MoE layer {self.prefix or layer.layer_name} has {inter} expert "
                             "intermediate features (down_proj inputs) per tensor-parallel rank, not a multiple of "
                             f"the group size {fmt.group_size}; use fewer ranks")
        self.hidden_size, self.intermediate_size = hidden_size, inter
        group_bytes = fmt.group_size * fmt.bits // 8
        # vLLM's expert loader fills each expert's shard (w1, w3: output rows; w2: input groups, the flattened
        # bytes' dimension 1) as it fills group-quantized experts; the scales say so with quant_method "group".
        scale_attrs = {**extra_weight_attrs, "quant_method": FusedMoeWeightScaleSupported.GROUP.value}
        for name, rows, inputs in (("w13", 2 * inter, hidden_size), ("w2", hidden_size, inter)):
            groups = fmt.groups(inputs)
            packed = torch.nn.Parameter(torch.empty(num_experts, rows, groups * group_bytes, dtype=torch.uint8),
                                        requires_grad=False)
            scale = torch.nn.Parameter(torch.empty(num_experts, rows, groups, dtype=torch.float16),
                                       requires_grad=False)
            layer.register_parameter(f"{name}_weight_packed", packed)
            layer.register_parameter(f"{name}_weight_scale", scale)
            set_weight_attrs(packed, extra_weight_attrs)
            set_weight_attrs(scale, scale_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        group_bytes = self.fmt.group_size * self.fmt.bits // 8
        for name in ("w13", "w2"):
            packed = getattr(layer, f"{name}_weight_packed")
            if packed.dim() == 3:  # [E, rows, G * bytes] as loaded -> [E, rows, G, bytes] (a view)
                experts, rows, flat = packed.shape
                view = packed.data.view(experts, rows, flat // group_bytes, group_bytes)
                setattr(layer, f"{name}_weight_packed", torch.nn.Parameter(view, requires_grad=False))

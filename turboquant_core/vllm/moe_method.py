# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weights for vLLM 0.26's MoE experts under ``--quantization tq3|tq4`` (``quant_config.TQWeightConfig``
returns ``TQFusedMoEMethod`` for the ``RoutedExperts`` module that ``FusedMoE`` builds to hold a layer's expert
weights).

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
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, MoEActivation, RoutedExperts, apply_moe_activation
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

    def __init__(self, fmt: WeightFormat, layer: RoutedExperts, prefix: str = ""):
        super().__init__(layer.moe_config)
        self.fmt, self.prefix = fmt, prefix
        unsupported = unsupported_moe_features(layer)
        if unsupported:
            raise ValueError(f"--quantization {fmt.name}: MoE layer {prefix or layer.layer_name} uses "
                             f"{'; '.join(unsupported)}, which TurboQuant experts do not cover (supported: "
                             f"{SUPPORTED}); serve this model without --quantization {fmt.name}")

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        # The full-precision experts load exactly as with vLLM's unquantized method (same loaders, same sharding).
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size_per_partition
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate_size_per_partition, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, intermediate_size_per_partition))):
            param = torch.nn.Parameter(torch.empty(*shape, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

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
        return (TQExperts(self.fmt.name, layer.w13_weight, layer.w13_weight_scale, self.hidden_size),
                TQExperts(self.fmt.name, layer.w2_weight, layer.w2_weight_scale, self.intermediate_size))

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

# SPDX-License-Identifier: Apache-2.0
"""Mixture-of-experts layers over TurboQuant expert weights: the storage of a layer's stacked experts, the routing
layout, the launcher of ``kernels.moe_linear_jit`` and the plain-torch references.

Storage (``TQExperts``), exact bytes: E experts of [out, in] each, encoded like one ``ops.weight_codec.TQWeight``
per expert and stacked: ``packed`` uint8 [E, out, G, 128 * bits / 8] (G = ceil(in / 128), the last group
zero-padded), ``scales`` float16 [E, out, G]: E * out * G * (16 * bits + 2) bytes.

Routing follows vLLM's Triton fused MoE: token t's k-th expert is routed row t * top_k + k. ``moe_align_block_size``
(vLLM's CUDA op, or ``moe_align_block_size_torch`` here) sorts the routed rows by expert into blocks of BLOCK_M rows
of one expert; ``tq_moe_linear`` computes each block's rows against its expert in one launch and writes row r of
a [tokens * top_k, out] result, so a layer is (``tq_fused_moe``): the gate/up product w13 (input row r // top_k),
SiLU-and-mul, the down product w2 (input row r, times the router weight of r) and the sum over the top-k rows of a
token. Both products run in the activation's type (bf16 or fp16; fp32 activations in fp16) with fp32 accumulation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ..formats import WeightFormat, get_weight_format
from .linear import _codebook, _compute_dtype, rotation_operand
from .weight_codec import TQWeight, quantize_weight, tq_linear_reference

BLOCK_N = 64  # output rows per program
MIN_BLOCK_M = 16  # the tensor-core M
MAX_BLOCK_M = 64
NUM_WARPS = 4
NUM_STAGES = 2

Align = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TQExperts:
    """The stacked experts of one MoE product, each [out_features, in_features], in a TurboQuant weight format
    (see the module docstring)."""

    format: str
    packed: torch.Tensor  # uint8 [experts, out, groups, group_size * bits / 8]
    scales: torch.Tensor  # float16 [experts, out, groups]
    in_features: int

    @property
    def fmt(self) -> WeightFormat:
        return get_weight_format(self.format)

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]

    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scales.numel()

    def expert(self, e: int) -> TQWeight:
        """Expert e as one linear weight (views of the stacked tensors)."""
        return TQWeight(self.format, self.packed[e], self.scales[e], self.in_features)

    def check(self) -> None:
        """Raise ValueError unless the tensors have the shapes and dtypes of the format (and are contiguous: the
        kernel computes their offsets)."""
        fmt = self.fmt
        want = (self.num_experts, self.out_features, fmt.groups(self.in_features), fmt.group_size * fmt.bits // 8)
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != want or not self.packed.is_contiguous():
            raise ValueError(f"{fmt.name} experts: packed indices must be contiguous uint8 {want}, got "
                             f"{str(self.packed.dtype).removeprefix('torch.')} {tuple(self.packed.shape)}")
        scales = self.scales
        if scales.dtype != torch.float16 or tuple(scales.shape) != want[:3] or not scales.is_contiguous():
            raise ValueError(f"{fmt.name} experts: scales must be contiguous float16 {want[:3]}, got "
                             f"{str(self.scales.dtype).removeprefix('torch.')} {tuple(self.scales.shape)}")


def quantize_experts(weights: torch.Tensor, fmt: WeightFormat | str) -> TQExperts:
    """Encode stacked float weights [E, out, in] expert by expert (``ops.weight_codec.quantize_weight``), so the
    temporaries are those of one expert."""
    fmt = get_weight_format(fmt) if isinstance(fmt, str) else fmt
    if weights.dim() != 3 or not weights.dtype.is_floating_point:
        raise ValueError(f"{fmt.name}: expected float expert weights [experts, out, in], got "
                         f"{str(weights.dtype).removeprefix('torch.')} {tuple(weights.shape)}")
    experts, out_features, in_features = weights.shape
    groups = fmt.groups(in_features)
    packed = torch.empty(experts, out_features, groups, fmt.group_size * fmt.bits // 8, dtype=torch.uint8,
                         device=weights.device)
    scales = torch.empty(experts, out_features, groups, dtype=torch.float16, device=weights.device)
    for e in range(experts):
        q = quantize_weight(weights[e], fmt)
        packed[e] = q.packed
        scales[e] = q.scales
    return TQExperts(fmt.name, packed, scales, in_features)


def moe_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Routed rows per block (BLOCK_M): the power of two at or above the mean rows per expert, within
    [MIN_BLOCK_M, MAX_BLOCK_M]. Decode batches take 16 (most rows of a block are padding then), prefill 64. A
    function of shapes only, so CUDA graphs capture it."""
    mean = -(-num_tokens * top_k // max(num_experts, 1))
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(max(mean, 1))))


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_size: int,
                               num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size`` (a CUDA op) in plain torch, for tensors on the CPU (Triton's interpreter);
    same sizes, same contract, fixed shapes throughout (no host synchronisation).

    topk_ids [tokens, top_k] -> (sorted_token_ids int32 [P], expert_ids int32 [ceil(P / block_size)],
    num_tokens_post_padded int32 [1]), P = numel + E (block_size - 1) (at most numel * block_size when numel < E),
    numel = tokens * top_k. Experts take consecutive ranges of sorted_token_ids in expert order, each range its
    routed rows t * top_k + k (ascending here; vLLM's order within an expert may differ) padded with numel to a
    multiple of block_size, an expert without rows no range; expert_ids[b] is the expert of block b and -1 past
    num_tokens_post_padded (the sum of the padded ranges); entries past it hold numel. Expert ids outside
    [0, num_experts) are left out, as vLLM's kernel leaves them."""
    flat = topk_ids.reshape(-1).long()
    numel, dev = flat.numel(), flat.device
    padded_size = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        padded_size = min(numel * block_size, padded_size)
    num_blocks = triton.cdiv(padded_size, block_size)
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # invalid ids: one last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, torch.full((1,), padded_size, dtype=torch.long, device=dev)])
    order = torch.sort(bucket, stable=True).indices  # routed rows by expert, ascending within one
    by_expert = bucket[order]
    rank = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[by_expert]
    dest = torch.where(by_expert < num_experts, starts[by_expert] + rank, padded_size)  # invalid: a slot cut off
    sorted_ids = torch.full((padded_size + 1,), numel, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=dev)
    b = torch.arange(num_blocks, device=dev)
    expert_ids = torch.searchsorted(ends // block_size, b, right=True)
    expert_ids = torch.where(b < total // block_size, expert_ids, -1).to(torch.int32)
    return sorted_ids[:padded_size], expert_ids, total.to(torch.int32)


def tq_moe_linear(x: torch.Tensor, w: TQExperts, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                  num_tokens_post_padded: torch.Tensor, top_k: int, block_m: int,
                  topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] -> [tokens * top_k, out]: routed row r = t * top_k + k is x[t] times the weight of the
    expert its block of the routing layout (``moe_align_block_size``, made for ``block_m`` and tokens * top_k
    routed rows) names, times topk_weights[t, k] when given, in x's type (fp32: fp16). Rows the layout leaves out
    (expert ids outside the layer's) are not written."""
    w.check()
    fmt = w.fmt
    if x.dim() != 2 or x.shape[-1] != w.in_features:
        raise ValueError(f"{fmt.name} experts: activation must be [tokens, {w.in_features}], got {tuple(x.shape)}")
    for name, t in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids),
                    ("num_tokens_post_padded", num_tokens_post_padded)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{fmt.name} experts: {name} must be contiguous int32, got {t.dtype}")
    x = x.to(_compute_dtype(x))
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, dev = x.shape[0], str(x.device)
    num_valid = tokens * top_k
    y = torch.empty(num_valid, w.out_features, dtype=x.dtype, device=x.device)
    if num_valid == 0:
        return y
    weights = y  # not read
    if topk_weights is not None:
        if topk_weights.numel() != num_valid:
            raise ValueError(f"{fmt.name} experts: {topk_weights.numel()} router weights for {num_valid} routed rows")
        weights = topk_weights.reshape(-1).float().contiguous()
    em = sorted_token_ids.shape[0]
    if tokens < block_m:
        # At most tokens * top_k experts have rows, one block each (vLLM's invoke_fused_moe_triton_kernel).
        em = min(em, num_valid * block_m)
    grid = (triton.cdiv(em, block_m), triton.cdiv(w.out_features, BLOCK_N))

    from ..kernels.moe_linear_jit import tq_moe_linear_kernel

    tq_moe_linear_kernel[grid](
        x, rotation_operand(fmt.name, dev, x.dtype), w.packed, w.scales, _codebook(fmt.name, dev), weights, y,
        sorted_token_ids, expert_ids, num_tokens_post_padded, num_valid, w.in_features, w.out_features,
        fmt.groups(w.in_features), x.stride(0), y.stride(0), TOP_K=top_k, BITS=fmt.bits, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, MUL_ROUTED_WEIGHT=topk_weights is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """[rows, 2 I] -> SiLU(h[:, :I]) * h[:, I:] [rows, I] in h's type, computed in fp32 (vLLM's silu_and_mul: the
    gate is the first half of w13's rows)."""
    half = h.shape[-1] // 2
    return (F.silu(h[:, :half].float()) * h[:, half:].float()).to(h.dtype)


def tq_fused_moe(x: torch.Tensor, w13: TQExperts, w2: TQExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 *, apply_router_weight_on_input: bool = False, align: Align | None = None,
                 act: Activation | None = None) -> torch.Tensor:
    """An MoE layer's routed experts: x [tokens, hidden] -> [tokens, hidden] in x's type, the sum over each token's
    top-k experts e (topk_ids [tokens, top_k], topk_weights [tokens, top_k]) of weight * w2_e(SiLU-and-mul(w13_e
    x)). With ``apply_router_weight_on_input`` the weight multiplies w13's output instead (vLLM's placement).
    ``align`` makes the routing layout (vLLM's ``moe_align_block_size`` on a GPU; default:
    ``moe_align_block_size_torch``), ``act`` SiLU-and-mul (vLLM's fused op on a GPU; default: ``silu_and_mul``)."""
    if w13.num_experts != w2.num_experts or w13.out_features != 2 * w2.in_features or w2.out_features != x.shape[-1]:
        raise ValueError(f"experts do not chain: w13 [{w13.num_experts}, {w13.out_features}, {w13.in_features}], "
                         f"w2 [{w2.num_experts}, {w2.out_features}, {w2.in_features}], activation {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                         f"[{x.shape[0]}, top_k]")
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.empty_like(x)
    block_m = moe_block_m(tokens, top_k, w13.num_experts)
    layout = (align or moe_align_block_size_torch)(topk_ids, block_m, w13.num_experts)
    h = tq_moe_linear(x, w13, *layout, top_k, block_m, topk_weights if apply_router_weight_on_input else None)
    a = (act or silu_and_mul)(h)
    y = tq_moe_linear(a, w2, *layout, 1, block_m, None if apply_router_weight_on_input else topk_weights)
    return y.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def moe_linear_reference(x: torch.Tensor, w: TQExperts, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of ``tq_moe_linear``, float32 [tokens * top_k, out]: row t * top_k + k is
    ``tq_linear_reference(x[t], expert topk_ids[t, k])``, times topk_weights[t, k] when given."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long().cpu()
    rows = x.float().repeat_interleave(top_k, dim=0)
    y = torch.zeros(flat.numel(), w.out_features, dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().flatten().to(x.device)
        y[sel] = tq_linear_reference(rows[sel], w.expert(e))
    if topk_weights is not None:
        y = y * topk_weights.reshape(-1, 1).float()
    return y


def moe_reference(x: torch.Tensor, w13: TQExperts, w2: TQExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  *, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The oracle of ``tq_fused_moe``, float32 [tokens, hidden], token by token: for each of its top-k experts e
    with router weight p, h = ``tq_linear_reference`` of w13_e, a = SiLU(gate half) * up half, and p * the w2_e
    product of a added up (p multiplies h instead with ``apply_router_weight_on_input``)."""
    out = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for e, p in zip(topk_ids[t].tolist(), topk_weights[t].float().tolist()):
            h = tq_linear_reference(x[t:t + 1].float(), w13.expert(e))
            if apply_router_weight_on_input:
                h = h * p
            half = h.shape[-1] // 2
            y = tq_linear_reference(F.silu(h[:, :half]) * h[:, half:], w2.expert(e))
            out[t] += (y if apply_router_weight_on_input else y * p)[0]
    return out

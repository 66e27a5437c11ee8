# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights (``ops.weight_codec.TQWeight``): the launcher of
``kernels.linear_jit.tq_linear_kernel``; the plain-torch oracle is ``ops.weight_codec.tq_linear_reference``.

The activation is rotated once per group (the weight never is), permuted to the kernels' coordinate order and
given to the kernel in fp16 after a power-of-two scale per row, so that rows beyond fp16's range (bf16
activations with outliers) neither overflow nor lose relative precision; the scale is exact to undo.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ..codebooks import codebook_tensors
from ..formats import get_weight_format
from ..rotation import fwht, hadamard_signs
from .rotation_tables import codec_tables, kernel_coordinate_order
from .weight_codec import TQWeight, pad_to_groups

BLOCK_O = 64  # output rows per program
BLOCK_B = 16  # activation rows per program (tensor-core M)
PROGRAMS_PER_SM = 4  # split-K target when the output tiles are few
MIN_GROUPS_PER_SPLIT = 4  # 512 inputs per program at least: each split reads enough to pay for its partial sums
FP16_HEADROOM = 2.0 ** 12  # largest |value| fed to the kernel: a group's 128 products stay far below fp16's max


@functools.lru_cache(maxsize=16)
def _tables(fmt_name: str, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rotation's signs, the kernel order of a group's coordinates, the codebook) on ``device``, made once:
    later calls (CUDA-graph capture included) copy nothing from the host."""
    fmt = get_weight_format(fmt_name)
    signs = hadamard_signs(fmt.group_size, fmt.seed).to(device)
    order = kernel_coordinate_order(codec_tables(fmt.group_size, fmt.bits, fmt.seed, "cpu")).to(device)
    table = codebook_tensors(fmt.bits, fmt.group_size, "cpu")[0].float().to(device)
    return signs, order, table


def num_group_splits(tiles: int, groups: int, device) -> int:
    """Ranges of groups the product is split into: enough programs for PROGRAMS_PER_SM on every SM when the
    output and batch tiles alone are fewer (a small batch over a layer of a few thousand outputs), each range
    MIN_GROUPS_PER_SPLIT groups at least; the partial sums are added in a fixed order (no atomics)."""
    from .paged_attention import _sm_count

    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(str(device)), tiles)
    return max(1, min(want, groups // MIN_GROUPS_PER_SPLIT))


def rotated_activation(x: torch.Tensor, w: TQWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (fp16 [rows, groups * 128]: zero-padded to whole groups, each group rotated, in kernel
    order, times 2 ** -e per row; fp32 [rows] the 2 ** e to multiply the product by)."""
    fmt = w.fmt
    groups = fmt.groups(w.in_features)
    signs, order, _ = _tables(fmt.name, str(x.device))
    # R x = H (D x) / sqrt(128) (rotation.rotate, with the signs D kept on the device)
    xg = pad_to_groups(x.float(), fmt).reshape(x.shape[0], groups, fmt.group_size)
    xr = fwht(xg * signs) / math.sqrt(fmt.group_size)
    xr = xr[..., order].reshape(x.shape[0], groups * fmt.group_size)
    amax = xr.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP16_HEADROOM)))
    return (xr / scale[:, None]).to(torch.float16), scale


@torch.library.custom_op("turboquant::tq_linear", mutates_args=())
def tq_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """``tq_linear`` without bias as one opaque op (torch.compile and CUDA graphs see a single call)."""
    return tq_linear(x, TQWeight(fmt, packed, scales, x.shape[-1]))


@tq_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def tq_linear(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x W_hat^T (+ bias) [..., out] in x's dtype (see the module docstring)."""
    from ..kernels.linear_jit import tq_linear_kernel

    w.check()
    fmt = w.fmt
    if x.shape[-1] != w.in_features:
        raise ValueError(f"{fmt.name}: activation has {x.shape[-1]} features, the weight {w.in_features}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    xk, scale = rotated_activation(x.reshape(rows, w.in_features), w)
    groups = fmt.groups(w.in_features)
    tiles = triton.cdiv(w.out_features, BLOCK_O) * triton.cdiv(rows, BLOCK_B)
    per_split = triton.cdiv(groups, num_group_splits(tiles, groups, x.device))
    splits = triton.cdiv(groups, per_split)
    part = torch.empty(splits, rows, w.out_features, dtype=torch.float32, device=x.device)
    table = _tables(fmt.name, str(x.device))[2]
    grid = (triton.cdiv(w.out_features, BLOCK_O), triton.cdiv(rows, BLOCK_B), splits)
    tq_linear_kernel[grid](xk, w.packed, w.scales, table, part, rows, w.out_features, groups, per_split,
                           xk.stride(0), part.stride(1), part.stride(0), BITS=fmt.bits, BLOCK_O=BLOCK_O,
                           BLOCK_B=BLOCK_B)
    y = part[0] if splits == 1 else part.sum(0)
    y *= scale[:, None]
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*lead, w.out_features)

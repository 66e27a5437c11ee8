# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weights (``formats.WEIGHT_FORMATS``: ``tq3``, ``tq4``): the storage of a quantized linear weight and
its plain-torch reference encoding, decoding and product, the oracle of the kernels (``ops.linear``).

A weight W [out, in] is cut along the input dimension into G = ceil(in / 128) groups, the last one zero-padded
(a 576-wide layer: 4 full groups and one of 64 weights and 64 zeros; activations are padded alike). Group g of
row o, w = W[o, 128 g : 128 (g + 1)], is stored as the format's code (``quantizer.MSEQuantizer``): the rotation
R (the format's seed) of w, each coordinate of R w * sqrt(128) / |w| mapped to its Lloyd-Max index, and one
fp16 scale s chosen so that |s c[idx]| = |w| (norm correction). So w_hat = R^T (s c[idx]), and

    y_o = sum_g < x_g, w_hat_og > = sum_g s_og < R x_g, c[idx_og] >

where x_g is group g of the activation: the product rotates the activation once per group and never
un-rotates a weight (``tq_linear_reference``).

Storage (``TQWeight``), exact bytes: ``packed`` uint8 [out, G, 128 * bits / 8], each group's indices in the
``planar8`` layout (``packing``), and ``scales`` float16 [out, G]: out * G * (16 * bits + 2) bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import WeightFormat, get_weight_format
from ..packing import pack_indices, unpack_indices
from ..quantizer import MSEQuantized
from ..rotation import rotate

# Rows encoded per step: bounds the float32 temporaries of a large layer (rows x in x 4 B x a few).
ENCODE_ROWS = 1024


@dataclass(frozen=True)
class TQWeight:
    """A linear weight [out_features, in_features] in a TurboQuant weight format (see the module docstring)."""

    format: str
    packed: torch.Tensor  # uint8 [out, groups, group_size * bits / 8]
    scales: torch.Tensor  # float16 [out, groups]
    in_features: int

    @property
    def fmt(self) -> WeightFormat:
        return get_weight_format(self.format)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scales.numel()

    def check(self) -> None:
        """Raise ValueError unless the tensors have the shapes and dtypes of the format."""
        fmt = self.fmt
        groups = fmt.groups(self.in_features)
        want = (self.out_features, groups, fmt.group_size * fmt.bits // 8)
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != want:
            raise ValueError(f"{fmt.name} weight: packed indices must be uint8 {want}, got "
                             f"{str(self.packed.dtype).removeprefix('torch.')} {tuple(self.packed.shape)}")
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != want[:2]:
            raise ValueError(f"{fmt.name} weight: scales must be float16 {want[:2]}, got "
                             f"{str(self.scales.dtype).removeprefix('torch.')} {tuple(self.scales.shape)}")


def quantize_weight(weight: torch.Tensor, fmt: WeightFormat | str) -> TQWeight:
    """Encode a float weight [out, in] (in a multiple of the group size), ``ENCODE_ROWS`` rows at a time."""
    fmt = get_weight_format(fmt) if isinstance(fmt, str) else fmt
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"{fmt.name}: expected a 2-D float weight [out, in], got "
                         f"{str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    gs, groups = fmt.group_size, fmt.groups(in_features)
    q = fmt.quantizer()
    packed = torch.empty(out_features, groups, gs * fmt.bits // 8, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out_features, groups, dtype=torch.float16, device=weight.device)
    for r0 in range(0, out_features, ENCODE_ROWS):
        rows = pad_to_groups(weight[r0:r0 + ENCODE_ROWS], fmt)
        code = q.quantize(rows.reshape(rows.shape[0], groups, gs))
        packed[r0:r0 + rows.shape[0]] = pack_indices(code.idx, fmt.bits)
        scales[r0:r0 + rows.shape[0]] = code.scale.to(torch.float16)
    return TQWeight(fmt.name, packed, scales, in_features)


def pad_to_groups(x: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """x [..., in] zero-padded to [..., groups * group_size] (x itself when the groups divide it)."""
    pad = fmt.groups(x.shape[-1]) * fmt.group_size - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _code(w: TQWeight) -> MSEQuantized:
    fmt = w.fmt
    return MSEQuantized(unpack_indices(w.packed, fmt.bits, fmt.group_size), w.scales.float())


def rotated_weight(w: TQWeight) -> torch.Tensor:
    """s c[idx] per group, float32 [out, groups, group_size]: the weight in the rotated domain."""
    return w.fmt.quantizer().rotated_values(_code(w))


def dequantize_weight(w: TQWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The decoded weight [out, in] (w_hat = R^T s c[idx] per group)."""
    w.check()
    return w.fmt.quantizer().dequantize(_code(w)).reshape(w.out_features, -1)[:, :w.in_features].to(dtype)


def tq_linear_reference(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x W_hat^T (+ bias) [..., out], float32, in the rotated domain: each activation group
    rotated once, against the codebook values and scales (the product the kernels compute)."""
    w.check()
    fmt = w.fmt
    if x.shape[-1] != w.in_features:
        raise ValueError(f"{fmt.name}: activation has {x.shape[-1]} features, the weight {w.in_features}")
    groups = fmt.groups(w.in_features)
    xr = rotate(pad_to_groups(x.float(), fmt).reshape(*x.shape[:-1], groups, fmt.group_size), fmt.seed)
    y = torch.einsum("...gd,ogd->...o", xr, rotated_weight(w))
    return y if bias is None else y + bias.float()


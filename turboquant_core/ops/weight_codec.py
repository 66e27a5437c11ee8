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

Served layout (``served_layout``): tq4 weights reach the kernels as kernel words, the same bytes rearranged once at
load: ``packed`` int32 [out, G, 16], word w of a group holding byte w of each of its four planes (byte k of the
word, little-endian: plane k), so the word's 8 fields are coordinates w, w + 16, ..., w + 112, the word the
register-tile product would otherwise assemble from four plane loads; and each field in sign-magnitude form
(``sign_magnitude``): bits 0-2 the rank of the codebook value's magnitude, bit 3 set for the positive half. A
thread's four words are one 16-byte load, and a field's magnitude rank is one AND. Checkpoints keep ``planar8``.
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
# Bit widths served as kernel words (see the module docstring): 4-bit fields fill a word from four planes.
KERNEL_WORD_BITS = (4,)


@dataclass(frozen=True)
class TQWeight:
    """A linear weight [out_features, in_features] in a TurboQuant weight format (see the module docstring)."""

    format: str
    packed: torch.Tensor  # uint8 [out, groups, group_size * bits / 8]; served tq4: int32 [out, groups, 16]
    scales: torch.Tensor  # float16 [out, groups]
    in_features: int

    @property
    def fmt(self) -> WeightFormat:
        return get_weight_format(self.format)

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def kernel_words(self) -> bool:
        """Whether ``packed`` holds the served kernel words (int32) rather than ``planar8`` bytes."""
        return self.packed.dtype == torch.int32

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + 2 * self.scales.numel()

    def check(self) -> None:
        """Raise ValueError unless the tensors have the shapes and dtypes of the format (planar8 bytes, or kernel
        words for the bit widths served so)."""
        fmt = self.fmt
        groups = fmt.groups(self.in_features)
        group_bytes = fmt.group_size * fmt.bits // 8
        if self.kernel_words and fmt.bits in KERNEL_WORD_BITS:
            want, kind = (self.out_features, groups, group_bytes // 4), torch.int32
        else:
            want, kind = (self.out_features, groups, group_bytes), torch.uint8
        if self.packed.dtype != kind or tuple(self.packed.shape) != want:
            name = str(kind).removeprefix("torch.")
            raise ValueError(f"{fmt.name} weight: packed indices must be {name} {want}, got "
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


def sign_magnitude(fields: torch.Tensor) -> torch.Tensor:
    """Lloyd-Max indices of a codebook symmetric about zero (ascending: c[15 - i] = -c[i]) <-> sign-magnitude
    fields: an index of the positive half (8-15) stays, with its magnitude's rank i - 8 in bits 0-2 and bit 3 set;
    one of the negative half becomes 7 - i (the rank of |c[i]|, bit 3 clear). Its own inverse."""
    return torch.where(fields >= 8, fields, 7 - fields)


def _sign_magnitude_bytes(packed: torch.Tensor) -> torch.Tensor:
    """``sign_magnitude`` on both 4-bit fields of every byte."""
    lo, hi = packed & 0xF, packed >> 4
    return sign_magnitude(lo) | (sign_magnitude(hi) << 4)


def to_kernel_words(packed: torch.Tensor) -> torch.Tensor:
    """planar8 bytes of 4-bit fields uint8 [..., G, 64] -> kernel words int32 [..., G, 16] (module docstring)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] != 64:
        raise ValueError(f"kernel words are made from 4-bit planar8 groups (uint8 [..., 64]), got "
                         f"{str(packed.dtype).removeprefix('torch.')} {tuple(packed.shape)}")
    planes = _sign_magnitude_bytes(packed).reshape(*packed.shape[:-1], 4, 16)
    return planes.transpose(-1, -2).contiguous().view(torch.int32).reshape(*packed.shape[:-1], 16)


def from_kernel_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_kernel_words``: kernel words int32 [..., G, 16] -> planar8 bytes uint8 [..., G, 64]."""
    if words.dtype != torch.int32 or words.shape[-1] != 16:
        raise ValueError(f"expected kernel words int32 [..., 16], got {str(words.dtype).removeprefix('torch.')} "
                         f"{tuple(words.shape)}")
    slots = words.contiguous().view(torch.uint8).reshape(*words.shape[:-1], 16, 4)
    return _sign_magnitude_bytes(slots.transpose(-1, -2).reshape(*words.shape[:-1], 64))


def served_layout(w: TQWeight) -> TQWeight:
    """``w`` as the kernels take it: kernel words for the bit widths in ``KERNEL_WORD_BITS``, else unchanged."""
    if w.kernel_words or w.fmt.bits not in KERNEL_WORD_BITS:
        return w
    return TQWeight(w.format, to_kernel_words(w.packed), w.scales, w.in_features)


def _code(w: TQWeight) -> MSEQuantized:
    fmt = w.fmt
    packed = from_kernel_words(w.packed) if w.kernel_words else w.packed
    return MSEQuantized(unpack_indices(packed, fmt.bits, fmt.group_size), w.scales.float())


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


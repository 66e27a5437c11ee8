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

Served layout (``served_layout``): weights reach the kernels as kernel words, the same bits rearranged once at load.
The register-tile product would otherwise assemble group word w (byte k: plane k's byte w; its 8 fields coordinates
w, w + 16, ..., w + 112) from the planes and, for 3-bit fields, spread the fields to one per nibble (the selectors
of its byte-permute lookups); a thread takes the four words 4l..4l+3 of a group (its lane group l).
- tq4: ``packed`` int32 [out, G, 16], word w the group word w, each field in sign-magnitude form
  (``sign_magnitude``): bits 0-2 the rank of the codebook value's magnitude, bit 3 set for the positive half. A
  thread's four words are one 16-byte load, and a field's magnitude rank is one AND.
- tq3: ``packed`` int32 [out, G, 12], a lane group's four words in three (slots 3l, 3l + 1, 3l + 2): with N_i the
  group word 4l + i spread to one field per nibble (bits 0-2), slot 3l + i holds N_i with bit i of N_3's field j in
  bit 3 of nibble j (i = 0, 1, 2). A thread's words are one 12-byte read; N_i = slot & 0x77777777, and N_3 gathers
  the three bit-3 columns back (``kernels.linear_mma_jit``).
Checkpoints keep ``planar8``.
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
# Bit widths served as kernel words (see the module docstring).
KERNEL_WORD_BITS = (4, 3)


@dataclass(frozen=True)
class TQWeight:
    """A linear weight [out_features, in_features] in a TurboQuant weight format (see the module docstring)."""

    format: str
    packed: torch.Tensor  # uint8 [out, groups, group_size * bits / 8]; served: int32 [out, groups, 4 * bits]
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
    # The kept tensors are allocated once the encoding's temporaries are freed: allocated before them, the caching
    # allocator's blocks held more than their bytes on a GPU (benchmarks/results/INDEX.md, 6aed6be).
    return TQWeight(fmt.name, packed.clone(), scales.clone(), in_features)


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


NIBBLE_MASK = 0x77777777  # bits 0-2 of every nibble


def _spread_3bit(words: torch.Tensor) -> torch.Tensor:
    """int64 words of eight 3-bit fields (field j in bits 3j..3j+2) -> one field per nibble (bits 4j..4j+2)."""
    return sum(((words >> (3 * j)) & 7) << (4 * j) for j in range(8))


def _pack_3bit(nibbles: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_spread_3bit``."""
    return sum(((nibbles >> (4 * j)) & 7) << (3 * j) for j in range(8))


# Groups converted per step: the int64 temporaries of a step stay near 100 MB whatever the layer.
KERNEL_WORD_CHUNK = 1 << 16


def _to_3bit_words(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1, 48)
    steps = []
    for g0 in range(0, flat.shape[0], KERNEL_WORD_CHUNK):
        planes = flat[g0:g0 + KERNEL_WORD_CHUNK].to(torch.int64).reshape(-1, 3, 16)
        n = _spread_3bit(planes[:, 0] | (planes[:, 1] << 8) | (planes[:, 2] << 16)).reshape(-1, 4, 4)  # [., l, i]
        slots = torch.stack([n[..., i] | (((n[..., 3] >> i) & 0x11111111) << 3) for i in range(3)], -1)
        steps.append(_as_int32(slots.reshape(-1, 12)))
        del planes, n, slots
    # allocated once the temporaries are freed, as quantize_weight's kept tensors are
    return torch.cat(steps or [flat.new_empty(0, 12, dtype=torch.int32)]).reshape(*packed.shape[:-1], 12)


def _from_3bit_words(words: torch.Tensor) -> torch.Tensor:
    slots = words.to(torch.int64).reshape(*words.shape[:-1], 4, 3) & 0xFFFFFFFF
    n3 = sum(((slots[..., i] >> 3) & 0x11111111) << i for i in range(3))
    n = torch.stack([slots[..., i] & NIBBLE_MASK for i in range(3)] + [n3], -1).reshape(*words.shape[:-1], 16)
    w = _pack_3bit(n)
    return torch.stack([(w >> (8 * k)) & 0xFF for k in range(3)], -2).reshape(*words.shape[:-1], 48).to(torch.uint8)


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values of 32 bits -> the int32 of the same bits."""
    return (x - ((x & 0x80000000) << 1)).to(torch.int32)


def to_kernel_words(packed: torch.Tensor) -> torch.Tensor:
    """planar8 bytes of 4-bit fields uint8 [..., G, 64] -> kernel words int32 [..., G, 16], or of 3-bit fields
    uint8 [..., G, 48] -> int32 [..., G, 12] (module docstring)."""
    if packed.dtype != torch.uint8 or packed.shape[-1] not in (64, 48):
        raise ValueError(f"kernel words are made from 4-bit or 3-bit planar8 groups (uint8 [..., 64] or [..., 48]), "
                         f"got {str(packed.dtype).removeprefix('torch.')} {tuple(packed.shape)}")
    if packed.shape[-1] == 48:
        return _to_3bit_words(packed)
    planes = _sign_magnitude_bytes(packed).reshape(*packed.shape[:-1], 4, 16)
    return planes.transpose(-1, -2).contiguous().view(torch.int32).reshape(*packed.shape[:-1], 16)


def from_kernel_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``to_kernel_words``: kernel words int32 [..., G, 16] -> planar8 bytes uint8 [..., G, 64],
    or int32 [..., G, 12] -> uint8 [..., G, 48]."""
    if words.dtype != torch.int32 or words.shape[-1] not in (16, 12):
        raise ValueError(f"expected kernel words int32 [..., 16] or [..., 12], got "
                         f"{str(words.dtype).removeprefix('torch.')} {tuple(words.shape)}")
    if words.shape[-1] == 12:
        return _from_3bit_words(words)
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


def int8_codebook(fmt: WeightFormat | str) -> tuple[torch.Tensor, float]:
    """The format's codebook on an 8-bit grid, for the int8 tensor-core product: (bytes, int64 [2^bits] by Lloyd-Max
    index; unit u) with c[i] ~ (bytes[i] + 0.5) u. The largest magnitude is 127.5 u (at most u / 2 off each entry);
    a negative entry's byte is the bitwise complement of its mirror's (-b - 1), so the grid is as symmetric as the
    codebook, and the half units add up to u / 2 times the activation group's sum."""
    from ..codebooks import codebook_tensors

    fmt = get_weight_format(fmt) if isinstance(fmt, str) else fmt
    cb = codebook_tensors(fmt.bits, fmt.group_size)[0].double()
    half = cb.numel() // 2
    unit = float(cb[-1]) / 127.5
    q = torch.clamp(torch.round(cb[half:] / unit - 0.5), 0, 127).long()
    return torch.cat([-q.flip(0) - 1, q]), unit


def int8_activation(xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised rotated activation groups [..., groups, group_size] (fp32) -> (int8 values as float32, |v| <= 127;
    their step, a power of two per group [..., groups]) with values * step ~ xr: the step is the group's absolute
    maximum rounded up to a power of two, over 128."""
    amax = xr.abs().amax(-1).clamp_min(1e-30)
    step = torch.exp2(torch.ceil(torch.log2(amax)) - 7.0)
    return torch.clamp(torch.floor(xr / step[..., None] + 0.5), -127.0, 127.0), step


def tq_linear_int8_reference(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x W_hat^T (+ bias) [..., out], float32, as the int8 tensor-core product computes it: each
    activation group rotated (unnormalised) and rounded to int8 (``int8_activation``), the weight as the bytes of
    ``int8_codebook``; per group y += s (u / 2) (step / sqrt(group_size)) (2 sum(b xq) + sum(xq)). Given x in the
    kernels' compute type (fp16 for float32 input), equal to their float32 sums up to summation order."""
    from ..rotation import fwht, hadamard_signs

    w.check()
    fmt = w.fmt
    if x.shape[-1] != w.in_features:
        raise ValueError(f"{fmt.name}: activation has {x.shape[-1]} features, the weight {w.in_features}")
    gs, groups = fmt.group_size, fmt.groups(w.in_features)
    xg = pad_to_groups(x.float(), fmt).reshape(*x.shape[:-1], groups, gs)
    xq, step = int8_activation(fwht(xg * hadamard_signs(gs, fmt.seed).to(xg.device)))
    table, unit = int8_codebook(fmt)
    code = _code(w)
    b = table.to(code.idx.device)[code.idx.long()].double()  # [out, groups, gs]
    p = torch.einsum("...gd,ogd->...og", xq.double(), b)  # exact: |p| < 2^21
    total = 2 * p + xq.double().sum(-1)[..., None, :]
    y = (total * code.scale.double() * (unit / 2) * (step.double() / gs ** 0.5)[..., None, :]).sum(-1).float()
    return y if bias is None else y + bias.float()

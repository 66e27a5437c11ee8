# SPDX-License-Identifier: Apache-2.0
"""Dense bit packing of codebook indices: layout ``planar8``.

n indices of b bits (b in 1..4, n a multiple of 8) take exactly n*b/8 bytes. They are cut into
G = n/8 groups of 8; group g holds the indices g, g+G, ..., g+7G, so one group of 8 indices fills
exactly b bytes (3-bit: 8 indices in 3 bytes), and

    word_g = sum_j idx[j*G + g] << (b*j)          (8b bits, little-endian)
    byte[k*G + g] = (word_g >> 8k) & 0xFF          (k = 0 .. b-1)

Byte plane k of all groups is contiguous, so a kernel unpacks a vector with b contiguous loads
of G bytes and shifts; no index ever straddles a machine word in a way that depends on its
position, and the layout is the same for every bit width. The fast kernels and this reference
produce identical bytes (tested exhaustively).
"""

from __future__ import annotations

import torch

PACKING_LAYOUT = "planar8"
PACKABLE_BITS = (1, 2, 3, 4)


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that n indices of ``bits`` bits occupy."""
    _check(n, bits)
    return n * bits // 8


def _check(n: int, bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
    if n % 8:
        raise ValueError(f"the number of indices must be a multiple of 8, got {n}")


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integer indices in [0, 2**bits) -> [..., n*bits/8] uint8."""
    n = idx.shape[-1]
    _check(n, bits)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= 2**bits):
        raise ValueError(f"indices must lie in [0, {2**bits}) for {bits}-bit packing")
    g = n // 8
    lead = idx.shape[:-1]
    groups = idx.to(torch.int64).reshape(*lead, 8, g)  # [..., j, g]
    shifts = (bits * torch.arange(8, device=idx.device, dtype=torch.int64)).view(8, 1)
    word = (groups << shifts).sum(dim=-2)  # [..., g]
    planes = [(word >> (8 * k)) & 0xFF for k in range(bits)]
    return torch.cat(planes, dim=-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """[..., n*bits/8] uint8 -> [..., n] uint8 indices (inverse of ``pack_indices``)."""
    _check(n, bits)
    g = n // 8
    if packed.shape[-1] != bits * g:
        raise ValueError(f"expected {bits * g} packed bytes for {n} indices at {bits} bits, got {packed.shape[-1]}")
    lead = packed.shape[:-1]
    planes = packed.to(torch.int64).reshape(*lead, bits, g)
    shifts8 = (8 * torch.arange(bits, device=packed.device, dtype=torch.int64)).view(bits, 1)
    word = (planes << shifts8).sum(dim=-2)  # [..., g]
    shifts = (bits * torch.arange(8, device=packed.device, dtype=torch.int64)).view(8, 1)
    idx = (word.unsqueeze(-2) >> shifts) & (2**bits - 1)  # [..., j, g]
    return idx.reshape(*lead, n).to(torch.uint8)

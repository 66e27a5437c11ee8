# SPDX-License-Identifier: Apache-2.0
import itertools

import pytest
import torch

from turboquant_core.packing import PACKABLE_BITS, PACKING_LAYOUT, pack_indices, packed_bytes, unpack_indices


def _pack_bitwise(idx: list[int], bits: int) -> list[int]:
    """Independent bit-by-bit statement of planar8: bit t of index i lands in byte k*G + g."""
    n = len(idx)
    g_count = n // 8
    out = [0] * (n * bits // 8)
    for i, v in enumerate(idx):
        j, g = divmod(i, g_count)  # index i = j*G + g sits at slot j of group g
        for t in range(bits):
            pos = bits * j + t  # bit position within the group's 8*bits-bit word
            k, r = divmod(pos, 8)
            out[k * g_count + g] |= ((v >> t) & 1) << r
    return out


def test_layout_name():
    assert PACKING_LAYOUT == "planar8"


@pytest.mark.parametrize("bits", PACKABLE_BITS)
@pytest.mark.parametrize("n", [8, 16, 24, 40, 64, 80, 128])
def test_every_value_at_every_position_round_trips(bits, n):
    # Row v holds (v + position) mod 2^b: each value appears at each position in some row.
    levels = 2**bits
    pos = torch.arange(n)
    idx = (torch.arange(levels)[:, None] + pos[None, :]) % levels
    packed = pack_indices(idx, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (levels, n * bits // 8)
    assert torch.equal(unpack_indices(packed, bits, n), idx.to(torch.uint8))
    for row in range(levels):
        assert packed[row].tolist() == _pack_bitwise(idx[row].tolist(), bits)


@pytest.mark.parametrize("bits", PACKABLE_BITS)
def test_all_index_tuples_of_one_group_round_trip(bits):
    # Every value at every one of the 8 slots, paired with every value at its neighbour slot.
    levels = 2**bits
    pairs = torch.tensor(list(itertools.product(range(levels), repeat=2)))  # [L^2, 2]
    rows = []
    for slot in range(7):
        r = torch.zeros(len(pairs), 8, dtype=torch.long)
        r[:, slot : slot + 2] = pairs
        rows.append(r)
    idx = torch.cat(rows)
    packed = pack_indices(idx, bits)
    assert torch.equal(unpack_indices(packed, bits, 8), idx.to(torch.uint8))
    assert packed.tolist() == [_pack_bitwise(r, bits) for r in idx.tolist()]


@pytest.mark.parametrize("bits", PACKABLE_BITS)
def test_random_indices_with_leading_dims(bits):
    g = torch.Generator().manual_seed(bits)
    idx = torch.randint(0, 2**bits, (3, 5, 96), generator=g, dtype=torch.uint8)
    packed = pack_indices(idx, bits)
    assert packed.shape == (3, 5, 96 * bits // 8)
    assert torch.equal(unpack_indices(packed, bits, 96), idx)


@pytest.mark.parametrize("bits", PACKABLE_BITS)
@pytest.mark.parametrize("n", [8, 32, 56, 64, 96, 128, 256, 512])
def test_packed_bytes_exact(bits, n):
    assert packed_bytes(n, bits) == n * bits // 8
    assert pack_indices(torch.zeros(n, dtype=torch.long), bits).numel() == packed_bytes(n, bits)


def test_three_bit_group_by_hand():
    # Indices 1..7, 0 in one group: word = 001 | 010<<3 | 011<<6 | 100<<9 | 101<<12 | 110<<15 | 111<<18 | 000<<21
    #   = 0b 000_111_110_101_100_011_010_001 = 0x1F58D1 -> little-endian bytes D1 58 1F.
    packed = pack_indices(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]), 3)
    assert packed.tolist() == [0xD1, 0x58, 0x1F]


def test_three_bit_planes_by_hand():
    # n=16 -> G=2 groups: group 0 = indices 0,2,4,..,14, group 1 = 1,3,..,15. Byte k*G+g = byte k of group g.
    idx = torch.tensor([1, 7, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 0, 0])
    packed = pack_indices(idx, 3)
    # group 0 holds 1..7, 0 (as above): D1 58 1F; group 1 holds 7, 0, ..., 0: word 7 -> 07 00 00.
    assert packed.tolist() == [0xD1, 0x07, 0x58, 0x00, 0x1F, 0x00]


def test_one_and_four_bit_by_hand():
    assert pack_indices(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1]), 1).tolist() == [0b10001101]
    assert pack_indices(torch.tensor([0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0xF]), 4).tolist() == [0x21, 0x43, 0x65,
                                                                                               0xF7]


def test_empty_leading_dims():
    packed = pack_indices(torch.zeros(0, 16, dtype=torch.uint8), 2)
    assert packed.shape == (0, 4)
    assert unpack_indices(packed, 2, 16).shape == (0, 16)


@pytest.mark.parametrize("bits", [0, 5, 8, 2.5])
def test_bad_bits_name_the_choices(bits):
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 3, 4\)"):
        pack_indices(torch.zeros(8, dtype=torch.long), bits)
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 4\)"):
        packed_bytes(8, bits)


@pytest.mark.parametrize("n", [1, 7, 12, 100])
def test_length_must_be_multiple_of_eight(n):
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_indices(torch.zeros(n, dtype=torch.long), 2)


@pytest.mark.parametrize("bits", PACKABLE_BITS)
def test_out_of_range_indices_rejected(bits):
    too_big = torch.zeros(8, dtype=torch.long)
    too_big[3] = 2**bits
    with pytest.raises(ValueError, match=rf"\[0, {2**bits}\)"):
        pack_indices(too_big, bits)
    negative = torch.zeros(8, dtype=torch.long)
    negative[0] = -1
    with pytest.raises(ValueError, match="indices must lie in"):
        pack_indices(negative, bits)


def test_unpack_checks_byte_count():
    with pytest.raises(ValueError, match="expected 6 packed bytes for 16 indices at 3 bits, got 5"):
        unpack_indices(torch.zeros(5, dtype=torch.uint8), 3, 16)

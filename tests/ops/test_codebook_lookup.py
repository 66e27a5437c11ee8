# SPDX-License-Identifier: Apache-2.0
"""Codebook lookups inside the kernels (``kernels.codebook_lookup_jit``): the byte-permute lookup modelled on
the CPU, and on a GPU the kernels that use it against their load-based variants."""

import pytest
import torch
import triton
import triton.language as tl

from tests.ops.test_paged import _paged_batch
from turboquant_core.codebooks import codebook_tensors
from turboquant_core.formats import format_names
from turboquant_core.kernels.codebook_lookup_jit import _codebook_bytes, _nibble_fields
from turboquant_core.ops.codec import decode, encode
from turboquant_core.ops.paged import TQAttentionConfig, tq_gather_dequant, tq_paged_attention


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte sel[4i+2:4i] of {b, a}, sign-replicated
    when sel[4i+3] is set."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _permute_lookup4_model(sel: int, cb: list[int], bits: int) -> list[int]:
    """The instruction sequence of ``_permute_lookup4``, instruction by instruction."""
    if bits == 4:
        s = sel & 0x7777
        m = ((sel >> 1) & 0x4444) | 0x3210
        lo = _prmt(_prmt(cb[0], cb[1], s), _prmt(cb[2], cb[3], s), m)
        hi = _prmt(_prmt(cb[4], cb[5], s), _prmt(cb[6], cb[7], s), m)
    else:
        lo, hi = _prmt(cb[0], cb[1], sel), _prmt(cb[4], cb[5], sel)
    p, q = _prmt(lo, hi, 0x5140), _prmt(lo, hi, 0x7362)
    return [p & 0xFFFF, p >> 16, q & 0xFFFF, q >> 16]


@triton.jit
def _permute_helpers_probe(W, T, SEL, CB, N: tl.constexpr, B: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(SEL + i, _nibble_fields(tl.load(W + i), B))
    cb = _codebook_bytes(T, B)
    for k in tl.static_range(8):
        tl.store(CB + k, cb[k])


def _run_jit_helpers(words: torch.Tensor, table: torch.Tensor, bits: int):
    sel = torch.zeros(words.numel(), dtype=torch.int32)
    cb = torch.zeros(8, dtype=torch.int32)
    _permute_helpers_probe[(1,)](words, table, sel, cb, N=words.numel(), B=bits)
    return sel.view(torch.uint32).tolist(), cb.view(torch.uint32).tolist()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_permute_lookup_returns_every_codebook_entry(bits):
    """The byte-permute lookup (GPU only: inline PTX) modelled instruction by instruction on the helpers'
    interpreted output: for random words of 8 fields and for every single index value, the four fields
    of each selector half come back as the fp16 bits of exactly their codebook entries."""
    if torch.cuda.is_available():
        pytest.skip("interpreter check (the GPU runs the PTX itself: test_permute_lookup_is_bit_identical_on_gpu)")
    n_entries = 1 << bits
    table = codebook_tensors(bits, 128, "cpu")[0].to(torch.float16)
    entry_bits = table.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()
    g = torch.Generator().manual_seed(bits)
    fields = torch.randint(0, n_entries, (64, 8), generator=g)
    fields[:n_entries] = torch.arange(n_entries)[:, None]  # every index value in every field
    words = (fields << (bits * torch.arange(8))).sum(1).to(torch.int64)
    sel, cb = _run_jit_helpers(words.to(torch.int32), table, bits)
    for w, s, f in zip(words.tolist(), sel, fields.tolist()):
        assert [(s >> (4 * j)) & 0xF for j in range(8)] == f, hex(w)
        got = _permute_lookup4_model(s & 0xFFFF, cb, bits) + _permute_lookup4_model(s >> 16, cb, bits)
        assert got == [entry_bits[i] for i in f]


@pytest.mark.gpu
@pytest.mark.parametrize("name", format_names())
def test_permute_lookup_is_bit_identical_on_gpu(name):
    """Register (byte-permute) and L1-load codebook lookups feed the same fp16 values to the same products."""
    lay, cache, bt, qsl, sl, q = _paged_batch(name, 128, 2, 4, [1, 17, 300], [1, 1, 1], "cuda")
    outs = []
    for permute in (True, False):
        cfg = TQAttentionConfig(permute_lookup=permute)
        outs.append(tq_paged_attention(q, cache, lay, bt, qsl, sl, max_query_len=1, max_seq_len=300,
                                       num_splits=2, return_lse=True, config=cfg))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 2.5, 3, 3.5, 4])
def test_dense_decode_with_permutes_matches_gathers_on_gpu(bits):
    """bf16 outputs: the same fp16 codebook values either way; only the product's summation order differs."""
    x = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    packed, scale = encode(x, bits, 7)
    a = decode(packed, scale, 128, bits, 7, torch.bfloat16, permute_lookup=True).float()
    b = decode(packed, scale, 128, bits, 7, torch.bfloat16, permute_lookup=False).float()
    torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    assert (a - b).abs().max() <= 2 ** -6 * b.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("name", format_names())
def test_gather_dequant_with_permutes_matches_gathers_on_gpu(name):
    lay, cache, bt, qsl, sl, q = _paged_batch(name, 128, 2, 4, [1, 17, 300], [1, 1, 1], "cuda")
    cu = torch.tensor([0, 1, 18, 318], dtype=torch.int32, device="cuda")
    outs = []
    for permute in (True, False):
        k = torch.empty(318, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.empty_like(k)
        tq_gather_dequant(cache, lay, bt, sl, cu, k, v, max_seq_len=300, permute_lookup=permute)
        outs.append((k.float(), v.float()))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)

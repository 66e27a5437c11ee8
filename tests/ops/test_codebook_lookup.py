# SPDX-License-Identifier: Apache-2.0
"""Codebook lookups inside the kernels (``kernels.codebook_lookup_jit``): the byte-permute lookup modelled on
the CPU, and the lookup the kernels call against the codebook, bit for bit (interpreter and GPU)."""

import re

import pytest
import torch
import triton
import triton.language as tl

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.kernels.codebook_lookup_jit import (
    SYMMETRIC_LOOKUP8_ASM,
    _codebook_bytes,
    _codebook_registers,
    _dequant_words,
    _nibble_fields,
)


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
    """``_lookup_selectors`` and the instruction sequence of ``_permute_lookup4``, instruction by instruction (the
    selectors of one half: prmt reads their low 16 bits)."""
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
        pytest.skip("interpreter model (the GPU runs the PTX itself: test_dequant_words_gives_each_fields_...)")
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


@triton.jit
def _dequant_words_probe(W, T, OUT, BN: tl.constexpr, GP: tl.constexpr, B: tl.constexpr):
    rows = tl.arange(0, BN)
    g = tl.arange(0, GP)
    word = tl.load(W + rows[:, None] * GP + g[None, :]).to(tl.uint32)
    c = _dequant_words(word, T, _codebook_registers(T, B), BN, GP, B)
    p = tl.arange(0, 8 * GP)
    tl.store(OUT + rows[:, None] * (8 * GP) + p[None, :], c)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequant_words_gives_each_fields_codebook_value_in_kernel_order(bits, device):
    """The lookup the kernels use (byte permutes on the GPU, loads in the interpreter) is bit-exact: tile
    position g*8 + r holds the fp16 codebook entry of field bitrev3(r) of word g, for every index value."""
    bn, gp, n_entries = 32, 4, 1 << bits
    table = codebook_tensors(bits, 128, "cpu")[0].to(torch.float16)
    g = torch.Generator().manual_seed(bits)
    fields = torch.randint(0, n_entries, (bn, gp, 8), generator=g)
    fields[:n_entries, 0, :] = torch.arange(n_entries)[:, None]  # every index value in every field
    words = (fields << (bits * torch.arange(8))).sum(-1)
    words = (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)
    out = torch.empty(bn, 8 * gp, dtype=torch.float16, device=device)
    _dequant_words_probe[(1,)](words.to(device), table.to(device), out, BN=bn, GP=gp, B=bits)
    bitrev3 = torch.tensor([0, 4, 2, 6, 1, 5, 3, 7])
    want = table[fields[:, :, bitrev3]].reshape(bn, 8 * gp)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit k of the result is bit (a_k b_k c_k) of the look-up table ``lut``."""
    return sum(((lut >> ((((a >> k) & 1) << 2) | (((b >> k) & 1) << 1) | ((c >> k) & 1))) & 1) << k for k in range(32))


def _run_ptx(asm: str, inputs: list[int], n_out: int) -> list[int]:
    """Runs an inline-PTX block of 32-bit integer instructions (the subset the lookups use) on Python ints: ``$k``
    operands are the outputs, then ``inputs``; ``mov.b32 {$a, $b}, r`` splits r into 16-bit halves."""
    m32 = 0xFFFFFFFF
    regs = {f"${n_out + i}": v & m32 for i, v in enumerate(inputs)}
    ops = {"shr.b32": lambda a, b: a >> b, "shl.b32": lambda a, b: (a << b) & m32, "and.b32": lambda a, b: a & b,
           "xor.b32": lambda a, b: a ^ b, "mul.lo.u32": lambda a, b: (a * b) & m32,
           "prmt.b32": _prmt, "lop3.b32": _lop3}
    for stmt in filter(None, (t.strip() for t in asm.strip("{} ").split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        if op == "mov.b32":
            lo, hi, src = re.fullmatch(r"\{(\S+), (\S+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        dst, *args = [a.strip() for a in rest.split(",")]
        regs[dst] = ops[op](*[int(a, 0) if a[0].isdigit() else regs[a] for a in args])
    return [regs[f"${k}"] for k in range(n_out)]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_symmetric_lookup_returns_every_codebook_entry(d):
    """``SYMMETRIC_LOOKUP8_ASM`` run instruction by instruction on the CPU: with the magnitude words of a 4-bit
    codebook (``ops.paged_decode.codebook_magnitude_words``), every field of random words, and every index value in
    every field, comes back as the fp16 bits of exactly its codebook entry."""
    from turboquant_core.ops.paged_decode import codebook_magnitude_words

    table = codebook_tensors(4, d, "cpu")[0].to(torch.float16)
    entry_bits = table.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist()
    mag = list(codebook_magnitude_words(table))
    g = torch.Generator().manual_seed(d)
    fields = torch.randint(0, 16, (64, 8), generator=g)
    fields[:16] = torch.arange(16)[:, None]
    for f in fields.tolist():
        word = sum(i << (4 * j) for j, i in enumerate(f))
        assert _run_ptx(SYMMETRIC_LOOKUP8_ASM.value, [word, *mag], 8) == [entry_bits[i] for i in f]


def test_magnitude_words_refuse_a_codebook_that_is_not_symmetric():
    from turboquant_core.ops.paged_decode import codebook_magnitude_words

    table = codebook_tensors(4, 128, "cpu")[0].to(torch.float16)
    table[0] = table[0] * 1.5
    with pytest.raises(ValueError, match="symmetric"):
        codebook_magnitude_words(table)
    with pytest.raises(ValueError, match="16 entries"):
        codebook_magnitude_words(codebook_tensors(3, 128, "cpu")[0].to(torch.float16))

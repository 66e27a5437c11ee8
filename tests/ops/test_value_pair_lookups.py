# SPDX-License-Identifier: Apache-2.0
"""The decode kernel's token-pair value lookups (``paged_decode_jit._value_tile_pairs``, ``VPAIRS``) against its
words path (``_planes_to_words`` + ``_fields``), on the CPU: the kernels' own PTX text (``plane_transpose_asm``,
``pair_transpose_asm``, ``PERMUTE_LOOKUP4_ASM_16``, ``PAIR_LOOKUP4_ASM_16``) run by a small ``prmt`` / ``mov``
interpreter, and the Gluon tensor steps between them (reshape, permute, join, split) replayed in numpy.

``prmt.b32 d, a, b, c`` (default mode): the 8 bytes {b, a} are numbered 0-3 (a) and 4-7 (b); byte i of d is the
byte numbered by bits 0-2 of selector nibble i (c[4i+3:4i]); if bit 3 of that nibble is set, byte i is instead
the selected byte's bit 7 replicated (0x00 or 0xff). Only bits 0-15 of c are read.

What is checked, for head dims 64 and 128 (GRV = 1, 2 groups per lane and plane):
- the byte routing of both transposes, symbolically: every input byte carries a distinct tag and the permutes move
  tags, so the check covers every input (no selector nibble of a transpose has bit 3 set: checked);
- every value lookup: all 16**4 nibble combinations of one selector half (fields A, B of tokens t, t+1), for
  several codebooks (random fp16, negative values, the kernel's own 4-bit codebook bytes when available);
- whole tiles with random planes: the fp16 V^T tile [DP, BN] of both paths equals the codebook values of the
  fields at their V positions, and each A-operand register (V^T row, tokens 2i and 2i+1, fp16x2) of the new path
  is one 32-bit register an instruction of the pair lookup wrote, equal to the old path's repacked register.
"""

import re

import numpy as np
import pytest

from turboquant_core.kernels import paged_decode_jit as pd

BN = 16


def prmt(a, b, c):
    """Registers as int64 arrays [..., 4] of byte values (or tags); c an int selector (or an int array [...])."""
    src = np.concatenate([a, b], axis=-1)  # bytes 0-3 of a, 4-7 of b
    c = np.asarray(c, dtype=np.int64)
    out = []
    for i in range(4):
        nib = (c >> (4 * i)) & 0xF
        byte = np.take_along_axis(src, np.broadcast_to(nib & 7, src.shape[:-1])[..., None], axis=-1)[..., 0]
        if np.any(nib & 8):
            assert np.all(byte < 256), "sign replication of a tag"
            byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out.append(byte)
    return np.stack(out, axis=-1)


def to_bytes(x):
    x = np.asarray(x, dtype=np.int64)
    return np.stack([(x >> (8 * i)) & 0xFF for i in range(4)], axis=-1)


def from_bytes(r):
    return sum(r[..., i].astype(np.int64) << (8 * i) for i in range(4))


def run_asm(text, n_out, args):
    """Interprets ``text`` (prmt.b32 / mov.b32 {x, y}, r statements) with $0..$n_out-1 the outputs and
    $n_out.. the inputs (``args``, register byte arrays). Outputs of a split mov are 16-bit (as byte pairs padded
    with zeros); also returns the named temporaries (the 32-bit registers behind the 16-bit outputs)."""
    regs = {f"${n_out + i}": a for i, a in enumerate(args)}
    body = text.strip().strip("{}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        if stmt.startswith("prmt.b32"):
            d, a, b, c = [x.strip() for x in stmt[len("prmt.b32"):].split(",")]
            sel = int(c, 16) if c.startswith("0x") else from_bytes(regs[c])
            regs[d] = prmt(regs[a], regs[b], sel)
        elif stmt.startswith("mov.b32"):
            m = re.fullmatch(r"mov\.b32\s*\{\s*(\$\d+)\s*,\s*(\$\d+)\s*\}\s*,\s*(\w+)", stmt)
            lo, hi, src = m.groups()
            z = np.zeros_like(regs[src][..., :2])
            regs[lo] = np.concatenate([regs[src][..., :2], z], axis=-1)
            regs[hi] = np.concatenate([regs[src][..., 2:], z], axis=-1)
        else:
            raise ValueError(stmt)
    return [regs[f"${i}"] for i in range(n_out)], regs


def transpose_selectors_ok(text):
    return all(int(c, 16) & 0x8888 == 0 for c in re.findall(r"0x[0-9a-f]+", text))


def codebook_regs(values16):
    """``_codebook_bytes`` of 16 fp16 bit patterns: (lo0..lo3, hi0..hi3), as register byte arrays."""
    v = np.asarray(values16, dtype=np.int64)
    lo = [v[4 * k:4 * k + 4] & 0xFF for k in range(4)]
    hi = [v[4 * k:4 * k + 4] >> 8 for k in range(4)]
    return [np.asarray(x) for x in lo + hi]


def selectors(word):
    """``_lookup_selectors(word, 4)`` on integer words."""
    return word & 0x77777777, ((word >> 1) & 0x44444444) | 0x32103210


def lookup(asm, word, cb):
    """One 4-field lookup call (either asm) on integer selector words (low 16 bits used): its four 16-bit outputs
    and its two 32-bit result registers p, q."""
    x, half = selectors(word)
    shape = np.shape(word)
    args = [to_bytes(x), to_bytes(half)] + [np.broadcast_to(c, shape + (4,)) for c in cb]
    outs, regs = run_asm(asm, 4, args)
    return [from_bytes(o) for o in outs], from_bytes(regs["p"]), from_bytes(regs["q"])


def old_tile(planes, cb, grv):
    """planes[k]: [BN, 8] ints of grv bytes -> V^T [DP, BN] (16-bit patterns) and the repacked A-operand registers
    {(row, token pair): int} of the words path."""
    outs, _ = run_asm(pd.plane_transpose_asm(4, grv), grv, [to_bytes(p) for p in planes])
    words = np.stack([from_bytes(o) for o in outs], axis=-1)  # [BN, 8, GRV] (join / reshape of the kernel)
    f, pq = [], []
    for shift in (0, 16):
        (a, b, c, d), p, q = lookup(pd.ASM_16.value, words >> shift, cb)
        f += [a, b, c, d]
        pq += [p, q]  # p: fields (2m, 2m+1) of one token, q: (2m+2, 2m+3)
    vf = np.stack([np.stack([np.stack([f[0], f[1]], -1), np.stack([f[2], f[3]], -1)], -1),
                   np.stack([np.stack([f[4], f[5]], -1), np.stack([f[6], f[7]], -1)], -1)], -1)
    vt = vf.transpose(2, 5, 4, 3, 1, 0).reshape(64 * grv, BN)
    # the compiler's repacking (SASS: PRMT 0x5410 / 0x7632 of token 2i's and 2i+1's lookup registers)
    packed = {}
    for j in range(8):
        reg = pq[j // 2]  # [BN, 8, GRV] register holding field j (low half if j even)
        e, o = to_bytes(reg[0::2]), to_bytes(reg[1::2])
        packed[j] = from_bytes(prmt(e, o, 0x7632 if j % 2 else 0x5410))  # [BN/2, 8, GRV]
    return vt, packed


def split_tokens(p):
    t = p.reshape(BN // 2, 2, p.shape[1]).transpose(0, 2, 1)
    return t[..., 0], t[..., 1]


def new_tile(planes, cb, grv):
    """The VPAIRS path, step by step as ``_value_tile_pairs``: V^T [DP, BN] and the lookups' 32-bit registers
    {(field j): [BN/2, 8, GRV]} (token pair (2i, 2i+1) of field j)."""
    ev, od = zip(*(split_tokens(p) for p in planes))
    outs, _ = run_asm(pd.pair_transpose_asm(grv), 2 * grv, [to_bytes(p) for p in ev + od])
    w = [from_bytes(o) for o in outs]
    if grv == 1:
        words = np.stack([w[0], w[1]], -1)[:, :, None, :]
    else:
        words = np.stack([np.stack([w[0], w[1]], -1), np.stack([w[2], w[3]], -1)], -1)  # [BN/2, 8, GRV, h]
    (e0, o0, e1, o1), p0, q0 = lookup(pd.PAIR_LOOKUP4_ASM_16.value, words, cb)
    (e2, o2, e3, o3), p1, q1 = lookup(pd.PAIR_LOOKUP4_ASM_16.value, words >> 16, cb)
    j2 = lambda a, b: np.stack([a, b], -1)  # noqa: E731  (gl.join)
    f = j2(j2(j2(e0, o0), j2(e1, o1)), j2(j2(e2, o2), j2(e3, o3)))  # [BN/2, 8, GRV, h, tb, j0, j1]
    vt = f.transpose(2, 3, 6, 5, 1, 0, 4).reshape(64 * grv, BN)
    regs = {}
    for h in range(2):  # word half h (j2 = h): fields 4h + (0, 1) from the low selector half, + (2, 3) high
        regs[4 * h + 0], regs[4 * h + 1] = p0[..., h], q0[..., h]
        regs[4 * h + 2], regs[4 * h + 3] = p1[..., h], q1[..., h]
    return vt, regs


def reference_tile(planes, values16, grv):
    vt = np.zeros((64 * grv, BN), dtype=np.int64)
    for t in range(BN):
        for gl_ in range(8):
            for gr in range(grv):
                word = sum(((int(planes[k][t, gl_]) >> (8 * gr)) & 0xFF) << (8 * k) for k in range(4))
                for j in range(8):
                    pos = gl_ + 8 * (j & 1) + 16 * ((j >> 1) & 1) + 32 * (j >> 2) + 64 * gr
                    vt[pos, t] = values16[(word >> (4 * j)) & 0xF]
    return vt


def codebooks():
    rng = np.random.default_rng(0)
    books = [rng.standard_normal(16).astype(np.float16).view(np.uint16).astype(np.int64) for _ in range(3)]
    books.append(np.arange(16, dtype=np.int64) * 0x1111 ^ 0x8080)  # bytes with bit 7 set in every entry
    books.append((-np.abs(rng.standard_normal(16))).astype(np.float16).view(np.uint16).astype(np.int64))
    try:
        import torch

        from turboquant_core.codebooks import codebook_tensors

        cbt = codebook_tensors(4, 128)
        t = cbt[0] if isinstance(cbt, (tuple, list)) else cbt
        books.append(t.to(torch.float16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF)
    except Exception:  # the project's codebook is a bonus, not the point
        pass
    return books


@pytest.mark.parametrize("grv", [1, 2])
def test_transposes_route_bytes(grv):
    """Both transposes as byte routing (tags): token pair word (h, g) byte k = plane 2h + k//2 of group g of token
    2i + k%2; the words path's word g byte k = plane k of group g."""
    for text in (pd.plane_transpose_asm(4, grv), pd.pair_transpose_asm(grv)):
        assert transpose_selectors_ok(text)
    tag = lambda k, t, gl_, g: 1000 + ((k * BN + t) * 8 + gl_) * 4 + g  # noqa: E731
    planes = [np.array([[[tag(k, t, gl_, g) for g in range(4)] for gl_ in range(8)] for t in range(BN)])
              for k in range(4)]
    ev, od = zip(*(tuple(x.transpose(0, 1, 2)[i::2] for i in range(2)) for x in planes))
    outs, _ = run_asm(pd.pair_transpose_asm(grv), 2 * grv, list(ev) + list(od))
    for h in range(2):
        for g in range(grv):
            got = outs[h * grv + g]
            for k in range(4):
                tok = np.arange(BN // 2)[:, None] * 2 + k % 2
                want = np.array([[tag(2 * h + k // 2, t, gl_, g) for gl_ in range(8)] for t in tok[:, 0]])
                assert np.array_equal(got[..., k], want)
    outs, _ = run_asm(pd.plane_transpose_asm(4, grv), grv, planes)
    for g in range(grv):
        for k in range(4):
            assert np.array_equal(outs[g][..., k], planes[k][..., g])


@pytest.mark.parametrize("book", range(len(codebooks())))
def test_pair_lookup_exhaustive(book):
    """All 16**4 (field A, field B of token t, the same of t+1) of one selector half: the pair lookup's registers
    equal the words path's lookups of each token repacked (PRMT 0x5410 / 0x7632), and the codebook values."""
    values = codebooks()[book]
    cb = codebook_regs(values)
    n = np.arange(1 << 16, dtype=np.int64)
    ea, eb, oa, ob = n & 0xF, (n >> 4) & 0xF, (n >> 8) & 0xF, (n >> 12) & 0xF
    (s0, s1, s2, s3), p, q = lookup(pd.PAIR_LOOKUP4_ASM_16.value, n, cb)
    _, pe, _ = lookup(pd.ASM_16.value, ea | (eb << 4), cb)
    _, po, _ = lookup(pd.ASM_16.value, oa | (ob << 4), cb)
    old_a = from_bytes(prmt(to_bytes(pe), to_bytes(po), 0x5410))
    old_b = from_bytes(prmt(to_bytes(pe), to_bytes(po), 0x7632))
    assert np.array_equal(p, old_a) and np.array_equal(q, old_b)
    assert np.array_equal(p, values[ea] | (values[oa] << 16)) and np.array_equal(q, values[eb] | (values[ob] << 16))
    assert np.array_equal(s0, values[ea]) and np.array_equal(s1, values[oa])
    assert np.array_equal(s2, values[eb]) and np.array_equal(s3, values[ob])


@pytest.mark.parametrize("grv", [1, 2])
def test_tiles(grv, tiles=64):
    rng = np.random.default_rng(grv)
    for values in codebooks():
        cb = codebook_regs(values)
        for _ in range(tiles):
            planes = [rng.integers(0, 1 << (8 * grv), size=(BN, 8), dtype=np.int64) for _ in range(4)]
            vt_old, packed = old_tile(planes, cb, grv)
            vt_new, regs = new_tile(planes, cb, grv)
            assert np.array_equal(vt_old, vt_new)
            assert np.array_equal(vt_new, reference_tile(planes, values, grv))
            for j in range(8):
                # A operand (k_width 2): the register of V^T row (gl + 8*j0 + 16*j1 + 32*j2 + 64*gr), tokens
                # (2i, 2i+1) is what the pair lookup wrote, bit for bit the words path's repacked register
                assert np.array_equal(regs[j], packed[j])
                pos = (np.arange(8)[:, None] + 8 * (j & 1) + 16 * ((j >> 1) & 1) + 32 * (j >> 2)
                       + 64 * np.arange(grv)[None, :])  # [8, GRV]
                pair = vt_new[pos[None], 2 * np.arange(BN // 2)[:, None, None]] | (
                    vt_new[pos[None], 2 * np.arange(BN // 2)[:, None, None] + 1] << 16)
                assert np.array_equal(regs[j], pair)


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))

# SPDX-License-Identifier: Apache-2.0
"""TurboQuant MLA cache: page layout, one token's entry, the paged store against its reference, decode attention
references (compressed pages in the rotated domain against plain attention on dense latents) and the fidelity of
each latent encoding next to vLLM's fp8 MLA entries.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay small.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ops.test_codec import near_boundary
from turboquant_core.formats import KV_FORMATS, mla_format
from turboquant_core.ops.codec import encode, unpack_segments
from turboquant_core.ops.mla import (
    mla_absorbed_weights,
    mla_decode_attention,
    mla_decode_query_rows,
    mla_decode_rotation,
    mla_decode_splits,
    mla_gather_dequant,
    mla_mma_order,
    mla_store,
    mla_wgmma_order,
)
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_kv_cache_shape, mla_paged_layout
from turboquant_core.ops.mla_reference import (
    fp8_ds_mla_round_trip,
    fp8_mla_round_trip,
    mla_attention_dense_ref,
    mla_decode_attention_ref,
    mla_decode_ref,
    mla_encode_ref,
    mla_entries_from_bytes,
    mla_entry_bytes,
    mla_gather_dequant_ref,
    mla_store_ref,
    read_mla_slots,
)
from turboquant_core.packing import pack_indices
from turboquant_core.quantizer import FP8_MAX, split_segments

L, R = 512, 64
BLOCK = 16
# One preset per distinct latent encoding (presets with the same key encoding have the same MLA entry).
LATENT_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3p5bit_nc", "turboquant_k3v4_nc",
                  "turboquant_2p5bit_nc", "turboquant_2bit_nc")
SOFTMAX_SCALE = 1 / math.sqrt(128 + 64)  # DeepSeek V2: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)


def _latents(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents with a DeepSeek-like shape: kv_c RMS-normalized (kv_a_layernorm) times a learned gain, lognormal
    around 1 with 6 of the 512 channels about 12x larger; tokens share a mean direction; k_pe of unit scale."""
    z = torch.randn(n, L, generator=g) + 0.5 * torch.randn(1, L, generator=g)
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
    gain = torch.exp(0.3 * torch.randn(L, generator=g))
    gain[torch.randperm(L, generator=g)[:6]] *= 12
    return (z * gain).to(torch.bfloat16), torch.randn(n, R, generator=g).to(torch.bfloat16)


def _queries(kv_c: torch.Tensor, k_pe: torch.Tensor, heads: int, g: torch.Generator):
    """Absorbed queries [B, H, L] and q_pe [B, H, R] whose logits have a spread of 1 over the tokens, plus 0, 4, 8
    or 12 on one token per head (diffuse to peaked heads); the rope part adds a spread of about 0.5."""
    b, t, _ = kv_c.shape
    c = kv_c.float()
    ql = torch.randn(b, heads, L, generator=g)
    spread = (torch.einsum("bhl,btl->bht", ql, c) * SOFTMAX_SCALE).std(-1, keepdim=True)
    ql = ql / spread
    boost = torch.tensor([0.0, 4.0, 8.0, 12.0]).repeat(heads // 4 + 1)[:heads]
    j = torch.randint(0, t, (b, heads), generator=g)
    cj = c[torch.arange(b)[:, None], j]  # [B, H, L]
    ql = ql + boost[None, :, None] / SOFTMAX_SCALE * cj / cj.pow(2).sum(-1, keepdim=True)
    q_pe = torch.randn(b, heads, R, generator=g) * 0.5 / (SOFTMAX_SCALE * math.sqrt(R))
    return ql, q_pe


# ----------------------------------------------------------------------------------------------
# layout and entries
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(KV_FORMATS))
@pytest.mark.parametrize("block", [16, 64])
def test_layout_is_the_entries_without_padding(name, block):
    lay = mla_paged_layout(name, block)
    fmt = mla_format(name)
    assert lay.page_bytes == block * fmt.bytes_per_token() and lay.padding_bytes() == 0
    assert [s for s, _, _ in lay.sections()] == [s for s, _ in fmt.entry_sections()]
    assert all(off % 16 == 0 for _, off, _ in lay.sections())
    ends = [off + n for _, off, n in lay.sections()]
    assert all(e <= o for e, (_, o, _) in zip(ends, lay.sections()[1:])) and ends[-1] == lay.page_bytes
    assert mla_kv_cache_shape(7, lay) == (7, lay.page_bytes)


def test_layout_pads_unaligned_sections_and_rejects_bad_input():
    lay = mla_paged_layout("turboquant_k3v4_nc", 3)  # 3 x 192 = 576 B of indices, 3 x 128 of k_pe, 3 x 2 of scales
    assert (lay.index_offset, lay.rope_offset, lay.scale_offset, lay.page_bytes) == (0, 576, 960, 976)
    assert lay.padding_bytes() == 976 - 3 * 322
    with pytest.raises(ValueError, match="block_size"):
        mla_paged_layout("turboquant_k3v4_nc", 0)
    with pytest.raises(ValueError, match="valid formats"):
        mla_paged_layout("turboquant_9bit", 16)


@pytest.mark.parametrize("name", LATENT_PRESETS)
def test_entry_bytes_are_the_quantizer_packed_and_decode_back(name):
    """A token's entry, byte for byte: the latent's planar8 packing of the preset's key quantizer indices (one
    rotation over all 512 coordinates), k_pe as bf16, the fp16 scale; and back."""
    fmt = mla_format(name)
    g = torch.Generator().manual_seed(3)
    kv_c, k_pe = _latents(9, g)
    e = mla_encode_ref(kv_c, k_pe, fmt)
    data = mla_entry_bytes(e, fmt)
    assert data.shape == (9, fmt.bytes_per_token())
    lat = fmt.latent
    if lat.is_fp8:
        assert e.latent_scale is None
        assert torch.equal(data[:, :L], fmt.latent_quantizer().quantize(kv_c.float()))
    else:
        q = fmt.latent_quantizer().quantize(kv_c.float())
        packed, start = [], 0
        for n, b in split_segments(L, lat.bits):
            packed.append(pack_indices(q.idx[:, start : start + n], b))
            start += n
        assert torch.equal(data[:, : fmt.latent_index_bytes()], torch.cat(packed, dim=-1))
        assert torch.equal(data[:, -2:].contiguous().view(torch.float16)[:, 0], q.scale.half())
    k0 = fmt.latent_index_bytes()
    assert torch.equal(data[:, k0 : k0 + 2 * R].contiguous().view(torch.bfloat16), k_pe)
    back = mla_entries_from_bytes(data, fmt)
    kv_hat, pe_hat = mla_decode_ref(back, fmt)
    assert torch.equal(pe_hat, k_pe.float())
    want = fmt.latent_quantizer().dequantize(fmt.latent_quantizer().quantize(kv_c.float()))
    torch.testing.assert_close(kv_hat, want, rtol=0, atol=1e-5 * float(kv_c.float().abs().max()))
    rel = ((kv_hat - kv_c.float()).norm(dim=-1) / kv_c.float().norm(dim=-1)).max()
    assert rel < {8: 0.05, 4: 0.12, 3.5: 0.16, 3: 0.2, 2.5: 0.3, 2: 0.4}[lat.bits]


def test_entry_latent_is_the_dense_codec_encoding(device):
    """The latent's index bytes and scale are ``ops.codec.encode``'s for a 512-dim vector (kernel and reference)."""
    fmt = mla_format("turboquant_k3v4_nc")
    kv_c, k_pe = _latents(5, torch.Generator().manual_seed(4))
    e = mla_encode_ref(kv_c, k_pe, fmt)
    packed, scale = encode(kv_c.to(device), fmt.latent.bits, fmt.seed)
    near = near_boundary(kv_c, fmt.latent.bits, fmt.seed).any(-1)
    assert torch.equal(packed.cpu()[~near], e.latent_index[~near]) and near.float().mean() < 0.5
    torch.testing.assert_close(scale.cpu().float(), e.latent_scale.float(), rtol=2**-10, atol=0)


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------


def _fp8_near_tie(kv_c: torch.Tensor, seed: int) -> torch.Tensor:
    from turboquant_core.rotation import rotate

    t = rotate(kv_c.float(), seed).clamp(-FP8_MAX, FP8_MAX)
    eps = 1e-5 * t.abs() + 2e-7 * kv_c.float().norm(dim=-1, keepdim=True)
    return ((t + eps).to(torch.float8_e4m3fn).view(torch.uint8) != (t - eps).to(torch.float8_e4m3fn).view(torch.uint8))


def _check_store(kv_c, k_pe, slots, lay, device, cache=None):
    fmt = lay.fmt
    nb = 4
    init = torch.randint(0, 256, (nb, lay.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    got = (init.clone() if cache is None else cache).to(device)
    want = got.cpu().clone()
    mla_store(kv_c.to(device), k_pe.to(device), got, slots.to(device), lay)
    mla_store_ref(kv_c, k_pe, want, slots, lay)
    got = got.cpu()
    keep = slots[: kv_c.shape[0]] >= 0
    kept = slots[: kv_c.shape[0]][keep].long()
    # Bytes of skipped slots and of unused rows are untouched; k_pe rows are exact.
    untouched = torch.ones(nb * lay.block_size, dtype=torch.bool)
    untouched[kept] = False
    ge, we = read_mla_slots(got, lay, kept), read_mla_slots(want, lay, kept)
    assert torch.equal(ge.k_pe, we.k_pe)
    for _, off, size in lay.sections():
        per = size // lay.block_size
        rows_got = got[:, off : off + size].reshape(-1, per)
        assert torch.equal(rows_got[untouched], init.reshape(nb, -1)[:, off : off + size].reshape(-1, per)[untouched])
    # Latent bytes: identical outside rows that hold a coordinate within rounding of a decision boundary (the
    # kernel sums the rotation in another order); the scale within one fp16 step.
    x = kv_c[keep]
    if lay.latent_is_fp8:
        near = _fp8_near_tie(x, fmt.seed)
        assert torch.equal(ge.latent_index[~near], we.latent_index[~near])
        rows_near = near.any(-1)
    else:
        near = near_boundary(x, fmt.latent.bits, fmt.seed)
        rows_near = near.any(-1)
        ig, iw = unpack_segments(ge.latent_index, L, fmt.latent.bits), unpack_segments(we.latent_index, L,
                                                                                      fmt.latent.bits)
        assert torch.equal(ig[~near], iw[~near])
        torch.testing.assert_close(ge.latent_scale[~rows_near].float(), we.latent_scale[~rows_near].float(),
                                   rtol=2**-10, atol=0)
    assert torch.equal(ge.latent_index[~rows_near], we.latent_index[~rows_near])
    assert rows_near.float().mean() < 0.5
    return got, want


@pytest.mark.parametrize("name", LATENT_PRESETS)
def test_store_matches_reference(name, device):
    lay = mla_paged_layout(name, BLOCK)
    kv_c, k_pe = _latents(21, torch.Generator().manual_seed(5))
    kv_c[4] = 0  # a zero latent: scale 0
    slots = torch.randperm(4 * BLOCK, generator=torch.Generator().manual_seed(6))[:21]
    slots[[2, 11]] = -1
    _check_store(kv_c, k_pe, slots, lay, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_other_input_types(dtype, device):
    """fp16 and fp32 inputs: the latent as the reference encodes it, k_pe rounded to bf16 as torch rounds."""
    lay = mla_paged_layout("turboquant_k3v4_nc", BLOCK)
    kv_c, _ = _latents(7, torch.Generator().manual_seed(7))
    k_pe = torch.randn(7, R, generator=torch.Generator().manual_seed(8)) * 3
    slots = torch.tensor([1, 63, 17, 40, 5, 22, 9], dtype=torch.int32)
    _check_store(kv_c.to(dtype) * 7, k_pe.to(dtype), slots, lay, device)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_3p5bit_nc", "turboquant_k8v4"])
def test_store_of_a_prefill_takes_wide_chunks_and_matches_reference(name, device):
    """More tokens than a decode step stores (the wide column chunks of 64-token programs): the same bytes as the
    reference, but for coordinates within rounding of a decision boundary."""
    from turboquant_core.ops.mla import MLA_STORE_FEW_TOKENS, mla_store_chunk_groups

    n = MLA_STORE_FEW_TOKENS + 44
    assert mla_store_chunk_groups(n) != mla_store_chunk_groups(16)
    lay = mla_paged_layout(name, BLOCK)
    nb = -(-n // BLOCK) + 2
    kv_c, k_pe = _latents(n, torch.Generator().manual_seed(41))
    slots = torch.randperm(nb * BLOCK, generator=torch.Generator().manual_seed(42))[:n]
    slots[[0, 200]] = -1
    got = allocate_mla_cache(nb, lay, device)
    want = got.cpu().clone()
    mla_store(kv_c.to(device), k_pe.to(device), got, slots.to(device), lay)
    mla_store_ref(kv_c, k_pe, want, slots, lay)
    assert (got.cpu() != want).float().mean() < 1e-3


def test_store_into_strided_cache(device):
    """The block dim may be strided (a view into a larger allocation, as vLLM's cross-layer buffers); other
    layers' bytes stay untouched."""
    lay = mla_paged_layout("turboquant_4bit_nc", BLOCK)
    big = torch.randint(0, 256, (4, 3, lay.page_bytes), dtype=torch.uint8, device=device)
    before = big.clone()
    kv_c, k_pe = _latents(5, torch.Generator().manual_seed(9))
    slots = torch.tensor([0, 17, 63, -1, 33], device=device)
    mla_store(kv_c.to(device), k_pe.to(device), big[:, 1], slots, lay)
    ref = before[:, 1].cpu().clone()
    mla_store_ref(kv_c, k_pe, ref, slots.cpu(), lay)
    assert torch.equal(big[:, 0], before[:, 0]) and torch.equal(big[:, 2], before[:, 2])
    assert (big[:, 1].cpu() != ref).float().mean() < 2e-3


def test_store_rejects_bad_input(device):
    lay = mla_paged_layout("turboquant_k3v4_nc", BLOCK)
    cache = allocate_mla_cache(2, lay, device)
    kv_c, k_pe = torch.zeros(3, L, device=device), torch.zeros(3, R, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="does not match the layout"):
        mla_store(kv_c, k_pe, torch.zeros(2, 10, dtype=torch.uint8, device=device), slots, lay)
    with pytest.raises(ValueError, match="kv_c must be"):
        mla_store(kv_c[:, :256], k_pe, cache, slots, lay)
    with pytest.raises(ValueError, match="squeeze"):
        mla_store(kv_c, k_pe[:, None], cache, slots, lay)
    with pytest.raises(ValueError, match="slot_mapping"):
        mla_store(kv_c, k_pe, cache, slots[:2], lay)
    mla_store(kv_c[:0], k_pe[:0], cache, slots[:0], lay)  # no tokens: nothing to do


PROBE = r'''
import torch
from tests.ops import sm90_probe

sm90_probe.install_printer()

from turboquant_core.ops import mla as mla_ops
from turboquant_core.ops.mla import (
    mla_absorbed_weights,
    mla_decode_attention,
    mla_decode_splits,
    mla_gather_dequant,
    mla_store,
)
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout

for name in ("turboquant_2bit_nc", "turboquant_2p5bit_nc", "turboquant_k3v4_nc", "turboquant_3p5bit_nc",
             "turboquant_4bit_nc", "turboquant_k8v4"):
    lay = mla_paged_layout(name, 64)
    cache = allocate_mla_cache(4, lay)
    for dtype in (torch.bfloat16, torch.float16):
        mla_store(torch.randn(5, 512, dtype=dtype), torch.randn(5, 64, dtype=dtype), cache, torch.arange(5), lay)
    mla_store(torch.randn(300, 512, dtype=torch.bfloat16), torch.randn(300, 64, dtype=torch.bfloat16), cache,
              torch.arange(300) % 256, lay)
    args = (torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16), cache, lay,
            torch.zeros(2, 4, dtype=torch.int32), torch.tensor([10, 20], dtype=torch.int32), 0.1)
    mla_ops._gluon_runs = lambda device: False
    mla_decode_attention(*args, num_splits=2)
    mla_ops._gluon_runs = lambda device: True  # as on a GPU: the register-tile kernel where it applies
    if mla_ops.mla_mma_applies(lay, "cuda"):
        mla_decode_attention(*args, num_splits=2, kernel="mma")
        mla_decode_attention(*args, num_splits=2, kernel="wgmma")
    mla_ops._gluon_runs = lambda device: False
    mla_gather_dequant(cache, lay, torch.empty(30, 576, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32),
                       torch.tensor([0, 10, 30], dtype=torch.int32), torch.zeros(30, dtype=torch.int32), 30,
                       seq_starts=torch.zeros(2, dtype=torch.int32))
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    """The store (every latent encoding, bf16 and fp16 inputs, a decode step's narrow chunks and a prefill's wide
    ones), the decode attention with its split merge (the Triton kernel, and the register-tile and warpgroup-MMA
    kernels for the one-segment codebook latents) and the gather (every latent encoding) compile for sm_90, the
    register codebook lookups the interpreter cannot run included, with no register spills."""
    from tests.ops import sm90_probe

    res = sm90_probe.run_probe(PROBE)
    store = ["tq_mla_store_kernel", "tq_mla_store_finish_kernel"] * 3
    decode = ["tq_mla_decode_kernel", "tq_merge_splits_kernel"]
    mma = ["tq_mla_decode_mma_kernel", "tq_merge_splits_kernel", "tq_mla_decode_wgmma_kernel", "tq_merge_splits_kernel"]
    gather = ["tq_mla_gather_kernel"]
    # 2bit, k3v4 and 4bit latents are one codebook segment: the register-tile kernel serves them.
    one_segment = (True, False, True, False, True, False)
    want = [k for one in one_segment for k in store + decode + (mma if one else []) + gather]
    assert [r[0] for r in res] == want, res
    assert all(stack == 0 for _, _, stack, _ in res), res


WGMMA_PIPELINE_PROBE = r'''
import json
import torch
from tests.ops import sm90_probe

seen = sm90_probe.install_wgmma_reports("tq_mla_decode_wgmma_kernel")
from turboquant_core.ops import mla as mla_ops
from turboquant_core.ops.mla import mla_decode_attention
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout

mla_ops._gluon_runs = lambda device: True
for name in ("turboquant_2bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc"):
    lay = mla_paged_layout(name, 16)
    cache = allocate_mla_cache(4, lay)
    mla_decode_attention(torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16),
                         cache, lay, torch.zeros(2, 4, dtype=torch.int32), torch.tensor([10, 20], dtype=torch.int32),
                         0.1, num_splits=2, kernel="wgmma")
print(json.dumps(seen))
'''


@pytest.mark.slow
def test_wgmma_decode_keeps_its_output_product_in_flight():
    """ptxas keeps the warpgroup-MMA decode's overlap (the output product in flight while the next tile's first
    tokens are looked up): it serializes warpgroup MMAs (notes C7514, C7515) where other instructions read or write
    an accumulator while one is in flight, e.g. a path around the tile loop, and it fences each MMA on its own
    (a ``WARPGROUP.ARRIVE`` per ``HGMMA``, no note) where other instructions write its operand registers between
    them. No instruction writes the A registers of an MMA still in flight (``sm90_probe.wgmma_register_hazards``).
    And two programs fit an sm_90 SM (228 KB of shared memory, 1 KB of it reserved per program; 64 K registers) for
    every one-segment latent, as the launcher's ``MLA_WGMMA_PROGRAMS_PER_SM`` assumes."""
    from turboquant_core.ops.mla import MLA_WGMMA_PROGRAMS_PER_SM

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", WGMMA_PIPELINE_PROBE], env=env, capture_output=True, text=True,
                       timeout=900, cwd=root)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(res) == 3, res
    assert not any(r["serialized"] for r in res), res
    assert all(r["hgmma"] >= 8 * r["arrive"] for r in res), res  # each product's MMAs issued back to back
    assert not any(r["hazards"] for r in res), res  # no MMA in flight has its A registers rewritten
    per_sm = MLA_WGMMA_PROGRAMS_PER_SM
    assert all(r["stack"] == 0 and per_sm * (r["shared"] + 1024) <= 228 * 1024 for r in res), res
    assert all(per_sm * 128 * r["regs"] <= 64 * 1024 for r in res), res


# ----------------------------------------------------------------------------------------------
# gather (the prefill context)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LATENT_PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_dequant_matches_reference_and_the_stored_latents(name, dtype, device):
    """vLLM's gather_and_maybe_dequant_cache contract: a whole context, a short one, and a later chunk of a third
    (seq_starts); rows past num_tokens are left alone. The rows are the reference's decoded entries, and close to
    the latents that were stored."""
    lay, cache, bt, _, kv_c, k_pe, _, _ = _paged_requests(name, [37, 5, 64], heads=4, seed=12, device=device)
    starts = torch.tensor([0, 0, 16], dtype=torch.int32)
    lens = torch.tensor([37, 5, 48], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    n = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), lens)
    dst = torch.full((n + 3, L + R), float("nan"), dtype=dtype, device=device)
    args = (bt, cu.to(device), seq.to(device), n)
    # num_tokens as vLLM passes it: a row of its CPU cu_seq_lens (a 0-dim tensor), not an int
    mla_gather_dequant(cache, lay, dst, *args[:3], cu[-1], seq_starts=starts.to(device))
    ref = mla_gather_dequant_ref(cache, lay, *args, seq_starts=starts.to(device))
    assert torch.isnan(dst[n:]).all()
    # (fp16 codebook values, as attention's lookups: about 5e-4 relative of each coordinate)
    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=2e-3)
    torch.testing.assert_close(dst[:n].float().cpu(), ref.float().cpu(), **tol)
    # the rows are the tokens that were stored: k_pe exactly, the latent to its quantization error
    pos = torch.cat([torch.arange(s, s + m) for s, m in zip(starts.tolist(), lens.tolist())])
    want_pe = k_pe[seq.long(), pos].float()
    assert torch.equal(dst[:n, L:].float().cpu(), want_pe.to(dtype).float())
    want = kv_c[seq.long(), pos].float()
    rel = ((dst[:n, :L].float().cpu() - want).norm(dim=-1) / want.norm(dim=-1)).mean()
    assert rel < {"turboquant_k8v4": 0.05, "turboquant_4bit_nc": 0.15}.get(name, 0.5)


def test_gather_dequant_rejects_bad_input(device):
    lay = mla_paged_layout("turboquant_k3v4_nc", BLOCK)
    cache = allocate_mla_cache(4, lay, device)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    seq = torch.zeros(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"dst must be \[>= 4, 576\]"):
        mla_gather_dequant(cache, lay, torch.empty(4, 512, device=device), bt, cu, seq, 4)
    with pytest.raises(ValueError, match="dst must be float16, bfloat16 or float32"):
        mla_gather_dequant(cache, lay, torch.empty(4, 576, dtype=torch.int32, device=device), bt, cu, seq, 4)
    with pytest.raises(ValueError, match="token_to_seq must be 1-D with >= 4"):
        mla_gather_dequant(cache, lay, torch.empty(4, 576, device=device), bt, cu, seq[:2], 4)
    out = torch.full((2, 576), 7.0, device=device)
    assert mla_gather_dequant(cache, lay, out, bt, cu, seq, 0) is out and (out == 7).all()


# ----------------------------------------------------------------------------------------------
# decode attention references and fidelity
# ----------------------------------------------------------------------------------------------


def _paged_requests(name, seq_lens, heads, seed, device="cpu"):
    """Latents of each request stored (reference store) into shuffled pages; queries as ``_queries``."""
    g = torch.Generator().manual_seed(seed)
    lay = mla_paged_layout(name, BLOCK)
    b, t = len(seq_lens), max(seq_lens)
    per = -(-t // BLOCK)
    nb = b * per + 3
    bt = torch.randperm(nb, generator=g)[: b * per].view(b, per).to(torch.int32)
    cache = torch.randint(0, 256, (nb, lay.page_bytes), dtype=torch.uint8, generator=g)
    kv_c, k_pe = _latents(b * t, g)
    kv_c, k_pe = kv_c.view(b, t, L), k_pe.view(b, t, R)
    pos = torch.arange(t)
    for r, n in enumerate(seq_lens):
        slots = bt[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
        slots[n:] = -1
        mla_store_ref(kv_c[r], k_pe[r], cache, slots, lay)
    ql, q_pe = _queries(kv_c, k_pe, heads, g)
    return lay, cache.to(device), bt.to(device), torch.tensor(seq_lens, dtype=torch.int32), kv_c, k_pe, ql, q_pe


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_3p5bit_nc", "turboquant_k8v4"])
def test_decode_attention_in_the_rotated_domain_is_attention_on_the_decoded_latents(name):
    """Rotating the absorbed query once and un-rotating the output once per head gives exactly the attention of
    the dequantized latents (the rotation is orthogonal), to float rounding."""
    lay, cache, bt, seq_lens, kv_c, k_pe, ql, q_pe = _paged_requests(name, [37, 5, 64], heads=4, seed=10)
    out, lse = mla_decode_attention_ref(ql, q_pe, cache, lay, bt, seq_lens, SOFTMAX_SCALE)
    b, t = kv_c.shape[:2]
    slots = (bt.long()[:, torch.arange(t) // BLOCK] * BLOCK + torch.arange(t) % BLOCK).clamp_max(
        cache.shape[0] * BLOCK - 1)
    dk, dp = mla_decode_ref(read_mla_slots(cache, lay, slots.reshape(-1)), lay.fmt)
    want, want_lse = mla_attention_dense_ref(ql, q_pe, dk.view(b, t, L), dp.view(b, t, R), seq_lens, SOFTMAX_SCALE)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)
    assert out.shape == (3, 4, L) and lse.shape == (3, 4)


def test_dense_reference_is_plain_mla_attention():
    """``mla_attention_dense_ref`` is the absorbed form of MLA: softmax over q_nope . k_nope + q_pe . k_pe with
    k_nope = W_UK kv_c, then W_UV applied to the latent output, is the same attention."""
    g = torch.Generator().manual_seed(11)
    heads, nope, v_dim, t = 3, 16, 8, 10
    kv_c, k_pe = torch.randn(1, t, L, generator=g, dtype=torch.float64), torch.randn(1, t, R, generator=g,
                                                                                      dtype=torch.float64)
    w_uk, w_uv = torch.randn(heads, nope, L, generator=g, dtype=torch.float64), torch.randn(heads, L, v_dim,
                                                                                             generator=g,
                                                                                             dtype=torch.float64)
    q_nope, q_pe = torch.randn(1, heads, nope, generator=g, dtype=torch.float64), torch.randn(1, heads, R,
                                                                                                generator=g,
                                                                                                dtype=torch.float64)
    k_nope = torch.einsum("hnl,tl->htn", w_uk, kv_c[0])
    s = (torch.einsum("hn,htn->ht", q_nope[0], k_nope) + q_pe[0] @ k_pe[0].T) * SOFTMAX_SCALE
    v = torch.einsum("tl,hlv->htv", kv_c[0], w_uv)
    want = torch.einsum("ht,htv->hv", torch.softmax(s, -1), v)
    ql = torch.einsum("hn,hnl->hl", q_nope[0], w_uk)[None]
    out, lse = mla_attention_dense_ref(ql, q_pe, kv_c, k_pe, torch.tensor([t]), SOFTMAX_SCALE)
    torch.testing.assert_close(torch.einsum("hl,hlv->hv", out[0].double(), w_uv), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(s, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,splits", [("turboquant_k3v4_nc", 1), ("turboquant_k3v4_nc", 3),
                                         ("turboquant_4bit_nc", 2), ("turboquant_2bit_nc", 1),
                                         ("turboquant_3p5bit_nc", 2), ("turboquant_k8v4", 2)])
def test_decode_attention_kernel_matches_reference(name, splits, device):
    """The split-KV kernel against the reference on the same pages: 20 heads (a full block of 16 and a partial
    one), requests of 37, 5, 70 and 0 tokens over shuffled pages, bf16 queries. On a GPU the one-segment codebook
    latents (2, 3, 4 bits) run the register-tile kernel, the others the Triton kernel. Differences: the queries
    and values as fp16 tensor-core operands and the bf16 output (a few 1e-3)."""
    lay, cache, bt, seq_lens, _, _, ql, q_pe = _paged_requests(name, [37, 5, 70, 0], heads=20, seed=13,
                                                               device=device)
    ql, q_pe = ql.to(torch.bfloat16), q_pe.to(torch.bfloat16)
    ref, ref_lse = mla_decode_attention_ref(ql.float(), q_pe.float(), cache.cpu(), lay, bt.cpu(), seq_lens,
                                            SOFTMAX_SCALE)
    out, lse = mla_decode_attention(ql.to(device), q_pe.to(device), cache, lay, bt, seq_lens.to(device),
                                    SOFTMAX_SCALE, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 20, L) and lse.shape == (4, 20)
    out, lse = out.float().cpu(), lse.cpu()
    live = seq_lens > 0
    rel = (out[live] - ref[live]).norm(dim=-1) / ref[live].norm(dim=-1)
    assert rel.max() < 1e-2, float(rel.max())
    torch.testing.assert_close(lse[live], ref_lse[live], rtol=0, atol=1e-2)
    assert torch.isinf(lse[~live]).all() and (lse[~live] < 0).all() and not out[~live].any()


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_k8v4"])
def test_rotation_folded_into_the_absorbed_weights_gives_the_same_heads(name, device):
    """vLLM's decode: q_nope @ W_UK_T, attention, then @ W_UV. With mla_absorbed_weights' W_UK_T and W_UV and
    ``rotated=True`` (no rotation product per step) the value heads are those of the per-step rotation, to the
    rounding of the bf16 weights and of the fp16 operands."""
    lay, cache, bt, seq_lens, _, _, _, q_pe = _paged_requests(name, [37, 5, 70], heads=4, seed=31, device=device)
    g = torch.Generator().manual_seed(32)
    h, p, v = 4, 64, 48
    w_uk_t = (torch.randn(h, p, L, generator=g) / p ** 0.5).to(torch.bfloat16).to(device)
    w_uv = (torch.randn(h, L, v, generator=g) / L ** 0.5).to(torch.bfloat16).to(device)
    q_nope = torch.randn(3, h, p, generator=g).to(torch.bfloat16).to(device)
    q_pe, sl = q_pe.to(torch.bfloat16).to(device), seq_lens.to(device)
    ql = torch.einsum("bhp,hpl->bhl", q_nope.float(), w_uk_t.float()).to(torch.bfloat16)
    out, lse = mla_decode_attention(ql, q_pe, cache, lay, bt, sl, SOFTMAX_SCALE, num_splits=2)
    want = torch.einsum("bhl,hlv->bhv", out.float(), w_uv.float())
    f_uk, f_uv = mla_absorbed_weights(lay, w_uk_t, w_uv)
    assert f_uk.shape == w_uk_t.shape and f_uv.shape == w_uv.shape and f_uk.dtype == torch.bfloat16
    ql_rot = torch.einsum("bhp,hpl->bhl", q_nope.float(), f_uk.float()).to(torch.bfloat16)
    out_rot, lse_rot = mla_decode_attention(ql_rot, q_pe, cache, lay, bt, sl, SOFTMAX_SCALE, num_splits=2,
                                            rotated=True)
    assert out_rot.dtype == torch.bfloat16
    got = torch.einsum("bhl,hlv->bhv", out_rot.float(), f_uv.float())
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.max() < 2e-2, float(rel.max())
    torch.testing.assert_close(lse_rot, lse, rtol=5e-3, atol=2e-2)
    with pytest.raises(ValueError, match="W_UK_T"):
        mla_absorbed_weights(lay, w_uk_t[..., :256], w_uv)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_3p5bit_nc"])
def test_a_tensor_parallel_rank_decodes_its_heads_as_the_whole_layer_does(name, device):
    """Tensor parallelism keeps the whole latent cache on every rank and gives each a share of the query heads (and
    of W_UK_T / W_UV's heads). Each of two ranks holding 8 of 16 heads gets the outputs of those heads of the
    single-GPU decode: the kernels' head rows are independent, and the folded weights are the same per head."""
    lay, cache, bt, seq_lens, _, _, ql, q_pe = _paged_requests(name, [37, 5, 70], heads=16, seed=43, device=device)
    # Queries as the folded weights make them (rotated), so that only the kernels are compared.
    ql = (ql.float() @ mla_decode_rotation(lay, device).cpu().T).to(torch.bfloat16).to(device)
    q_pe, sl = q_pe.to(torch.bfloat16).to(device), seq_lens.to(device)
    out, lse = mla_decode_attention(ql, q_pe, cache, lay, bt, sl, SOFTMAX_SCALE, num_splits=2, rotated=True)
    g = torch.Generator().manual_seed(44)
    w_uk_t = (torch.randn(16, 32, L, generator=g) / 32 ** 0.5).to(torch.bfloat16).to(device)
    w_uv = (torch.randn(16, L, 24, generator=g) / L ** 0.5).to(torch.bfloat16).to(device)
    f_uk, f_uv = mla_absorbed_weights(lay, w_uk_t, w_uv)
    for r in range(2):
        heads = slice(8 * r, 8 * r + 8)
        out_r, lse_r = mla_decode_attention(ql[:, heads].contiguous(), q_pe[:, heads].contiguous(), cache, lay, bt,
                                            sl, SOFTMAX_SCALE, num_splits=2, rotated=True)
        # Equal but for float rounding: the interpreter's products may sum a row in another order at another
        # position of the head block, and the sum is rounded to bf16 after (two bf16 steps at most: a run of the
        # CPU suite saw one output near zero two steps apart).
        torch.testing.assert_close(out_r.float(), out[:, heads].float(), rtol=2**-6, atol=0)
        torch.testing.assert_close(lse_r, lse[:, heads], rtol=0, atol=1e-5)
        f_uk_r, f_uv_r = mla_absorbed_weights(lay, w_uk_t[heads], w_uv[heads])
        assert torch.equal(f_uk_r, f_uk[heads]) and torch.equal(f_uv_r, f_uv[heads])


def test_register_tile_order_gives_each_warp_its_own_groups():
    """The register-tile kernel's order is a permutation of the 512 rotated coordinates in which warp w's 128
    positions are exactly the 8 fields of groups 16w..16w+15 (coordinate j*64 + g), the bytes it loads."""
    order = mla_mma_order(512, 4)
    assert torch.equal(order.sort().values, torch.arange(512))
    for w in range(4):
        groups = order[128 * w : 128 * (w + 1)] % 64
        assert sorted(set(groups.tolist())) == list(range(16 * w, 16 * w + 16))


def test_warpgroup_order_puts_each_group_in_eight_consecutive_positions():
    """The warpgroup-MMA kernel's order is a permutation of the 512 rotated coordinates in which positions 8g..8g+7
    are the 8 fields of group g (coordinate j*64 + g), as the kernel stores a group's looked-up values."""
    order = mla_wgmma_order(512)
    assert torch.equal(order.sort().values, torch.arange(512))
    assert torch.equal(order.view(64, 8) % 64, torch.arange(64)[:, None].expand(64, 8))
    assert torch.equal(order.view(64, 8) // 64, torch.arange(8)[None, :].expand(64, 8))


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc"])
def test_decode_rotation_is_one_rotation_in_every_kernel_order(name):
    """Every kernel's rotation is the latent's orthogonal rotation, rows reordered: the Triton kernel's order
    (attention rows of the codec), the register-tile kernel's and the warpgroup-MMA kernel's differ by
    permutations. An unknown kernel name is refused with the valid ones."""
    lay = mla_paged_layout(name, BLOCK)
    triton_rows = mla_decode_rotation(lay, "cpu", "triton").double()
    eye = torch.eye(L, dtype=torch.float64)
    for kernel in ("mma", "wgmma"):
        rows = mla_decode_rotation(lay, "cpu", kernel).double()
        torch.testing.assert_close(rows @ rows.T, eye, rtol=0, atol=1e-5)
        perm = rows @ triton_rows.T
        torch.testing.assert_close(perm.round(), perm, rtol=0, atol=1e-5)
        assert torch.equal(perm.round().abs().sum(0), torch.ones(L, dtype=torch.float64))
        assert not torch.equal(perm.round(), eye)
    with pytest.raises(ValueError, match="wgmma, mma, triton"):
        mla_decode_rotation(lay, "cpu", "flash")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["wgmma", "mma", "triton"])
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc", "turboquant_2bit_nc"])
def test_each_decode_kernel_matches_reference_over_many_tiles(name, kernel):
    """Each decode kernel, chosen by name, against the reference: requests of 700 (many 64-token tiles and a
    partial one), 129, 64, 1 and 0 tokens over shuffled pages, 16 and 24 heads, one and three splits. The
    warpgroup-MMA kernel needs an sm_90 GPU."""
    if kernel == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup-MMA kernel needs sm_90a")
    for heads, splits in ((16, 1), (24, 3)):
        lay, cache, bt, seq_lens, _, _, ql, q_pe = _paged_requests(name, [700, 129, 64, 1, 0], heads=heads,
                                                                   seed=17 + heads, device="cuda")
        ql, q_pe = ql.to(torch.bfloat16), q_pe.to(torch.bfloat16)
        ref, ref_lse = mla_decode_attention_ref(ql.float(), q_pe.float(), cache.cpu(), lay, bt.cpu(), seq_lens,
                                                SOFTMAX_SCALE)
        rows = mla_decode_rotation(lay, "cuda", kernel)
        ql_rot = (ql.float().cuda() @ rows.T).to(torch.bfloat16)
        out, lse = mla_decode_attention(ql_rot, q_pe.cuda(), cache, lay, bt, seq_lens.cuda(), SOFTMAX_SCALE,
                                        num_splits=splits, rotated=True, kernel=kernel)
        out = (out.float() @ rows).cpu()
        lse = lse.cpu()
        live = seq_lens > 0
        rel = (out[live] - ref[live]).norm(dim=-1) / ref[live].norm(dim=-1)
        assert rel.max() < 1e-2, (heads, splits, float(rel.max()))
        torch.testing.assert_close(lse[live], ref_lse[live], rtol=0, atol=1e-2)
        assert torch.isinf(lse[~live]).all() and (lse[~live] < 0).all()


def test_requests_with_several_query_tokens_decode_as_causal_rows(device):
    """Decode requests of 1, 3 and 4 query tokens (a decode, a chunked prompt's last tokens, draft verification) as
    one row per token: each token attends to its request's tokens up to its own position, as a one-token request of
    that length would."""
    seq = [37, 5, 70]
    q_lens = [1, 3, 4]
    lay, cache, bt, seq_lens, _, _, ql, q_pe = _paged_requests("turboquant_k3v4_nc", seq, heads=16, seed=15,
                                                               device=device)
    qsl = torch.tensor([0, 1, 4, 8], dtype=torch.int32)
    rows_bt, rows_seq = mla_decode_query_rows(bt, seq_lens.to(device), qsl.to(device), 8)
    assert rows_seq.dtype == torch.int32 and rows_seq.tolist() == [37, 3, 4, 5, 67, 68, 69, 70]
    assert torch.equal(rows_bt.cpu(), bt.cpu()[[0, 1, 1, 1, 2, 2, 2, 2]])
    g = torch.Generator().manual_seed(16)
    ql = torch.randn(8, 16, L, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(8, 16, R, generator=g).to(torch.bfloat16)
    out, lse = mla_decode_attention(ql.to(device), q_pe.to(device), cache, lay, rows_bt, rows_seq, SOFTMAX_SCALE,
                                    num_splits=2)
    token = 0
    for r, q in enumerate(q_lens):
        for j in range(q):
            n = torch.tensor([seq[r] - q + j + 1], dtype=torch.int32)
            want, want_lse = mla_decode_attention_ref(ql[token: token + 1].float(), q_pe[token: token + 1].float(),
                                                      cache.cpu(), lay, bt.cpu()[r: r + 1], n, SOFTMAX_SCALE)
            got = out[token].float().cpu()
            assert ((got - want[0]).norm(dim=-1) / want[0].norm(dim=-1)).max() < 1e-2, (r, j)
            torch.testing.assert_close(lse[token].cpu(), want_lse[0], rtol=0, atol=1e-2)
            token += 1
    with pytest.raises(ValueError, match="query_start_loc must have 4 entries"):
        mla_decode_query_rows(bt, seq_lens, qsl[:3], 8)


def test_decode_attention_split_count_changes_little(device):
    lay, cache, bt, seq_lens, _, _, ql, q_pe = _paged_requests("turboquant_2bit_nc", [70], heads=4, seed=14,
                                                               device=device)
    args = (ql.to(device), q_pe.to(device), cache, lay, bt, seq_lens.to(device), SOFTMAX_SCALE)
    one, lse1 = mla_decode_attention(*args, num_splits=1)
    three, lse3 = mla_decode_attention(*args, num_splits=3)
    torch.testing.assert_close(three, one, rtol=1e-4, atol=1e-4 * float(one.abs().max()))
    torch.testing.assert_close(lse3, lse1, rtol=0, atol=1e-4)
    assert mla_decode_splits(8, 16, 100_000, torch.device("cpu")) == 1


def test_split_counts_fill_waves_of_the_programs_each_kernel_fits_per_sm(monkeypatch):
    """On a 132-SM GPU the split counts fill the waves of the programs a kernel fits per SM: for the register-tile
    kernel (two per SM) the ones benchmarks/bench_mla_decode.py measured fastest (H100, 16 heads), 4 at 64 x 1024, 2
    at 384 x 2048 (1 left a wave half full), 8 at 32 x 8192; the warpgroup-MMA kernel fits two per SM too. One request
    takes as many as its length allows."""
    from turboquant_core.ops import paged_attention

    monkeypatch.setattr(paged_attention, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert [mla_decode_splits(b, 16, n, cuda) for b, n in [(64, 1024), (384, 2048), (32, 8192)]] == [4, 2, 8]
    assert [mla_decode_splits(b, 16, n, cuda, "wgmma") for b, n in [(64, 1024), (384, 2048), (32, 8192)]] == [4, 2, 8]
    assert mla_decode_splits(1, 16, 8192, cuda) >= 31 and mla_decode_splits(2, 16, 100, cuda) == 1


def test_decode_attention_rejects_bad_input(device):
    lay = mla_paged_layout("turboquant_k3v4_nc", BLOCK)
    cache = allocate_mla_cache(2, lay, device)
    ql, q_pe = torch.zeros(2, 4, L, device=device), torch.zeros(2, 4, R, device=device)
    bt, sl = torch.zeros(2, 2, dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="ql_nope"):
        mla_decode_attention(ql[..., :256], q_pe, cache, lay, bt, sl, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        mla_decode_attention(ql, q_pe, cache, lay, bt[:1], sl, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode_attention(ql, q_pe, cache, lay, bt, sl[:1], 0.1)
    with pytest.raises(ValueError, match="does not match the layout"):
        mla_decode_attention(ql, q_pe, cache[:, :100], lay, bt, sl, 0.1)


# Largest mean relative error of the latent output (per request and head, against fp32 attention on the dense
# latents) allowed per entry, about 1.3x what the data below gives (printed by the test).
OUT_ERR_BUDGET = {"fp8": 0.023, "fp8_ds_mla": 0.013, "turboquant_k8v4": 0.02, "turboquant_4bit_nc": 0.067,
                  "turboquant_3p5bit_nc": 0.11, "turboquant_k3v4_nc": 0.132, "turboquant_2p5bit_nc": 0.206,
                  "turboquant_2bit_nc": 0.256}


def test_fidelity_of_each_latent_encoding_next_to_vllm_fp8(capsys):
    """MLA decode attention on compressed latents against fp32 attention on the dense (bf16) latents: 2 requests of
    256 tokens with DeepSeek-like statistics, 16 heads from diffuse to peaked. Rows: vLLM's fp8 (per-tensor e4m3,
    scale 1.0, the default without calibration; k_pe in fp8 too) and fp8_ds_mla (e4m3 per 128 + bf16 k_pe), then
    each TurboQuant latent encoding (bf16 k_pe). Columns: bytes per token and layer, the latents' relative MSE, the
    output's relative error (mean and max over requests and heads), the largest log-sum-exp error, and the mean
    output error with the compressed latent in one role only (scores: the latent as key, dense values; output:
    dense scores, the latent as value)."""
    g = torch.Generator().manual_seed(12)
    b, t, heads = 2, 256, 16
    kv_c, k_pe = _latents(b * t, g)
    kv_c, k_pe = kv_c.view(b, t, L), k_pe.view(b, t, R)
    ql, q_pe = _queries(kv_c, k_pe, heads, g)
    seq_lens = torch.tensor([t, t - 37])
    x, pe = kv_c.float(), k_pe.float()
    mask = torch.arange(t)[None, :] < seq_lens[:, None]

    def attend(keys, rope, values):  # [B, T, L], [B, T, R], [B, T, L] -> (out [B, H, L], lse [B, H]), float64
        s = (torch.einsum("bhl,btl->bht", ql.double(), keys.double())
             + torch.einsum("bhr,btr->bht", q_pe.double(), rope.double())) * SOFTMAX_SCALE
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.einsum("bht,btl->bhl", torch.softmax(s, -1), values.double()), torch.logsumexp(s, -1)

    ref, ref_lse = attend(x, pe, x)

    def err(out):
        return (out - ref).norm(dim=-1) / ref.norm(dim=-1)

    def row(name, nbytes, kv_hat, pe_hat):
        out, lse = attend(kv_hat, pe_hat, kv_hat)
        return dict(name=name, bytes=nbytes, latent_mse=float((kv_hat - x).pow(2).sum() / x.pow(2).sum()),
                    out_mean=float(err(out).mean()), out_max=float(err(out).max()),
                    lse=float((lse - ref_lse).abs().max()), as_key=float(err(attend(kv_hat, pe_hat, x)[0]).mean()),
                    as_value=float(err(attend(x, pe, kv_hat)[0]).mean()))

    rows = [row("fp8", 576, *fp8_mla_round_trip(kv_c, k_pe, scale=1.0)),
            row("fp8_ds_mla", 656, *fp8_ds_mla_round_trip(kv_c, k_pe))]
    for name in LATENT_PRESETS:
        fmt = mla_format(name)
        rows.append(row(name, fmt.bytes_per_token(), *mla_decode_ref(mla_encode_ref(kv_c, k_pe, fmt), fmt)))
    # The batched attention above is the reference's: check it once on the dense latents.
    dense, dense_lse = mla_attention_dense_ref(ql, q_pe, x, pe, seq_lens, SOFTMAX_SCALE)
    torch.testing.assert_close(dense.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    with capsys.disabled():
        print("\nMLA decode attention vs fp32 on dense latents (2 x 256 tokens, 16 heads); out err: relative, per "
              "request and head")
        print(f"{'entry':22} {'B/token':>7} {'latent rel MSE':>14} {'out err mean':>12} {'out err max':>11} "
              f"{'lse err max':>11} {'as key only':>11} {'as value only':>13}")
        for r in rows:
            print(f"{r['name']:22} {r['bytes']:7d} {r['latent_mse']:14.2e} {r['out_mean']:12.4f} {r['out_max']:11.4f} "
                  f"{r['lse']:11.4f} {r['as_key']:11.4f} {r['as_value']:13.4f}")
    for r in rows:
        assert r["out_mean"] < OUT_ERR_BUDGET[r["name"]], r
    by = {r["name"]: r for r in rows}
    # More bits, less error; the 4-bit latent's relative MSE is the Lloyd-Max distortion of its codebook (0.0095).
    errs = [by[n]["out_mean"] for n in LATENT_PRESETS]
    assert errs == sorted(errs)
    assert by["turboquant_4bit_nc"]["latent_mse"] == pytest.approx(0.0095, rel=0.1)


MAXNREG_PROBE = r'''
import torch
from tests.ops import sm90_probe

sm90_probe.install_printer()

from turboquant_core.ops import mla as mla_ops
from turboquant_core.ops.mla import mla_decode_attention
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout

lay = mla_paged_layout("turboquant_k3v4_nc", 64)
mla_ops._gluon_runs = lambda device: True
args = (torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16),
        allocate_mla_cache(4, lay), lay, torch.zeros(2, 4, dtype=torch.int32),
        torch.tensor([10, 20], dtype=torch.int32), 0.1)
for cap in (None, 168):
    mla_ops.MLA_MMA_MAXNREG = cap
    mla_decode_attention(*args, num_splits=2)
'''


@pytest.mark.slow
def test_register_tile_decode_takes_the_register_cap():
    """MLA_MMA_MAXNREG reaches the register-tile kernel's compile: uncapped it takes more than 168 registers per
    thread (two programs per SM), capped it takes 168 (three)."""
    from tests.ops import sm90_probe

    res = [r for r in sm90_probe.run_probe(MAXNREG_PROBE) if r[0] == "tq_mla_decode_mma_kernel"]
    assert len(res) == 2, res
    assert res[0][1] > 168 and res[1][1] == 168, res

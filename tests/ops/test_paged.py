# SPDX-License-Identifier: Apache-2.0
"""Paged TurboQuant cache: layout, store, attention, merge and gather-dequant against the references.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay small.
"""

import itertools
import math
import zlib

import pytest
import torch

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.formats import format_names, get_format
from turboquant_core.ops.codec import decode, decode_ref, unpack_segments
from turboquant_core.ops.paged import (
    TQAttentionConfig,
    TQAttentionPlan,
    allocate_kv_cache,
    attention_coordinate_order,
    dequant_cached_ref,
    kv_cache_shape,
    merge_attn_states,
    page_bytes_per_block,
    paged_layout,
    read_cached_tokens,
    read_slots,
    tq_gather_dequant,
    tq_gather_dequant_ref,
    tq_paged_attention,
    tq_paged_attention_ref,
    tq_store,
    tq_store_ref,
)
from turboquant_core.ops.rotation_tables import codec_tables
from turboquant_core.quantizer import FP8_MAX, split_segments
from turboquant_core.rotation import rotate

BLOCK = 16
OUT_ATOL, OUT_RTOL, LSE_ATOL = 2e-2, 1e-2, 1e-3
# The kernel's rotated query is fp16 (2**-11 relative rounding, finer than the bf16 query itself):
# log-sum-exp errors then scale with |lse|.
LSE_RTOL_FP16_QUERY = 5e-4


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", format_names())
@pytest.mark.parametrize("d", [64, 128, 256])
def test_layout_has_no_padding_for_block_16(name, d):
    lay = paged_layout(name, d, BLOCK)
    fmt = get_format(name)
    assert lay.head_page_bytes == BLOCK * fmt.bytes_per_token_per_head(d)
    assert lay.padding_bytes() == 0
    assert all(off % 16 == 0 for _, off, _ in lay.sections())
    # sections are disjoint and in order
    ends = [off + n for _, off, n in lay.sections()]
    assert all(e <= o for e, (_, o, _) in zip(ends, lay.sections()[1:]))
    assert kv_cache_shape(10, BLOCK, 3, d, name) == (10, 3, lay.head_page_bytes)
    assert page_bytes_per_block(BLOCK, 3, d, name) == 3 * lay.head_page_bytes


def test_layout_pads_unaligned_sections():
    lay = paged_layout("turboquant_k3v4_nc", 64, 3)  # 3 tokens x 24 B = 72 B: next section at 80
    assert lay.v_index_offset == 80
    assert all(off % 16 == 0 for _, off, _ in lay.sections())
    assert lay.head_page_bytes % 16 == 0 and lay.padding_bytes() > 0


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="turboquant_k8v4"):
        paged_layout("turboquant_9bit", 128, 16)
    with pytest.raises(ValueError, match="head_dim"):
        paged_layout("turboquant_4bit_nc", 100, 16)
    with pytest.raises(ValueError, match="block_size"):
        paged_layout("turboquant_4bit_nc", 128, 0)


@pytest.mark.parametrize("name,d", [("turboquant_k3v4_nc", 128), ("turboquant_3p5bit_nc", 80),
                                    ("turboquant_k8v4", 96)])
def test_attention_coordinate_order_is_a_padded_permutation(name, d):
    fmt = get_format(name)
    for comp, seed in ((fmt.key, fmt.key_seed), (fmt.value, fmt.value_seed)):
        t = codec_tables(d, comp.kernel_bits, seed, "cpu")
        order = attention_coordinate_order(t, fp8=comp.is_fp8)
        real = order[order >= 0]
        assert torch.equal(real.sort().values, torch.arange(d))


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------


def _mse_near_boundary(x, bits, seed, d, tol=1e-4):
    """[..., d] mask of rotated coordinates within ``tol`` of a decision boundary (reference math)."""
    xf = x.float()
    s = rotate(xf, seed) * math.sqrt(d) / xf.norm(dim=-1, keepdim=True)
    near = torch.zeros_like(s, dtype=torch.bool)
    start = 0
    for n, b in split_segments(d, bits):
        bnd = codebook_tensors(b, d, s.device)[1]
        seg = s[..., start : start + n]
        near[..., start : start + n] = (seg[..., None] - bnd).abs().amin(-1) < tol
        start += n
    return near


def _fp8_near_tie(x, seed):
    # The kernel rotates the unit vector and scales back: its error is relative to ||x||, not to the
    # coordinate, so small coordinates need an absolute window too.
    t = rotate(x.float(), seed).clamp(-FP8_MAX, FP8_MAX)
    eps = 1e-5 * t.abs() + 2e-7 * x.float().norm(dim=-1, keepdim=True)
    up = (t + eps).to(torch.float8_e4m3fn).view(torch.uint8)
    dn = (t - eps).to(torch.float8_e4m3fn).view(torch.uint8)
    return up != dn


@pytest.mark.parametrize("name", format_names())
@pytest.mark.parametrize("d", [64, 128, 256])
def test_store_matches_reference(name, d, device):
    torch.manual_seed(zlib.crc32(f"{name}-{d}".encode()) % 1000)  # str hashes vary per process
    lay = paged_layout(name, d, BLOCK)
    fmt = lay.fmt
    n, hkv, nb = 23, 2, 3
    key = (torch.randn(n, hkv, d, device=device) * 3).to(torch.bfloat16)
    value = torch.randn(n, hkv, d, device=device).to(torch.float16)
    key[5] = 0  # zero vectors: scale 0
    slots = torch.randperm(nb * BLOCK, device=device)[:n]
    slots[[2, 11]] = -1
    init = torch.randint(0, 256, (nb, hkv, lay.head_page_bytes), dtype=torch.uint8, device=device)
    got, want = init.clone(), init.clone()
    tq_store(key, value, got, slots, lay)
    tq_store_ref(key, value, want, slots, lay)

    keep = slots >= 0
    ks, vs = key[keep], value[keep]
    if lay.key_is_fp8:
        # near a rounding tie, or an exact zero (the reference's transform may give -0.0: same value)
        k_near = _fp8_near_tie(ks, fmt.key_seed) | (rotate(ks.float(), fmt.key_seed) == 0)
    else:
        k_near = _mse_near_boundary(ks, fmt.key.bits, fmt.key_seed, d)
    v_near = _mse_near_boundary(vs, fmt.value.bits, fmt.value_seed, d)
    rows_near = k_near.any(-1) | v_near.any(-1)  # [n_kept, hkv]

    # Index bytes differ only inside rows (token, head) that hold a near-boundary coordinate. The fp16
    # scales are norms summed in another order than the reference's: one rounding step apart at most
    # (seen on an H100 for a value scale, 1.0645 vs 1.0635), compared below.
    diff = got != want
    allowed = torch.zeros_like(diff)
    kept = slots[keep].long()
    blk, off = kept // BLOCK, kept % BLOCK
    for sec, o, size in lay.sections():
        per = size // BLOCK
        for r, h in itertools.product(range(len(kept)), range(hkv)):
            if sec.endswith("_scale") or rows_near[r, h]:
                allowed[blk[r], h, o + off[r] * per : o + (off[r] + 1) * per] = True
    assert not (diff & ~allowed).any(), "bytes differ outside near-boundary rows (or skipped slots were written)"
    assert rows_near.float().mean() < 0.5

    k_got, ksc_got, v_got, vsc_got = read_slots(got, lay, kept)
    k_want, ksc_want, v_want, vsc_want = read_slots(want, lay, kept)
    if lay.key_is_fp8:
        ok = ~k_near
        assert torch.equal(k_got[ok], k_want[ok])
        step = (k_got.view(torch.float8_e4m3fn).float() - k_want.view(torch.float8_e4m3fn).float()).abs()
        assert (step <= 2 ** -9 + rotate(ks.float(), fmt.key_seed).abs() * 2 ** -3).all()
    else:
        ik_got, ik_want = unpack_segments(k_got, d, fmt.key.bits), unpack_segments(k_want, d, fmt.key.bits)
        assert torch.equal(ik_got[~k_near], ik_want[~k_near])
        torch.testing.assert_close(ksc_got[~rows_near].float(), ksc_want[~rows_near].float(), rtol=2**-10, atol=0)
        torch.testing.assert_close(ksc_got.float(), ksc_want.float(), rtol=1e-2, atol=0)
    iv_got, iv_want = unpack_segments(v_got, d, fmt.value.bits), unpack_segments(v_want, d, fmt.value.bits)
    assert torch.equal(iv_got[~v_near], iv_want[~v_near])
    torch.testing.assert_close(vsc_got[~rows_near].float(), vsc_want[~rows_near].float(), rtol=2**-10, atol=0)
    torch.testing.assert_close(vsc_got.float(), vsc_want.float(), rtol=1e-2, atol=0)


def test_store_bytes_decode_back_with_codec(device):
    """A token's index bytes are exactly ops.codec's encoding: ops.codec.decode gives back its vector."""
    lay = paged_layout("turboquant_k3v4_nc", 128, BLOCK)
    f = lay.fmt
    n = 9
    value = torch.randn(n, 1, 128, device=device)
    cache = allocate_kv_cache(2, 1, lay, device)
    slots = torch.arange(3, 3 + n, device=device)
    tq_store(value.half(), value.half(), cache, slots, lay)
    _, _, v_idx, v_scale = read_slots(cache, lay, slots)
    got = decode(v_idx, v_scale, 128, f.value.bits, f.value_seed)
    want = decode_ref(v_idx, v_scale, 128, f.value.bits, f.value_seed)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, 1), value.half().float().flatten(0, 1), dim=-1)
    assert cos.min() > 0.97  # 4-bit values


def test_store_into_strided_cache(device):
    """The block dim may be strided (a view into a larger allocation); other blocks stay untouched."""
    lay = paged_layout("turboquant_4bit_nc", 64, BLOCK)
    big = torch.randint(0, 256, (4, 2, 3, lay.head_page_bytes), dtype=torch.uint8, device=device)
    before = big.clone()
    cache = big[:, 1]  # [4, 3, hpb], block stride 2 * 3 * hpb
    k = torch.randn(7, 3, 64, device=device).half()
    slots = torch.tensor([0, 17, 33, 50, 63, 5, -1], device=device)
    tq_store(k, k, cache, slots, lay)
    ref = before[:, 1].clone()
    tq_store_ref(k, k, ref, slots, lay)
    assert torch.equal(big[:, 0], before[:, 0])
    assert (cache != ref).float().mean() < 2e-3


def test_store_rejects_bad_input(device):
    lay = paged_layout("turboquant_4bit_nc", 64, BLOCK)
    cache = allocate_kv_cache(2, 2, lay, device)
    k = torch.randn(3, 2, 64, device=device).half()
    with pytest.raises(ValueError, match="does not match layout"):
        tq_store(k, k, torch.zeros(2, 2, 10, dtype=torch.uint8, device=device), torch.arange(3, device=device), lay)
    with pytest.raises(ValueError, match="slot_mapping"):
        tq_store(k, k, cache, torch.arange(2, device=device), lay)
    with pytest.raises(ValueError, match="shapes differ"):
        tq_store(k, k[:2], cache, torch.arange(3, device=device), lay)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def _paged_batch(name, d, hkv, group, seq_lens, nq, device, seed=0, data_seed=None):
    """Random K/V stored through tq_store into shuffled pages (unused bytes random garbage). ``seed``
    fixes the page assignment, ``data_seed`` (default: seed) the K/V/q values."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lay = paged_layout(name, d, BLOCK)
    r = len(seq_lens)
    maxb = max(1, max(-(-s // BLOCK) for s in seq_lens)) + 1
    nb = r * maxb + 2
    bt = torch.randperm(nb, generator=g)[: r * maxb].view(r, maxb).to(torch.int32).to(device)
    cache = torch.randint(0, 256, (nb, hkv, lay.head_page_bytes), generator=g, dtype=torch.uint8).to(device)
    if data_seed is not None:
        g = torch.Generator(device="cpu").manual_seed(data_seed)
    for i, s in enumerate(seq_lens):
        t = torch.arange(s, device=device)
        slots = bt[i, t // BLOCK].long() * BLOCK + t % BLOCK
        k = (torch.randn(s, hkv, d, generator=g) * 1.5).to(device, torch.bfloat16)
        v = torch.randn(s, hkv, d, generator=g).to(device, torch.bfloat16)
        tq_store(k, v, cache, slots, lay)
    qsl = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), hkv * group, d, generator=g).to(device, torch.bfloat16)
    return lay, cache, bt, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=device), q


def _check(out, lse, ref_out, ref_lse, lse_rtol=LSE_RTOL_FP16_QUERY):
    torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (lse[fin] - ref_lse[fin]).abs()
        assert (err < LSE_ATOL + lse_rtol * ref_lse[fin].abs()).all(), err.max()


DECODE_CASES = [
    # name, d, group, window, splits
    ("turboquant_k3v4_nc", 64, 4, None, 1),
    ("turboquant_k3v4_nc", 64, 3, 40, 3),
    ("turboquant_k8v4", 64, 1, None, 3),
    ("turboquant_2p5bit_nc", 64, 4, 7, 2),
    ("turboquant_4bit_nc", 128, 4, None, None),
    ("turboquant_2bit_nc", 96, 3, None, 2),
    ("turboquant_k4v3_nc", 128, 4, None, 2),
]


@pytest.mark.parametrize("name,d,group,window,splits", DECODE_CASES)
def test_decode_attention_matches_reference(name, d, group, window, splits, device):
    lay, cache, bt, qsl, sl, q = _paged_batch(name, d, 2, group, [1, 17, 100], [1, 1, 1], device)
    out, lse = tq_paged_attention(q, cache, lay, bt, qsl, sl, max_query_len=1, max_seq_len=100,
                                  sliding_window=window, num_splits=splits, return_lse=True)
    ref_out, ref_lse = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl, sliding_window=window)
    _check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_3p5bit_nc", "turboquant_k8v4"])
def test_a_tensor_parallel_rank_stores_and_attends_its_heads_as_the_whole_layer_does(name, device):
    """Tensor parallelism gives each rank a contiguous share of the KV heads and their query heads. Nothing in a
    head's pages or attention depends on its index among the layer's heads (the rotations and codebooks are the
    layer's), so each of two ranks holding 2 of 4 KV heads stores the same bytes as those heads' rows of the
    single-GPU cache and attends to the same outputs, bit for bit."""
    hkv, group, d, seq_lens = 4, 2, 64, [1, 17, 40]
    lay = paged_layout(name, d, BLOCK)
    g = torch.Generator().manual_seed(23)
    nb = 12
    bt = torch.randperm(nb, generator=g)[:9].view(3, 3).to(torch.int32).to(device)
    whole = torch.zeros(nb, hkv, lay.head_page_bytes, dtype=torch.uint8, device=device)
    ranks = [torch.zeros(nb, hkv // 2, lay.head_page_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    for i, n in enumerate(seq_lens):
        t = torch.arange(n, device=device)
        slots = bt[i, t // BLOCK].long() * BLOCK + t % BLOCK
        k = (torch.randn(n, hkv, d, generator=g) * 1.5).to(device, torch.bfloat16)
        v = torch.randn(n, hkv, d, generator=g).to(device, torch.bfloat16)
        tq_store(k, v, whole, slots, lay)
        for r, cache in enumerate(ranks):
            tq_store(k[:, 2 * r : 2 * r + 2].contiguous(), v[:, 2 * r : 2 * r + 2].contiguous(), cache, slots, lay)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(3, hkv * group, d, generator=g).to(device, torch.bfloat16)
    out, lse = tq_paged_attention(q, whole, lay, bt, qsl, sl, max_query_len=1, max_seq_len=40, num_splits=2,
                                  return_lse=True)
    for r, cache in enumerate(ranks):
        assert torch.equal(cache, whole[:, 2 * r : 2 * r + 2])
        heads = slice(2 * r * group, (2 * r + 2) * group)
        out_r, lse_r = tq_paged_attention(q[:, heads].contiguous(), cache, lay, bt, qsl, sl, max_query_len=1,
                                          max_seq_len=40, num_splits=2, return_lse=True)
        assert torch.equal(out_r, out[:, heads]) and torch.equal(lse_r, lse[heads])


@pytest.mark.parametrize("name,group,window,splits", [
    ("turboquant_k3v4_nc", 3, None, 1),
    ("turboquant_k8v4", 4, 9, 2),
    ("turboquant_3p5bit_nc", 1, None, 3),
    ("turboquant_k4v3_nc", 2, None, 1),
])
def test_context_attention_matches_reference(name, group, window, splits, device):
    """Chunk queries after the cached context (non-causal over it), including a request with no
    cached context (out 0, lse -inf)."""
    lay, cache, bt, qsl, sl, q = _paged_batch(name, 64, 2, group, [0, 17, 100], [3, 1, 7], device)
    out, lse = tq_paged_attention(q, cache, lay, bt, qsl, sl, max_query_len=7, max_seq_len=100, causal=False,
                                  sliding_window=window, num_splits=splits, return_lse=True)
    ref_out, ref_lse = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl, causal=False, sliding_window=window)
    _check(out, lse, ref_out, ref_lse)
    assert torch.isinf(lse[:, :3]).all() and (out[:3] == 0).all()


def test_multi_query_causal_attention_spans_query_blocks(device):
    """Speculative-verification-like batches: several cached queries per request, more than one query
    block per request (request lookup by binary search)."""
    lay, cache, bt, qsl, sl, q = _paged_batch("turboquant_k3v4_nc", 64, 1, 4, [40, 5, 33], [20, 1, 13], device)
    out, lse = tq_paged_attention(q, cache, lay, bt, qsl, sl, max_query_len=20, max_seq_len=40, return_lse=True,
                                  config=TQAttentionConfig(block_m=16))
    ref_out, ref_lse = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    _check(out, lse, ref_out, ref_lse)


def test_plan_is_reused_across_layers(device):
    lay, cache_a, bt, qsl, sl, q = _paged_batch("turboquant_k3v2_nc", 64, 2, 2, [17, 30], [1, 1], device, seed=1)
    _, cache_b, bt_b, _, _, _ = _paged_batch("turboquant_k3v2_nc", 64, 2, 2, [17, 30], [1, 1], device, seed=1,
                                            data_seed=2)
    assert torch.equal(bt, bt_b) and not torch.equal(cache_a, cache_b)
    plan = TQAttentionPlan(lay, 4, 2, device)
    plan.plan(bt, qsl, sl, num_tokens=2, max_query_len=1, max_seq_len=30, num_splits=2)
    for cache in (cache_a, cache_b):
        out = plan.run(q, cache)
        ref_out, _ = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL, rtol=OUT_RTOL)


def test_plan_uses_the_workspace_it_is_given(device):
    """Plans given one workspace (vLLM's builder shares one among its plans) use that very tensor for the
    split partials and cap their split count by its size, as a plan allocating that many bytes does."""
    lay, cache, bt, qsl, sl, q = _paged_batch("turboquant_k3v2_nc", 64, 2, 2, [17, 100], [1, 1], device, seed=3)
    hq, d = q.shape[1], q.shape[2]
    per_split = 2 * hq * (d + 1)  # floats of one split's partial out + lse for num_tokens=2
    workspace = torch.zeros(3 * per_split + 5, dtype=torch.float32, device=device)  # room for 3 splits
    plans = [TQAttentionPlan(lay, hq, 2, device, workspace=workspace) for _ in range(2)]
    own = TQAttentionPlan(lay, hq, 2, device, workspace_bytes=4 * workspace.numel())
    for plan in (*plans, own):
        assert plan.workspace.numel() == workspace.numel()
        plan.plan(bt, qsl, sl, num_tokens=2, max_query_len=1, max_seq_len=100, num_splits=8)
        assert plan.num_splits == 3
    assert all(p.workspace.data_ptr() == workspace.data_ptr() for p in plans)
    assert own.workspace.data_ptr() != workspace.data_ptr()
    out = plans[0].run(q, cache)
    assert workspace[: 3 * 2 * hq * d].abs().sum() > 0  # the split partials went into the given tensor
    ref_out, _ = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL, rtol=OUT_RTOL)
    small = TQAttentionPlan(lay, hq, 2, device, workspace=workspace[: per_split - 1])
    assert small.plan(bt, qsl, sl, num_tokens=2, max_query_len=1, max_seq_len=100, num_splits=8).num_splits == 1
    for bad in (workspace.double(), workspace[::2], workspace.view(-1, 1), workspace[:0]):
        with pytest.raises(ValueError, match="workspace"):
            TQAttentionPlan(lay, hq, 2, device, workspace=bad)


def test_merge_attn_states_equals_attention_over_the_union(device):
    """Context part (paged kernel, non-causal over the cached prefix) merged with the fresh part
    (attention of the chunk over its own tokens) equals causal attention over everything."""
    lay, cache, bt, qsl, sl, q = _paged_batch("turboquant_k3v4_nc", 64, 2, 4, [40, 70], [6, 6], device)
    ctx = torch.tensor([34, 64], dtype=torch.int32, device=device)
    out_a, lse_a = tq_paged_attention(q, cache, lay, bt, qsl, ctx, max_query_len=6, max_seq_len=70, causal=False,
                                      return_lse=True)
    # fresh part, in plain torch over the same dequantized tokens
    hq, d = q.shape[1], q.shape[2]
    out_b = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse_b = torch.zeros(hq, q.shape[0], dtype=torch.float32, device=device)
    for r in range(2):
        q0, q1, c = int(qsl[r]), int(qsl[r + 1]), int(ctx[r])
        k, v = dequant_cached_ref(cache, lay, bt[r], c + q1 - q0)
        k, v = k[c:].repeat_interleave(hq // 2, 1), v[c:].repeat_interleave(hq // 2, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) / math.sqrt(d)
        s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool, device=device).triu(1), float("-inf"))
        lse_b[:, q0:q1] = torch.logsumexp(s, -1)
        out_b[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    out, lse = merge_attn_states(out_a, lse_a, out_b.to(q.dtype), lse_b)
    ref_out, ref_lse = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    _check(out, lse, ref_out, ref_lse)


def test_merge_attn_states_handles_empty_sides():
    out_a = torch.randn(3, 2, 8)
    out_b = torch.randn(3, 2, 8)
    lse_a = torch.tensor([[0.5, float("-inf"), float("inf")], [1.0, float("-inf"), 2.0]])
    lse_b = torch.tensor([[float("-inf"), float("-inf"), 0.0], [1.0, 0.3, float("-inf")]])
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0, 0], out_a[0, 0])  # b empty
    assert (out[1, 0] == 0).all() and lse[0, 1] == float("-inf")  # both empty
    torch.testing.assert_close(out[2, 0], out_b[2, 0])  # +inf read as empty
    torch.testing.assert_close(out[0, 1], 0.5 * (out_a[0, 1] + out_b[0, 1]))  # equal weights
    assert abs(lse[1, 0] - (1.0 + math.log(2.0))) < 1e-6


def test_attention_rejects_bad_input(device):
    lay = paged_layout("turboquant_4bit_nc", 64, BLOCK)
    with pytest.raises(ValueError, match="head_dim"):
        TQAttentionPlan(paged_layout("turboquant_4bit_nc", 512, BLOCK), 4, 2, device)
    with pytest.raises(ValueError, match="multiple"):
        TQAttentionPlan(lay, 5, 2, device)
    plan = TQAttentionPlan(lay, 4, 2, device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    sl = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int32"):
        plan.plan(bt.long(), qsl, sl, num_tokens=1, max_query_len=1, max_seq_len=3)
    with pytest.raises(RuntimeError, match="plan"):
        plan.run(torch.zeros(1, 4, 64, device=device).half(), allocate_kv_cache(2, 2, lay, device))
    plan.plan(bt, qsl, sl, num_tokens=1, max_query_len=1, max_seq_len=3)
    with pytest.raises(ValueError, match=r"q must be \[Tq, 4, 64\]"):
        plan.run(torch.zeros(1, 3, 64, device=device).half(), allocate_kv_cache(2, 2, lay, device))


# ----------------------------------------------------------------------------------------------
# gather + dequantize
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,d", [("turboquant_k3v4_nc", 64), ("turboquant_k8v4", 96),
                                    ("turboquant_2p5bit_nc", 128)])
def test_gather_dequant_matches_reference(name, d, device):
    lay, cache, bt, _, sl, _ = _paged_batch(name, d, 2, 1, [1, 17, 40], [1, 1, 1], device)
    cu = torch.zeros(4, dtype=torch.int32, device=device)
    cu[1:] = sl.cumsum(0)
    out_k = torch.full((58, 2, d), float("nan"), device=device)
    out_v = torch.full_like(out_k, float("nan"))
    tq_gather_dequant(cache, lay, bt, sl, cu, out_k, out_v, max_seq_len=40)
    ref_k, ref_v = tq_gather_dequant_ref(cache, lay, bt, sl)
    torch.testing.assert_close(out_k, ref_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_v, ref_v, atol=1e-4, rtol=1e-4)
    k_idx, _, _, _ = read_cached_tokens(cache, lay, bt[2], 40)
    assert k_idx.shape == (40, 2, lay.k_index_bytes)


@pytest.mark.parametrize("name,d", [("turboquant_k3v4_nc", 64), ("turboquant_k8v4", 96),
                                    ("turboquant_2p5bit_nc", 128), ("turboquant_k4v3_nc", 128)])
def test_gather_dequant_bf16_matches_reference(name, d, device):
    """bf16 outputs take the kernel-order path (codebook values by byte permutes on a GPU, loaded in the
    interpreter; rotation rows in kernel order): within bf16 rounding of the fp32 reference."""
    lay, cache, bt, _, sl, _ = _paged_batch(name, d, 2, 1, [1, 17, 40], [1, 1, 1], device)
    cu = torch.zeros(4, dtype=torch.int32, device=device)
    cu[1:] = sl.cumsum(0)
    out_k = torch.full((58, 2, d), float("nan"), device=device, dtype=torch.bfloat16)
    out_v = torch.full_like(out_k, float("nan"))
    tq_gather_dequant(cache, lay, bt, sl, cu, out_k, out_v, max_seq_len=40)
    ref_k, ref_v = tq_gather_dequant_ref(cache, lay, bt, sl)
    torch.testing.assert_close(out_k.float(), ref_k, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out_v.float(), ref_v, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("decode_kernel", ["register-tile", "wgmma"])
def test_decode_attention_replays_in_a_cuda_graph(decode_kernel):
    dev = "cuda"
    lay, cache, bt, qsl, sl, q = _paged_batch("turboquant_k3v4_nc", 128, 2, 4, [300, 17, 1000], [1, 1, 1], dev)
    plan = TQAttentionPlan(lay, 8, 2, dev, config=TQAttentionConfig(decode_kernel=decode_kernel))
    plan.plan(bt, qsl, sl, num_tokens=3, max_query_len=1, max_seq_len=1024)
    if plan.decode_kernel != decode_kernel:
        pytest.skip(f"the {decode_kernel} decode kernel does not run on this GPU")
    out = torch.empty_like(q)
    plan.run(q, cache, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, out=out)
    sl.copy_(torch.tensor([299, 17, 999], dtype=torch.int32, device=dev))  # metadata updated in place
    graph.replay()
    if decode_kernel == "wgmma":  # e4m3 operands: against the reference of the same roundings
        from turboquant_core.ops.paged_decode_wgmma import tq_paged_decode_wgmma_ref

        ref_out, _ = tq_paged_decode_wgmma_ref(q, cache, lay, bt, qsl, sl, num_splits=plan.decode_splits)
        err = (out.float() - ref_out.float()).norm(dim=-1) / ref_out.float().norm(dim=-1)
        assert err.median() < 0.003 and err.max() < 0.12, err
        return
    ref_out, _ = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL, rtol=OUT_RTOL)


@pytest.mark.parametrize("fmt,group,window", [("turboquant_k3v4_nc", 4, None), ("turboquant_k8v4", 1, 8)])
def test_warmup_kernels_covers_every_query_block_shape_and_touches_one_block(device, fmt, group, window):
    from turboquant_core.ops.paged import warmup_kernels

    hkv, d, bs = 2, 64, 16
    layout = paged_layout(fmt, head_dim=d, block_size=bs)
    cache = allocate_kv_cache(4, hkv, layout, device=device)
    cache.random_(0, 256, generator=torch.Generator(device=device).manual_seed(5))
    before = cache.clone()
    launches = warmup_kernels(cache, layout, hkv * group, hkv, dtype=torch.float16, sliding_window=window,
                              block_id=2)
    # only the scratch block changed
    assert torch.equal(cache[:2], before[:2]) and torch.equal(cache[3:], before[3:])
    assert not torch.equal(cache[2], before[2])
    attn = [x for x in launches if x["kernel"] != "store"]
    decode = {(x["block_m"], x["one_qblock"], x["num_splits"]) for x in attn if x["kernel"] == "decode"}
    context = {(x["block_m"], x["one_qblock"], x["num_splits"]) for x in attn if x["kernel"] == "context"}
    # 9 and 17: merges of many splits in two levels, 4 and 8 splits per load
    assert decode == {(16, True, 1), (16, True, 2), (16, True, 9), (16, True, 17)}
    shapes = {(16, True), (32, True), (64, True), (64, False)}
    assert context == {(bm, one, s) for bm, one in shapes for s in (1, 2)}
    first_len = {(x["block_m"], x["one_qblock"]): x["query_len"] for x in attn if x["kernel"] == "context"}
    assert first_len[(64, False)] == 64 // group + 1

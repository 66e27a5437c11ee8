# SPDX-License-Identifier: Apache-2.0
"""Key centering anchored in the first page: tables, sums, centred store, attention and gather-dequant
against the plain-torch references, plus the properties serving relies on (chunking does not change the
stored bytes; keys with a shared pre-RoPE component come back closer to the truth).

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay small.
"""

import math

import pytest
import torch

from turboquant_core.ops.key_centering import (
    center_sums_from_keys_ref,
    center_vectors_ref,
    key_centering_tables,
    request_positions,
    rope_theta_from_cos_sin_cache,
    token_centers_ref,
)
from turboquant_core.ops.paged import (
    TQAttentionConfig,
    TQAttentionPlan,
    center_sums_cached_ref,
    center_sums_ref,
    dequant_cached_ref,
    new_block_epochs,
    new_center_sums,
    new_center_tags,
    paged_layout,
    read_cached_tokens,
    tq_gather_dequant,
    tq_gather_dequant_ref,
    tq_key_center_sums,
    tq_paged_attention,
    tq_paged_attention_ref,
    tq_store,
    tq_store_ref,
)

BLOCK = 16
OUT_ATOL, OUT_RTOL, LSE_ATOL, LSE_RTOL = 2e-2, 1e-2, 1e-3, 5e-4


def _theta(rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    return base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: torch.Tensor, neox: bool) -> torch.Tensor:
    """RoPE of x [n, ..., d] at positions [n] (the first 2 * len(theta) channels rotate)."""
    h = theta.numel()
    ang = pos.double()[:, None] * theta[None, :]
    shape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (h,)
    c, s = torch.cos(ang).view(shape), torch.sin(ang).view(shape)
    x = x.double().clone()
    if neox:
        a, b = x[..., :h].clone(), x[..., h:2 * h].clone()
        x[..., :h], x[..., h:2 * h] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:2 * h:2].clone(), x[..., 1:2 * h:2].clone()
        x[..., 0:2 * h:2], x[..., 1:2 * h:2] = a * c - b * s, b * c + a * s
    return x


def _keys_with_shared_component(n, hkv, d, theta, neox, g, mean_scale=3.0):
    """Post-RoPE keys whose pre-RoPE form is a per-head constant (norm ~ mean_scale * noise) + noise."""
    mu_pre = torch.randn(hkv, d, generator=g, dtype=torch.float64) * mean_scale
    pre = mu_pre[None] + torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    return _rope(pre, torch.arange(n), theta, neox)


class _Batch:
    """Requests stored step by step through tq_store, as a serving engine does (prefill chunks, then decode)."""

    def __init__(self, name, d, hkv, seq_lens, steps, device, *, neox=True, rot_dim=None, seed=0,
                 centering=True, mean_scale=3.0, single_token_steps=False, kept=False):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.lay = paged_layout(name, d, BLOCK)
        rot_dim = rot_dim or d
        self.theta = _theta(rot_dim)
        self.cent = key_centering_tables(self.theta, d, BLOCK, 4096, neox=neox, device=device) if centering else None
        r = len(seq_lens)
        maxb = max(-(-s // BLOCK) for s in seq_lens) + 1
        nb = r * maxb + 2
        self.bt = torch.randperm(nb, generator=g)[: r * maxb].view(r, maxb).to(torch.int32).to(device)
        self.cache = torch.randint(0, 256, (nb, hkv, self.lay.head_page_bytes), generator=g,
                                   dtype=torch.uint8).to(device)
        self.k = [_keys_with_shared_component(s, hkv, d, self.theta, neox, g, mean_scale).to(torch.bfloat16)
                  for s in seq_lens]
        self.v = [torch.randn(s, hkv, d, generator=g).to(torch.bfloat16) for s in seq_lens]
        self.seq_lens, self.device, self.hkv, self.d = list(seq_lens), device, hkv, d
        self.sums = new_center_sums(r, hkv, self.cent, device) if centering else None
        # ``kept``: the sums are kept across steps (tags + block epochs), as the vLLM backend keeps each layer's
        self.kept = dict(center_tags=new_center_tags(r, hkv, device), block_epochs=new_block_epochs(nb, device)) \
            if kept else {}
        # steps with at most one token per request take the store's single-pass path (vLLM: decode-only batches)
        self.single_token_steps = single_token_steps
        done = [0] * r
        for step in steps:  # tokens per request in this step
            self.store_step(step, done)
        assert not steps or done == self.seq_lens, "the steps must store every token"

    def step_args(self, step, done):
        dev = self.device
        counts = [min(n, s - c) for n, s, c in zip(step, self.seq_lens, done)]
        ks, vs, slots = [], [], []
        for i, n in enumerate(counts):
            t = torch.arange(done[i], done[i] + n)
            ks.append(self.k[i][t])
            vs.append(self.v[i][t])
            slots.append(self.bt[i].cpu().long()[t // BLOCK] * BLOCK + t % BLOCK)
        qsl = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        sl = torch.tensor([c + n for c, n in zip(done, counts)], dtype=torch.int32, device=dev)
        return (torch.cat(ks).to(dev), torch.cat(vs).to(dev), torch.cat(slots).to(dev), qsl, sl, counts)

    def store_step(self, step, done, ref=False):
        k, v, slots, qsl, sl, counts = self.step_args(step, done)
        fn = tq_store_ref if ref else tq_store
        if self.cent is None:
            fn(k, v, self.cache, slots, self.lay)
        else:
            single = {"single_token_requests": True} if self.single_token_steps and max(counts) <= 1 and not ref else {}
            fn(k, v, self.cache, slots, self.lay, centering=self.cent, query_start_loc=qsl, seq_lens=sl,
               block_table=self.bt, center_sums=self.sums, **single, **({} if ref else self.kept))
        for i, n in enumerate(counts):
            done[i] += n

    def seq_lens_t(self):
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device)


# ----------------------------------------------------------------------------------------------
# tables and reference math
# ----------------------------------------------------------------------------------------------


def test_theta_from_a_vllm_style_cos_sin_cache():
    theta = _theta(64, 500000.0)
    t = torch.arange(300, dtype=torch.float64)[:, None] * theta[None, :]
    cache = torch.cat([torch.cos(t), torch.sin(t)], dim=1) * 1.25  # a YaRN-style magnitude
    assert torch.allclose(rope_theta_from_cos_sin_cache(cache.float()), theta, atol=1e-6)
    # vLLM computes its cache in fp32 (t * theta rounded): still recognized at 40k positions
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    f32 = torch.outer(torch.arange(40960, dtype=torch.float32), inv)
    got = rope_theta_from_cos_sin_cache(torch.cat([f32.cos(), f32.sin()], 1))
    assert torch.allclose(got, inv.double(), rtol=1e-6, atol=1e-9)
    bad = cache.clone()
    bad[200:, :32] *= 0.5  # not a plain rotation
    with pytest.raises(ValueError, match="not cos/sin"):
        rope_theta_from_cos_sin_cache(bad)


def test_tables_first_page_is_plain_and_slow_pairs_keep_the_mean():
    theta = _theta(48)  # partial rotary: 48 of 64 dims
    c = key_centering_tables(theta, 64, BLOCK, 1000, neox=True)
    assert c.page_cos.shape == (math.ceil(1000 / BLOCK) + 1, 64) and c.pos_cos.shape == (BLOCK, 64)
    assert (c.page_cos[0] == 0).all() and (c.page_sin[0] == 0).all()
    # unrotated channels: centre = mu; fast pair 0 (1 rad/token) is shrunk to |rho| = 0.13, slow pairs ~1
    assert (c.page_cos[1:, 48:] == 1).all() and (c.page_sin[1:, 48:] == 0).all()
    rho = torch.sqrt(c.page_cos[1:, :24] ** 2 + c.page_sin[1:, :24] ** 2)
    assert rho[:, 0].max() < 0.14 and rho[:, 23].min() > 0.99
    with pytest.raises(ValueError, match="block size"):
        key_centering_tables(theta, 64, 24, 1000)
    with pytest.raises(ValueError, match="do not fit"):
        key_centering_tables(_theta(80), 64, BLOCK, 1000)


@pytest.mark.parametrize("neox", [True, False])
def test_sums_give_back_the_pre_rope_mean(neox):
    """First-page keys that are exactly RoPE_t(mu) give mu back, and a page's centre is RoPE of the
    shrunk mean at its middle (exact for a pair that does not turn)."""
    d, theta = 64, _theta(64)
    c = key_centering_tables(theta, d, BLOCK, 512, neox=neox)
    mu = torch.randn(3, d, dtype=torch.float64)
    keys = _rope(mu[None].expand(BLOCK, 3, d), torch.arange(BLOCK), theta, neox).transpose(0, 1)
    got, mup = center_vectors_ref(center_sums_from_keys_ref(keys, c), c)
    torch.testing.assert_close(got[:, :d], mu, atol=1e-5, rtol=1e-5)
    pos = torch.tensor([16, 40, 300])
    cent = token_centers_ref(got.expand(3, 3, d), mup.expand(3, 3, d), pos, c)
    mid = (pos // BLOCK) * BLOCK + (BLOCK - 1) / 2
    h = theta.numel()
    rho = torch.sin(BLOCK * theta / 2) / (BLOCK * torch.sin(theta / 2))
    want = torch.stack([_rope((mu * (torch.cat([rho, rho]) if neox else rho.repeat_interleave(2)))[None], m[None],
                              theta, neox)[0] for m in mid])
    torch.testing.assert_close(cent, want, atol=1e-4, rtol=1e-4)
    assert h == d // 2


def test_request_positions():
    qsl = torch.tensor([0, 1, 4, 4, 9])
    sl = torch.tensor([7, 3, 5, 20])
    pos = request_positions(qsl, sl, 11)
    assert pos.tolist() == [6, 0, 1, 2, 15, 16, 17, 18, 19, -1, -1]


# ----------------------------------------------------------------------------------------------
# kernels against the references
# ----------------------------------------------------------------------------------------------

SEQS = [40, 9, 70]
STEPS = [[20, 9, 33], [20, 0, 35], [1, 0, 1], [1, 0, 1]]  # chunked prefill, then decode steps


@pytest.mark.parametrize("name,d,neox,rot_dim", [
    ("turboquant_k3v4_nc", 64, True, None),
    ("turboquant_4bit_nc", 128, False, None),
    ("turboquant_3p5bit_nc", 80, True, 64),
])
def test_sums_kernel_matches_reference(name, d, neox, rot_dim, device):
    b = _Batch(name, d, 2, SEQS, STEPS, device, neox=neox, rot_dim=rot_dim)
    sl = b.seq_lens_t()
    got = tq_key_center_sums(b.cache, b.lay, b.cent, b.bt, sl, new_center_sums(3, 2, b.cent, device))
    want = center_sums_ref(b.cache, b.lay, b.cent, b.bt, sl)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got[1] == 0).all()  # 9 tokens: first page not full, no centre yet
    assert got[0].abs().max() > 1.0  # the shared component is found


@pytest.mark.parametrize("name,d", [("turboquant_k3v4_nc", 64), ("turboquant_2p5bit_nc", 128)])
def test_centred_store_matches_reference(name, d, device):
    """Same steps through the kernels and through the references (given the kernel's sums): the same bytes."""
    ref = _Batch(name, d, 2, SEQS, [], device)
    ref.cache.copy_(torch.zeros_like(ref.cache))
    b2 = _Batch(name, d, 2, SEQS, [], device)
    b2.cache.copy_(torch.zeros_like(b2.cache))
    done_k, done_r = [0] * 3, [0] * 3
    for step in STEPS:
        b2.store_step(step, done_k)
        ref.sums = b2.sums.clone()
        ref.store_step(step, done_r, ref=True)
    for i, s in enumerate(SEQS):
        got = read_cached_tokens(b2.cache, b2.lay, b2.bt[i], s)
        want = read_cached_tokens(ref.cache, ref.lay, ref.bt[i], s)
        for g_, w_ in zip(got, want):
            assert torch.equal(g_, w_)


@pytest.mark.parametrize("single_pass", [False, True], ids=["three-launch", "single-token-path"])
def test_store_bytes_do_not_depend_on_chunking(single_pass, device):
    """Prefix caching and recomputation rely on it: one 70-token prefill and 70 single-token steps store
    the same bytes, and the same sums (single-token steps through either store path)."""
    one = _Batch("turboquant_k3v4_nc", 64, 2, [70], [[70]], device, seed=3)
    many = _Batch("turboquant_k3v4_nc", 64, 2, [70], [[1]] * 70, device, seed=3, single_token_steps=single_pass)
    a = read_cached_tokens(one.cache, one.lay, one.bt[0], 70)
    b = read_cached_tokens(many.cache, many.lay, many.bt[0], 70)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(one.sums, many.sums)


@pytest.mark.parametrize("name,d", [("turboquant_k3v4_nc", 64), ("turboquant_3p5bit_nc", 128)])
def test_single_token_store_path_matches_the_three_launch_one(name, d, device):
    """Decode-only batches store with the sums taken first and one pass: the same bytes as the three-launch
    store, step by step, while requests' first pages fill (positions 15, 16) and after. Sums differ only for
    a request whose first page filled in that very step (zeros: nothing of its reads them yet)."""
    seqs, prefill = [22, 18, 15, 40], [12, 14, 10, 30]
    steps = [prefill] + [[1, 1, 1, 1]] * 10
    three = _Batch(name, d, 2, seqs, [], device, seed=5)
    one = _Batch(name, d, 2, seqs, [], device, seed=5, single_token_steps=True)
    done3, done1 = [0] * 4, [0] * 4
    for step in steps:
        three.store_step(step, done3)
        one.store_step(step, done1)
        for i in range(4):
            for g_, w_ in zip(read_cached_tokens(one.cache, one.lay, one.bt[i], done1[i]),
                              read_cached_tokens(three.cache, three.lay, three.bt[i], done3[i])):
                assert torch.equal(g_, w_)
        filled_now = [done1[i] == BLOCK and n == 1 for i, n in enumerate(step)]
        for i, now in enumerate(filled_now):
            if now:
                assert (one.sums[i] == 0).all() and three.sums[i].abs().max() > 0
            else:
                assert torch.equal(one.sums[i], three.sums[i])
    assert done1 == seqs and one.sums[[0, 1, 3]].abs().amax(dim=(1, 2, 3)).gt(0).all() and (one.sums[2] == 0).all()


# ----------------------------------------------------------------------------------------------
# sums kept across steps (tags + block epochs)
# ----------------------------------------------------------------------------------------------


def test_kept_sums_are_the_same_bits_and_epochs_count_first_page_tokens(device):
    """Steps through both store paths with the sums kept across steps and with them recomputed every step: the
    same sums and stored bytes after every step; tags as the reference's; each block's epoch counts the
    first-page tokens stored into it. Request 2 fills its first page in a single-token step (zeros, then
    computed in the next step), request 1 never does, requests 0 and 3 are full from the first step on."""
    seqs = [40, 9, 20, 19]
    steps = [[20, 9, 15, 17], [1, 0, 1, 1], [1, 0, 1, 1], [18, 0, 3, 0]]
    kw = dict(seed=4, single_token_steps=True)
    kept = _Batch("turboquant_k3v4_nc", 64, 2, seqs, [], device, kept=True, **kw)
    every = _Batch("turboquant_k3v4_nc", 64, 2, seqs, [], device, **kw)
    tags, epochs = kept.kept["center_tags"], kept.kept["block_epochs"]
    ref_sums, ref_tags = kept.sums.clone(), tags.clone()
    done_k, done_e = [0] * 4, [0] * 4
    for step in steps:
        kept.store_step(step, done_k)
        every.store_step(step, done_e)
        assert torch.equal(kept.sums, every.sums) and torch.equal(kept.cache, every.cache)
        # the store's sums launch saw these first pages and epochs (single-token steps: before the store)
        sl = torch.tensor(done_k, dtype=torch.int32, device=device)
        center_sums_cached_ref(kept.cache, kept.lay, kept.cent, kept.bt, sl, ref_sums, ref_tags, epochs,
                               before_store=max(step) <= 1)
        assert torch.equal(tags, ref_tags)
    assert (ref_sums - kept.sums).abs().max() < 1e-4
    want = torch.zeros_like(epochs)
    for r, n in enumerate(seqs):
        want[kept.bt[r, 0]] += min(n, BLOCK)
    assert torch.equal(epochs, want)
    assert tags[:, :, 0].tolist() == [[int(kept.bt[r, 0])] * 2 if n >= BLOCK else [-1, -1]
                                      for r, n in enumerate(seqs)]


def test_kept_sums_skip_unchanged_first_pages_and_recompute_changed_ones(device):
    """Each launch starts from a poisoned (NaN) sums buffer: the rows it skips keep the poison, and must be the
    ones the reference skips and ones whose held sums equal a fresh computation; the rows it writes are the
    same bits as a launch without tags. Covers: nothing changed (only the not-full row is written), rows
    moved to other requests, a request sharing a full first page (prefix caching: skipped), a freed first
    block reused with new contents by the store (its epoch changed), a first page that fills in the step."""
    seqs = [40, 9, 70]
    b = _Batch("turboquant_k3v4_nc", 64, 2, seqs, [seqs], device, kept=True, seed=6)
    tags, epochs = b.kept["center_tags"], b.kept["block_epochs"]

    def check(launch, bt, sl):
        held, held_tags = b.sums.clone(), tags.clone()
        b.sums.fill_(float("nan"))
        launch()
        wrote = ~b.sums.isnan().flatten(2).all(-1)  # [R, Hkv]
        ref_sums, ref_tags = held.clone(), held_tags
        assert torch.equal(wrote, center_sums_cached_ref(b.cache, b.lay, b.cent, bt, sl, ref_sums, ref_tags, epochs))
        assert torch.equal(tags, ref_tags)
        fresh = tq_key_center_sums(b.cache, b.lay, b.cent, bt, sl, new_center_sums(len(sl), 2, b.cent, device))
        assert torch.equal(torch.where(wrote[:, :, None, None], b.sums, held), fresh)
        b.sums.copy_(fresh)
        return wrote.all(-1).tolist()

    def sums(bt, sl):
        return check(lambda: tq_key_center_sums(b.cache, b.lay, b.cent, bt, sl, b.sums, **b.kept), bt, sl)

    sl = b.seq_lens_t()
    assert sums(b.bt, sl) == [False, True, False]
    perm = torch.tensor([2, 0, 1], device=device)
    bt, sl = b.bt[perm].clone(), sl[perm].clone()
    assert sums(bt, sl) == [True, True, True]
    # row 1: another request on request 0's full first page (a prefix-cache hit), longer and with other pages
    spare = sorted(set(range(b.cache.shape[0])) - set(b.bt.flatten().tolist()))
    bt[1, 1:] = bt[1, 1:].flip(0)
    sl[1] = 30
    assert sums(bt, sl) == [False, False, True]
    # request 2 ends; its first block (row 0's) goes to a new request of 20 tokens, stored in one chunk; the
    # request in row 2 stores 7 tokens, filling its first page (positions 9..15)
    reused, filling = int(bt[0, 0]), int(bt[2, 0])
    bt[0, :2] = torch.tensor([reused, spare[0]])
    sl[0], sl[2] = 20, 16
    g = torch.Generator(device="cpu").manual_seed(9)
    k = (torch.randn(27, 2, 64, generator=g) * 2).to(device, torch.bfloat16)
    t = torch.cat([torch.arange(20), torch.arange(9, 16)])
    slots = torch.cat([bt[0].long().cpu()[t[:20] // BLOCK], bt[2].long().cpu()[t[20:] // BLOCK]]) * BLOCK + t % BLOCK
    qsl = torch.tensor([0, 20, 20, 27], dtype=torch.int32, device=device)
    before = epochs.clone()
    assert check(lambda: tq_store(k, k, b.cache, slots.to(device), b.lay, centering=b.cent, query_start_loc=qsl,
                                  seq_lens=sl, block_table=bt, center_sums=b.sums, **b.kept), bt, sl) \
        == [True, False, True]
    bumps = torch.zeros_like(epochs)
    bumps[reused], bumps[filling] = BLOCK, 7  # first-page tokens only: the 4 in spare[0] count nothing
    assert torch.equal(epochs - before, bumps)
    assert sums(bt, sl) == [False, False, False]


def _check(out, lse, ref_out, ref_lse):
    torch.testing.assert_close(out.float(), ref_out.float(), atol=OUT_ATOL, rtol=OUT_RTOL)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    err = (lse[fin] - ref_lse[fin]).abs()
    assert (err < LSE_ATOL + LSE_RTOL * ref_lse[fin].abs()).all(), err.max()


@pytest.mark.parametrize("name,d,group,neox,splits,window", [
    ("turboquant_k3v4_nc", 64, 4, True, 1, None),
    ("turboquant_4bit_nc", 128, 2, False, 3, None),
    ("turboquant_3bit_nc", 64, 3, True, 2, 33),
    ("turboquant_k3v4_nc", 128, 4, True, None, None),
    ("turboquant_k4v3_nc", 128, 8, False, 2, None),
])
def test_centred_decode_attention_matches_reference(name, d, group, neox, splits, window, device):
    b = _Batch(name, d, 2, SEQS, STEPS, device, neox=neox)
    sl = b.seq_lens_t()
    g = torch.Generator(device="cpu").manual_seed(1)
    q = (torch.randn(3, 2 * group, d, generator=g) * 0.5).to(device, torch.bfloat16)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    # the fp16-operand kernels, to their tolerance (the e4m3 kernel's centring: tests/ops/test_paged_decode_wgmma.py)
    out, lse = tq_paged_attention(q, b.cache, b.lay, b.bt, qsl, sl, max_query_len=1, max_seq_len=max(SEQS),
                                  num_splits=splits, sliding_window=window, return_lse=True,
                                  centering=b.cent, center_sums=b.sums,
                                  config=TQAttentionConfig(decode_kernel="register-tile"))
    sums_ref = center_sums_ref(b.cache, b.lay, b.cent, b.bt, sl)
    ref_out, ref_lse = tq_paged_attention_ref(q, b.cache, b.lay, b.bt, qsl, sl, sliding_window=window,
                                              centering=b.cent, center_sums=sums_ref)
    _check(out, lse, ref_out, ref_lse)
    # without the centre's logits the result is far off: the term matters at these magnitudes
    plain_out, _ = tq_paged_attention_ref(q, b.cache, b.lay, b.bt, qsl, sl, sliding_window=window)
    assert (plain_out.float() - ref_out.float()).abs().max() > 10 * OUT_ATOL


def test_a_tensor_parallel_rank_centres_its_kv_heads_as_the_whole_layer_does(device):
    """Tensor parallelism: each of two ranks holds 2 of the layer's 4 KV heads and their query heads. Key centering's
    state is per (request, KV head) and its tables are the layer's, so a rank's centred pages, its sums and its
    attention outputs are those heads' of the single-GPU layer, bit for bit, through chunked prefill and decode."""
    import copy

    group = 2
    whole = _Batch("turboquant_k3v4_nc", 64, 4, SEQS, [], device)  # nothing stored yet: the caches' first bytes
    parts = []
    for r in range(2):
        heads = slice(2 * r, 2 * r + 2)
        part = copy.copy(whole)
        part.cache = whole.cache[:, heads].clone()
        part.k, part.v = [k[:, heads] for k in whole.k], [v[:, heads] for v in whole.v]
        part.hkv = 2
        part.sums = new_center_sums(len(SEQS), 2, whole.cent, device)
        parts.append((heads, part))
    for b in [whole] + [part for _, part in parts]:
        done = [0] * len(SEQS)
        for step in STEPS:
            b.store_step(step, done)
    sl = whole.seq_lens_t()
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    q = (torch.randn(3, 4 * group, 64, generator=torch.Generator().manual_seed(5)) * 0.5).to(device, torch.bfloat16)
    args = dict(max_query_len=1, max_seq_len=max(SEQS), num_splits=2, return_lse=True, centering=whole.cent)
    out, lse = tq_paged_attention(q, whole.cache, whole.lay, whole.bt, qsl, sl, center_sums=whole.sums, **args)
    for heads, part in parts:
        assert torch.equal(part.cache, whole.cache[:, heads]) and torch.equal(part.sums, whole.sums[:, heads])
        qh = slice(heads.start * group, heads.stop * group)
        out_r, lse_r = tq_paged_attention(q[:, qh].contiguous(), part.cache, part.lay, part.bt, qsl, sl,
                                          center_sums=part.sums, **args)
        assert torch.equal(out_r, out[:, qh]) and torch.equal(lse_r, lse[qh])


@pytest.mark.parametrize("name,d,group,ql,splits", [
    ("turboquant_k3v4_nc", 128, 4, 4, None),
    ("turboquant_4bit_nc", 64, 3, 4, 2),
    ("turboquant_k4v3_nc", 128, 8, 2, 1),
])
def test_centred_verification_attention_matches_reference(name, d, group, ql, splits, device):
    """Speculative verification as decode (each request's last 1..ql tokens, causal), keys centred: on a GPU
    the register-tile kernel with its centering operands per (query token, head)."""
    b = _Batch(name, d, 2, SEQS, STEPS, device)
    sl = b.seq_lens_t()
    g = torch.Generator(device="cpu").manual_seed(3)
    nq = [ql, 1, ql - 1]
    q = (torch.randn(sum(nq), 2 * group, d, generator=g) * 0.5).to(device, torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device=device)
    plan = TQAttentionPlan(b.lay, 2 * group, 2, device)
    plan.plan(b.bt, qsl, sl, num_tokens=sum(nq), max_query_len=ql, max_seq_len=max(SEQS), num_splits=splits)
    assert (plan.decode_splits > 0) == (device == "cuda")
    out, lse = plan.run(q, b.cache, return_lse=True, centering=b.cent, center_sums=b.sums)
    sums_ref = center_sums_ref(b.cache, b.lay, b.cent, b.bt, sl)
    ref_out, ref_lse = tq_paged_attention_ref(q, b.cache, b.lay, b.bt, qsl, sl, centering=b.cent,
                                              center_sums=sums_ref)
    _check(out, lse, ref_out, ref_lse)


def test_centred_context_attention_matches_reference(device):
    """Queries of a prefill chunk after cached context (non-causal over it), 128-token tiles over pages."""
    b = _Batch("turboquant_k3v4_nc", 64, 2, [150, 30], [[150, 30]], device)
    sl = b.seq_lens_t()
    g = torch.Generator(device="cpu").manual_seed(2)
    nq = [5, 2]
    q = (torch.randn(sum(nq), 4, 64, generator=g) * 0.5).to(device, torch.bfloat16)
    qsl = torch.tensor([0, 5, 7], dtype=torch.int32, device=device)
    out, lse = tq_paged_attention(q, b.cache, b.lay, b.bt, qsl, sl, max_query_len=5, max_seq_len=150,
                                  causal=False, num_splits=2, return_lse=True, centering=b.cent,
                                  center_sums=b.sums)
    ref_out, ref_lse = tq_paged_attention_ref(q, b.cache, b.lay, b.bt, qsl, sl, causal=False, centering=b.cent,
                                              center_sums=center_sums_ref(b.cache, b.lay, b.cent, b.bt, sl))
    _check(out, lse, ref_out, ref_lse)


def test_centred_gather_dequant_matches_reference(device):
    b = _Batch("turboquant_k3v4_nc", 64, 2, SEQS, STEPS, device)
    sl = b.seq_lens_t()
    cu = torch.tensor([0] + torch.tensor(SEQS).cumsum(0).tolist(), dtype=torch.int32, device=device)
    ok = torch.empty(sum(SEQS), 2, 64, device=device)
    ov = torch.empty_like(ok)
    tq_gather_dequant(b.cache, b.lay, b.bt, sl, cu, ok, ov, max_seq_len=max(SEQS), centering=b.cent,
                      center_sums=b.sums)
    rk, rv = tq_gather_dequant_ref(b.cache, b.lay, b.bt, sl, centering=b.cent, center_sums=b.sums)
    torch.testing.assert_close(ok, rk, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(ov, rv, atol=2e-4, rtol=2e-4)


# ----------------------------------------------------------------------------------------------
# what it is for
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc"])
def test_centring_brings_keys_with_a_shared_component_closer(name, device):
    """Keys whose pre-RoPE form shares a component 3x the noise: after the first page, the centred cache's
    keys are at least 2x closer (squared error) to the true keys than the plain cache's."""
    seqs, steps = [200, 120], [[200, 120]]
    cen = _Batch(name, 64, 2, seqs, steps, device, seed=5)
    plain = _Batch(name, 64, 2, seqs, steps, device, seed=5, centering=False)
    err = {"centred": 0.0, "plain": 0.0}
    for i, s in enumerate(seqs):
        kc, _ = dequant_cached_ref(cen.cache, cen.lay, cen.bt[i], s, centering=cen.cent, center_sums_row=cen.sums[i])
        kp, _ = dequant_cached_ref(plain.cache, plain.lay, plain.bt[i], s)
        true = cen.k[i].float().to(device)
        err["centred"] += ((kc - true)[BLOCK:] ** 2).sum().item()
        err["plain"] += ((kp - true)[BLOCK:] ** 2).sum().item()
    assert err["centred"] < 0.5 * err["plain"], err


def test_centring_rejects_bad_input(device):
    b = _Batch("turboquant_k3v4_nc", 64, 2, [20], [[20]], device)
    k, v, slots, qsl, sl, _ = b.step_args([1], [19])
    with pytest.raises(ValueError, match="needs query_start_loc"):
        tq_store(k, v, b.cache, slots, b.lay, centering=b.cent)
    fp8 = paged_layout("turboquant_k8v4", 64, BLOCK)
    with pytest.raises(ValueError, match="fp8 keys"):
        tq_store(k, v, torch.zeros(4, 2, fp8.head_page_bytes, dtype=torch.uint8, device=device), slots, fp8,
                 centering=b.cent, query_start_loc=qsl, seq_lens=sl, block_table=b.bt, center_sums=b.sums)
    other = key_centering_tables(_theta(64), 64, 32, 100, device=device)
    with pytest.raises(ValueError, match="do not match"):
        tq_store(k, v, b.cache, slots, b.lay, centering=other, query_start_loc=qsl, seq_lens=sl,
                 block_table=b.bt, center_sums=b.sums)
    with pytest.raises(ValueError, match="center_sums must be"):
        tq_store(k, v, b.cache, slots, b.lay, centering=b.cent, query_start_loc=qsl, seq_lens=sl,
                 block_table=b.bt, center_sums=torch.zeros(1, 2, 2, 32, device=device))
    with pytest.raises(ValueError, match="both center_tags and block_epochs"):
        tq_store(k, v, b.cache, slots, b.lay, centering=b.cent, query_start_loc=qsl, seq_lens=sl,
                 block_table=b.bt, center_sums=b.sums, center_tags=new_center_tags(1, 2, device))
    with pytest.raises(ValueError, match="block_epochs must be"):
        tq_key_center_sums(b.cache, b.lay, b.cent, b.bt, sl, b.sums, center_tags=new_center_tags(1, 2, device),
                           block_epochs=new_block_epochs(b.cache.shape[0] - 1, device))
    with pytest.raises(ValueError, match="center_tags must be"):
        tq_key_center_sums(b.cache, b.lay, b.cent, b.bt, sl, b.sums, center_tags=torch.zeros(1, 2, 2, device=device),
                           block_epochs=new_block_epochs(b.cache.shape[0], device))
    with pytest.raises(ValueError, match="center_sums that the store wrote"):
        tq_paged_attention(torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=device), b.cache, b.lay, b.bt,
                           torch.tensor([0, 1], dtype=torch.int32, device=device), sl, max_query_len=1,
                           max_seq_len=20, centering=b.cent)

# SPDX-License-Identifier: Apache-2.0
"""The patched vLLM's TurboQuant backend (turboquant_core/vllm/backend.py) on a GPU:
builder + impl against a float64 reference built from turboquant_core's dequantization.

Decode rows attend to every cached token (the step's token is read back from the cache);
prefill rows attend to their cached context (dequantized) plus the fresh bf16 K/V. Also: a
decode batch captured in a CUDA graph and replayed after the cache and lengths changed.
Needs CUDA, vLLM 0.26.0 patched by scripts/patches.py, and vLLM's FlashAttention.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from turboquant_core.formats import get_format
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.paged import center_sums_ref, dequant_cached_ref, paged_layout

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(scope="module")
def tq_attn():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    if not (Path(list(spec.submodule_search_locations)[0]) / "_aither_tq_patches.txt").is_file():
        pytest.skip("vllm is not patched: run `python scripts/patches.py apply --installed`")
    from turboquant_core.vllm import backend as module

    if not module.is_flash_attn_varlen_func_available():
        pytest.skip("vLLM's FlashAttention is not available")
    return module


def make_backend(tq_attn, fmt, *, num_heads, num_kv_heads, head_size, block_size, window=None, scale=None,
                 max_model_len=4096, num_speculative_tokens=None):
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    scale = scale if scale is not None else head_size ** -0.5
    impl = tq_attn.TQAttentionImpl(num_heads, head_size, scale, num_kv_heads, None, window, fmt)
    layer = SimpleNamespace(impl=impl, layer_name="layers.0.attn")
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=fmt),
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=None if num_speculative_tokens is None else SimpleNamespace(
            num_speculative_tokens=num_speculative_tokens, parallel_drafting=False),
        scheduler_config=SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=2048),
        compilation_config=SimpleNamespace(static_forward_context={"layers.0.attn": layer}),
    )
    spec = TQFullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                               head_size_v=head_size, dtype=torch.uint8,
                               tq_slot_size=get_format(fmt).bytes_per_token_per_head(head_size))
    builder = tq_attn.TQAttentionMetadataBuilder(spec, ["layers.0.attn"], vllm_config, torch.device(DEVICE))
    return impl, layer, builder


class Batch:
    """Requests (context_len, query_len), decodes (query_len 1) first, on a random paged layout."""

    def __init__(self, requests, *, num_heads, num_kv_heads, head_size, block_size, num_blocks, gen):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        dev = DEVICE
        self.requests = requests
        seq_lens = [c + q for c, q in requests]
        max_blocks = max(math.ceil(s / block_size) for s in seq_lens) + 1
        perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays unused
        assert len(requests) * max_blocks <= num_blocks - 1
        self.block_table = perm[: len(requests) * max_blocks].view(len(requests), max_blocks).to(torch.int32)
        qsl = [0]
        for _, q in requests:
            qsl.append(qsl[-1] + q)
        self.qsl = qsl
        self.num_tokens = qsl[-1]

        def slots(r, positions):
            return [int(self.block_table[r, p // block_size]) * block_size + p % block_size for p in positions]

        self.context_slots = torch.tensor([s for r, (c, _) in enumerate(requests) for s in slots(r, range(c))],
                                          dtype=torch.int64, device=dev)
        self.step_slots = torch.tensor([s for r, (c, q) in enumerate(requests) for s in slots(r, range(c, c + q))],
                                       dtype=torch.int64, device=dev)
        n_ctx = sum(c for c, _ in requests)
        self.k_ctx = torch.randn(n_ctx, num_kv_heads, head_size, generator=gen).to(dev, torch.bfloat16)
        self.v_ctx = torch.randn(n_ctx, num_kv_heads, head_size, generator=gen).to(dev, torch.bfloat16)
        self.q = torch.randn(self.num_tokens, num_heads, head_size, generator=gen).to(dev, torch.bfloat16)
        self.k = torch.randn(self.num_tokens, num_kv_heads, head_size, generator=gen).to(dev, torch.bfloat16)
        self.v = torch.randn(self.num_tokens, num_kv_heads, head_size, generator=gen).to(dev, torch.bfloat16)
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        self.cam = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu, seq_lens=seq_cpu.to(dev),
            num_reqs=len(requests), num_actual_tokens=self.num_tokens, max_query_len=max(q for _, q in requests),
            max_seq_len=max(seq_lens), block_table_tensor=self.block_table.to(dev), slot_mapping=self.step_slots,
            seq_lens_cpu_upper_bound=seq_cpu)


def fill_and_run(impl, layer, builder, batch, cache, *, cudagraph=False):
    if batch.context_slots.numel():
        impl.do_kv_cache_update(layer, batch.k_ctx, batch.v_ctx, cache, batch.context_slots)
    impl.do_kv_cache_update(layer, batch.k, batch.v, cache, batch.step_slots)
    md = builder.build_for_cudagraph_capture(batch.cam) if cudagraph else builder.build(0, batch.cam)
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)
    return out


def store_in_two_steps(tq_attn, monkeypatch, impl, layer, builder, batch, cache):
    """Store the batch's context in one step and its tokens in the next, each under its own metadata (the forward
    context's, patched in, as key centering reads it); returns the second step's metadata."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    ctx_lens = torch.tensor([c for c, _ in batch.requests], dtype=torch.int32)
    ctx_qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ctx_lens.cumsum(0).to(torch.int32)])
    cam_ctx = CommonAttentionMetadata(
        query_start_loc=ctx_qsl.to(DEVICE), query_start_loc_cpu=ctx_qsl, seq_lens=ctx_lens.to(DEVICE),
        num_reqs=len(batch.requests), num_actual_tokens=int(ctx_qsl[-1]), max_query_len=int(ctx_lens.max()),
        max_seq_len=int(ctx_lens.max()), block_table_tensor=batch.block_table.to(DEVICE),
        slot_mapping=batch.context_slots, seq_lens_cpu_upper_bound=ctx_lens)
    md_ctx = builder.build(0, cam_ctx)
    monkeypatch.setattr(tq_attn, "_layer_metadata", lambda _layer: md_ctx)
    impl.do_kv_cache_update(layer, batch.k_ctx, batch.v_ctx, cache, batch.context_slots)
    md = builder.build(0, batch.cam)
    monkeypatch.setattr(tq_attn, "_layer_metadata", lambda _layer: md)
    impl.do_kv_cache_update(layer, batch.k, batch.v, cache, batch.step_slots)
    return md


def attach_centering(impl, head_size, block_size):
    """Key centering on the impl, with a plain RoPE's tables (theta 10000)."""
    theta = 10000.0 ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    impl.key_centering = key_centering_tables(theta, head_size, block_size, 4096, device=DEVICE)


def centering_reference_args(impl, cache, layout, batch) -> dict:
    """The reference's centering arguments for the batch's requests (none when the impl is not centred)."""
    if impl.key_centering is None:
        return {}
    sums = center_sums_ref(cache, layout, impl.key_centering, batch.block_table.to(DEVICE), batch.cam.seq_lens)
    return dict(centering=impl.key_centering, center_sums=sums)


def reference(batch, cache, layout, scale, window, centering=None, center_sums=None, decode_threshold=1):
    """float64 attention: decode rows (query length <= decode_threshold) over the dequantized cache, prefill
    rows over the dequantized context plus their fresh bf16 K/V."""
    hq, d = batch.q.shape[1], batch.q.shape[2]
    out = torch.zeros(batch.num_tokens, hq, d, dtype=torch.float64, device=DEVICE)
    for r, (ctx, ql) in enumerate(batch.requests):
        t0 = batch.qsl[r]
        row = batch.block_table[r].to(DEVICE)
        cen = dict(centering=centering, center_sums_row=None if centering is None else center_sums[r])
        if ql <= decode_threshold:
            k, v = dequant_cached_ref(cache, layout, row, ctx + ql, **cen)
        else:
            kc, vc = dequant_cached_ref(cache, layout, row, ctx, **cen)
            k = torch.cat([kc, batch.k[t0:t0 + ql].float()])
            v = torch.cat([vc, batch.v[t0:t0 + ql].float()])
        g = hq // k.shape[1]
        k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
        pos_q = ctx + torch.arange(ql, device=DEVICE)
        pos_k = torch.arange(ctx + ql, device=DEVICE)
        mask = pos_k[None, :] <= pos_q[:, None]
        if window is not None:
            mask &= pos_k[None, :] > pos_q[:, None] - window
        s = torch.einsum("qhd,khd->hqk", batch.q[t0:t0 + ql].double(), k) * scale
        p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1)
        out[t0:t0 + ql] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _check(out, ref, what):
    err = (out.double() - ref).abs().max().item()
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    assert err < 3e-2, f"{what}: max abs error {err:.4f}"


@pytest.mark.parametrize("fmt,head_size", [("turboquant_k3v4_nc", 128), ("turboquant_2bit_nc", 128),
                                           ("turboquant_k8v4", 64), ("turboquant_3p5bit_nc", 80),
                                           ("turboquant_k3v2_nc", 256)])
def test_decode_batch(tq_attn, fmt, head_size):
    gen = torch.Generator().manual_seed(1)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16)
    impl, layer, builder = make_backend(tq_attn, fmt, **kw)
    batch = Batch([(0, 1), (37, 1), (300, 1), (1000, 1)], num_blocks=400, gen=gen, **kw)
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(400, 16, 2, head_size, fmt),
                        dtype=torch.uint8, device=DEVICE)
    out = fill_and_run(impl, layer, builder, batch, cache)
    _check(out, reference(batch, cache, paged_layout(fmt, head_size, 16), impl.scale, None), f"{fmt} d={head_size}")


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("block_size", [16, 64])
def test_mixed_batch(tq_attn, window, block_size):
    fmt, d = "turboquant_k3v4_nc", 128
    gen = torch.Generator().manual_seed(2)
    kw = dict(num_heads=12, num_kv_heads=4, head_size=d, block_size=block_size)
    impl, layer, builder = make_backend(tq_attn, fmt, window=window, scale=0.07, **kw)
    # two decodes, a first chunk (no context), a later chunk, a prefix hit with a short tail
    requests = [(55, 1), (130, 1), (0, 37), (100, 29), (211, 5)]
    batch = Batch(requests, num_blocks=64 if block_size == 64 else 256, gen=gen, **kw)
    nb = batch.block_table.max().item() + 1
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(max(nb, 64), block_size, 4, d, fmt),
                        dtype=torch.uint8, device=DEVICE)
    out = fill_and_run(impl, layer, builder, batch, cache)
    _check(out, reference(batch, cache, paged_layout(fmt, d, block_size), 0.07, window),
           f"window={window} block={block_size}")


@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("max_rows", [None, 300], ids=["gather", "rows-exceed-workspace"])
def test_long_chunks_attend_to_their_context_as_dense_rows(tq_attn, monkeypatch, centred, max_rows):
    """Prefill chunks of at least CONTEXT_GATHER_MIN_QUERY_LEN queries: every prefill request's context is
    dequantized into the builder's workspace next to its fresh K/V, and one causal FlashAttention pass serves
    the step (shorter chunks of the same step included). A step whose rows exceed the workspace takes the
    compressed kernel."""
    builder_cls = tq_attn.TQAttentionMetadataBuilder
    monkeypatch.setattr(builder_cls, "CONTEXT_GATHER_MIN_QUERY_LEN", 24)
    if max_rows is not None:
        monkeypatch.setattr(builder_cls, "CONTEXT_GATHER_MAX_ROWS", max_rows)
    fmt, d = "turboquant_k3v4_nc", 128
    gen = torch.Generator().manual_seed(7)
    kw = dict(num_heads=12, num_kv_heads=4, head_size=d, block_size=16)
    impl, layer, builder = make_backend(tq_attn, fmt, scale=0.07, **kw)
    if centred:
        attach_centering(impl, d, 16)
    # a decode, a first chunk, later chunks (one shorter than the threshold), a prefix hit's tail
    requests = [(55, 1), (0, 40), (100, 29), (211, 5), (300, 33)]
    batch = Batch(requests, num_blocks=256, gen=gen, **kw)
    batch.k_ctx += 4.0
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(256, 16, 4, d, fmt), dtype=torch.uint8,
                        device=DEVICE)
    md = store_in_two_steps(tq_attn, monkeypatch, impl, layer, builder, batch, cache)
    gather = md.context_gather
    assert (gather is not None) == (max_rows is None)
    if gather is not None:  # context rows, then the fresh rows, per prefill request
        seq = [c + q for c, q in requests[1:]]
        assert gather.cu_seqlens_k.tolist() == [0, *torch.tensor(seq).cumsum(0).tolist()]
        assert gather.max_seqlen_k == max(seq) and gather.max_context_len == 300
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)
    layout = paged_layout(fmt, d, 16)
    ref = reference(batch, cache, layout, 0.07, None, **centering_reference_args(impl, cache, layout, batch))
    _check(out, ref, f"centred={centred} max_rows={max_rows}")


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode-only"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_mixed_batch_with_key_centering(tq_attn, monkeypatch, block_size, decode_only):
    """The context is stored in one step and the batch in the next, each with its own metadata (the
    forward context's, patched in); keys carry a shared component that the centres remove. A decode-only
    batch takes the store's single-token path (sums first, then one pass), including a request whose first
    page fills in this step."""
    fmt, d = "turboquant_k3v4_nc", 128
    gen = torch.Generator().manual_seed(5)
    kw = dict(num_heads=12, num_kv_heads=4, head_size=d, block_size=block_size)
    impl, layer, builder = make_backend(tq_attn, fmt, scale=0.07, **kw)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    impl.key_centering = key_centering_tables(theta, d, block_size, 4096, device=DEVICE)
    # decodes first (the builder's order); the third has no full first page yet
    requests = [(55, 1), (130, 1), (9, 1), (0, 37), (100, 29), (211, 5)]
    if decode_only:  # the fourth fills its first page with this step's token
        requests = [(55, 1), (130, 1), (9, 1), (block_size - 1, 1), (211, 1)]
    batch = Batch(requests, num_blocks=64 if block_size == 64 else 256, gen=gen, **kw)
    batch.k_ctx += 4.0  # a shared component (the same in every position: RoPE'd or not, the centres take it)
    nb = batch.block_table.max().item() + 1
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(max(nb, 64), block_size, 4, d, fmt),
                        dtype=torch.uint8, device=DEVICE)
    md = store_in_two_steps(tq_attn, monkeypatch, impl, layer, builder, batch, cache)
    assert (md.num_prefills == 0) == decode_only
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)
    layout = paged_layout(fmt, d, block_size)
    sums = center_sums_ref(cache, layout, impl.key_centering, batch.block_table.to(DEVICE), batch.cam.seq_lens)
    assert sums[1].abs().max() > 1.0 and (sums[2] == 0).all()
    if decode_only:  # the backend's sums for the request whose first page filled now are zeros, unused
        assert sums[3].abs().max() > 1.0 and (md.center_sums[3] == 0).all()
    else:
        assert (sums[3] == 0).all() == (37 < block_size)
    _check(out, reference(batch, cache, layout, 0.07, None, impl.key_centering, sums), f"centred block={block_size}")
    plain = reference(batch, cache, layout, 0.07, None)
    assert (plain - out.double()).abs().max() > 0.1  # the centres are really there


@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
def test_speculative_verification_runs_as_decode(tq_attn, monkeypatch, centred):
    """With 3 speculative tokens the decode threshold is 4: verification rows (each request's last 1-4 tokens)
    take the decode plan (4 queries per request), read their own tokens back from the cache and attend causally
    among themselves; a longer chunk stays prefill. Then a uniform verification batch (what vLLM's full CUDA
    graphs replay) captured from build_for_cudagraph_capture gives what eager gives."""
    fmt, d, bs = "turboquant_k3v4_nc", 128, 16
    gen = torch.Generator().manual_seed(6)
    kw = dict(num_heads=12, num_kv_heads=4, head_size=d, block_size=bs)
    impl, layer, builder = make_backend(tq_attn, fmt, scale=0.07, num_speculative_tokens=3, **kw)
    assert builder.reorder_batch_threshold == 4
    if centred:
        attach_centering(impl, d, bs)
    # verification rows (4, 1, 3 queries; one whose first page fills in this step), then a prefill chunk
    requests = [(55, 4), (130, 1), (13, 3), (300, 4), (100, 29)]
    batch = Batch(requests, num_blocks=256, gen=gen, **kw)
    batch.k_ctx += 4.0
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(256, bs, 4, d, fmt), dtype=torch.uint8,
                        device=DEVICE)
    md = store_in_two_steps(tq_attn, monkeypatch, impl, layer, builder, batch, cache)
    assert (md.num_decodes, md.num_decode_tokens, md.decode_query_len, md.num_prefills) == (4, 12, 4, 1)
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)
    layout = paged_layout(fmt, d, bs)
    cen = centering_reference_args(impl, cache, layout, batch)
    _check(out, reference(batch, cache, layout, 0.07, None, decode_threshold=4, **cen), "verification")

    # A uniform verification batch (the decodes above, each with 4 queries), captured and replayed.
    uni = [(c + q, 4) for c, q in requests[:4]]
    ubatch = Batch(uni, num_blocks=256, gen=gen, **kw)
    ubatch.block_table, ubatch.cam = batch.block_table[:4], ubatch.cam.replace(
        block_table_tensor=batch.block_table[:4].to(DEVICE))
    ubatch.step_slots = torch.tensor([int(ubatch.block_table[r, p // bs]) * bs + p % bs
                                      for r, (c, q) in enumerate(uni) for p in range(c, c + q)],
                                     dtype=torch.int64, device=DEVICE)
    ubatch.cam = ubatch.cam.replace(slot_mapping=ubatch.step_slots)
    md_g = builder.build_for_cudagraph_capture(ubatch.cam)
    assert (md_g.num_prefills, md_g.decode_query_len) == (0, 4)
    monkeypatch.setattr(tq_attn, "_layer_metadata", lambda _layer: md_g)
    out_g = torch.zeros_like(ubatch.q)
    impl.do_kv_cache_update(layer, ubatch.k, ubatch.v, cache, ubatch.step_slots)
    impl.forward(layer, ubatch.q, ubatch.k, ubatch.v, cache, md_g, output=out_g)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, ubatch.q, ubatch.k, ubatch.v, cache, md_g, output=out_g)
    out_g.zero_()
    graph.replay()
    md_e = builder.build(0, ubatch.cam)
    eager = torch.zeros_like(out_g)
    impl.forward(layer, ubatch.q, ubatch.k, ubatch.v, cache, md_e, output=eager)
    torch.testing.assert_close(out_g, eager, atol=2e-3, rtol=2e-3)
    cen = centering_reference_args(impl, cache, layout, ubatch)
    _check(out_g, reference(ubatch, cache, layout, 0.07, None, decode_threshold=4, **cen), "uniform verification")


@pytest.mark.parametrize("centred", [False, True], ids=["plain", "centred"])
def test_prefill_from_cache_attends_every_row_over_the_stored_tokens(tq_attn, monkeypatch, centred):
    """TQConfig.prefill_from_cache: prefill rows (a first chunk, later chunks, a prefix hit's tail) attend to their
    own tokens as stored, like decode rows: every row matches the reference over the dequantized cache alone."""
    from turboquant_core.config import TQConfig

    fmt, d, bs = "turboquant_k3v4_nc", 128, 16
    gen = torch.Generator().manual_seed(7)
    kw = dict(num_heads=12, num_kv_heads=4, head_size=d, block_size=bs)
    impl, layer, builder = make_backend(tq_attn, fmt, scale=0.07, **kw)
    builder.tq_config = TQConfig(prefill_from_cache=True)
    if centred:
        attach_centering(impl, d, bs)
    requests = [(55, 1), (130, 1), (0, 37), (100, 29), (211, 5), (0, 300)]
    batch = Batch(requests, num_blocks=256, gen=gen, **kw)
    batch.k_ctx += 4.0
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(256, bs, 4, d, fmt), dtype=torch.uint8,
                        device=DEVICE)
    md = store_in_two_steps(tq_attn, monkeypatch, impl, layer, builder, batch, cache)
    assert md.prefill_from_cache and (md.num_decodes, md.num_prefills) == (2, 4)
    out = torch.full_like(batch.q, float("nan"))
    impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)
    layout = paged_layout(fmt, d, bs)
    cen = centering_reference_args(impl, cache, layout, batch)
    _check(out, reference(batch, cache, layout, 0.07, None, decode_threshold=1 << 30, **cen), "prefill from cache")


def test_prefill_without_context_writes_output_directly(tq_attn):
    fmt, d = "turboquant_4bit_nc", 128
    gen = torch.Generator().manual_seed(3)
    kw = dict(num_heads=8, num_kv_heads=8, head_size=d, block_size=32)
    impl, layer, builder = make_backend(tq_attn, fmt, **kw)
    batch = Batch([(0, 50), (0, 3)], num_blocks=16, gen=gen, **kw)
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(16, 32, 8, d, fmt), dtype=torch.uint8,
                        device=DEVICE)
    out = fill_and_run(impl, layer, builder, batch, cache)
    _check(out, reference(batch, cache, paged_layout(fmt, d, 32), impl.scale, None), "first chunks")


def test_profiling_run_zero_fills(tq_attn):
    impl, layer, _ = make_backend(tq_attn, "turboquant_k3v4_nc", num_heads=4, num_kv_heads=2, head_size=128,
                                  block_size=16)
    out = torch.full((5, 4, 128), 3.0, device=DEVICE, dtype=torch.bfloat16)
    q = torch.zeros_like(out)
    impl.forward(layer, q, q[:, :2], q[:, :2], torch.empty(0, device=DEVICE), None, output=out)
    assert out.abs().sum().item() == 0


def test_decode_cuda_graph_replay(tq_attn):
    fmt, d, bs = "turboquant_k3v4_nc", 128, 16
    gen = torch.Generator().manual_seed(4)
    kw = dict(num_heads=8, num_kv_heads=2, head_size=d, block_size=bs)
    impl, layer, builder = make_backend(tq_attn, fmt, **kw)
    batch = Batch([(20, 1), (300, 1), (700, 1)], num_blocks=300, gen=gen, **kw)
    cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(300, bs, 2, d, fmt), dtype=torch.uint8,
                        device=DEVICE)
    fill_and_run(impl, layer, builder, batch, cache)  # compiles the kernels outside the capture
    md = builder.build_for_cudagraph_capture(batch.cam)
    out = torch.zeros_like(batch.q)
    q_static = batch.q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        impl.forward(layer, q_static, batch.k, batch.v, cache, md, output=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(layer, q_static, batch.k, batch.v, cache, md, output=out)

    # Next step: every request one token longer, new queries; same metadata buffers.
    for step in range(2):
        new_lens = [c + 2 + step for c, _ in batch.requests]
        slots = torch.tensor([int(batch.block_table[r, (n - 1) // bs]) * bs + (n - 1) % bs
                              for r, n in enumerate(new_lens)], dtype=torch.int64, device=DEVICE)
        k_new = torch.randn(3, 2, d, generator=gen).to(DEVICE, torch.bfloat16)
        impl.do_kv_cache_update(layer, k_new, k_new.flip(-1), cache, slots)
        batch.cam.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q_static.copy_(torch.randn(3, 8, d, generator=gen).to(DEVICE, torch.bfloat16))
        graph.replay()
        eager = torch.zeros_like(out)
        cam = batch.cam.replace(max_seq_len=max(new_lens),
                                seq_lens_cpu_upper_bound=torch.tensor(new_lens, dtype=torch.int32))
        impl.forward(layer, q_static, batch.k, batch.v, cache, builder.build(0, cam), output=eager)
        torch.testing.assert_close(out, eager, atol=2e-3, rtol=2e-3)


def test_kept_center_sums_in_a_cuda_graph(tq_attn, monkeypatch):
    """Decode steps (store + attention) captured in one CUDA graph and replayed, with the layer's key-centering sums
    kept across steps (builder.keep_center_sums), against the same steps with the scratch recomputed every step: the
    same outputs and cache bytes, bit for bit, while a first page fills (request 1, in the eager step before the
    capture) and after. Then the kept rows of the full first pages are poisoned: a replay leaves them as they are
    (its sums launch only compared tags) and rewrites the row whose first page is not full (zeros)."""
    from turboquant_core.ops.kv_store import new_block_epochs

    fmt, d, bs = "turboquant_k3v4_nc", 128, 16
    kw = dict(num_heads=8, num_kv_heads=2, head_size=d, block_size=bs)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    requests = [(55, 1), (bs - 1, 1), (9, 1)]

    def run(keep):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        gen = torch.Generator().manual_seed(6)
        impl, layer, builder = make_backend(tq_attn, fmt, **kw)
        impl.key_centering = key_centering_tables(theta, d, bs, 4096, device=DEVICE)
        batch = Batch(requests, num_blocks=64, gen=gen, **kw)
        batch.k_ctx += 4.0  # a shared component
        cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(64, bs, 2, d, fmt), dtype=torch.uint8,
                            device=DEVICE)
        if keep:
            builder.keep_center_sums([layer.layer_name], new_block_epochs(64, DEVICE))
        ctx_lens = torch.tensor([c for c, _ in requests], dtype=torch.int32)
        ctx_qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ctx_lens.cumsum(0).to(torch.int32)])
        md_ctx = builder.build(0, CommonAttentionMetadata(
            query_start_loc=ctx_qsl.to(DEVICE), query_start_loc_cpu=ctx_qsl, seq_lens=ctx_lens.to(DEVICE),
            num_reqs=len(requests), num_actual_tokens=int(ctx_qsl[-1]), max_query_len=int(ctx_lens.max()),
            max_seq_len=int(ctx_lens.max()), block_table_tensor=batch.block_table.to(DEVICE),
            slot_mapping=batch.context_slots, seq_lens_cpu_upper_bound=ctx_lens))
        monkeypatch.setattr(tq_attn, "_layer_metadata", lambda _layer: md_ctx)
        impl.do_kv_cache_update(layer, batch.k_ctx, batch.v_ctx, cache, batch.context_slots)

        cam = batch.cam  # its device seq_lens and slot_mapping are the graph's inputs, updated in place
        md = builder.build_for_cudagraph_capture(cam)
        monkeypatch.setattr(tq_attn, "_layer_metadata", lambda _layer: md)
        k, v, q = batch.k.clone(), batch.v.clone(), batch.q.clone()
        out = torch.zeros_like(q)

        def decode_step():
            impl.do_kv_cache_update(layer, k, v, cache, cam.slot_mapping)
            impl.forward(layer, q, k, v, cache, md, output=out)

        stream = torch.cuda.Stream()  # the first step eagerly (compiles the kernels), then the capture
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decode_step()
        torch.cuda.current_stream().wait_stream(stream)
        outs = [out.clone()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_step()
        step_gen = torch.Generator().manual_seed(7)

        def replay(step):
            lens = [c + 1 + step for c, _ in requests]
            cam.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            cam.slot_mapping.copy_(torch.tensor([int(batch.block_table[r, (n - 1) // bs]) * bs + (n - 1) % bs
                                                 for r, n in enumerate(lens)]))
            k.copy_(torch.randn(k.shape, generator=step_gen).to(DEVICE, k.dtype))
            v.copy_(torch.randn(v.shape, generator=step_gen).to(DEVICE, v.dtype))
            q.copy_(torch.randn(q.shape, generator=step_gen).to(DEVICE, q.dtype))
            graph.replay()
            return out.clone()

        outs += [replay(step) for step in (1, 2, 3)]
        return outs, cache.clone(), replay, builder, layer

    kept_outs, kept_cache, kept_replay, builder, layer = run(keep=True)
    outs, cache, _, _, _ = run(keep=False)
    for a, b in zip(kept_outs, outs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kept_cache, cache)
    sums, tags = builder.kept_center_sums.layers[layer.layer_name]
    assert tags[:2, :, 0].ne(-1).all() and tags[2, :, 0].eq(-1).all()
    sums[:2] = float("nan")
    sums[2] = 1.0
    kept_replay(4)
    torch.cuda.synchronize()
    assert sums[:2].isnan().all() and sums[2].eq(0).all()

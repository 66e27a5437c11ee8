# SPDX-License-Identifier: Apache-2.0
"""The TurboQuant backend's key-centering glue (turboquant_core/vllm/backend.py, .warmup) without a GPU: builder and
impl under the patched vLLM 0.26.0, kernels in Triton's interpreter, decode-only steps (prefill attention needs
vLLM's FlashAttention, which the CPU does not have; its stores run here).

Sums kept across steps: each centred layer of a group has its own rows and tags, its store and its attention use them,
the group's layers and builders share one block-epoch array, and the result is the same bits as the scratch that is
recomputed every step. Runs only where a patched vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from turboquant_core.formats import get_format
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.kv_store import new_block_epochs

FMT, D, HKV, HQ, BS, NUM_BLOCKS = "turboquant_k3v4_nc", 64, 2, 4, 16, 24
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def tq():
    if torch.cuda.is_available():
        pytest.skip("runs the kernels in the interpreter (on a GPU: test_tq_backend_gpu.py)")
    from test_config_layer import _patched_imports

    return _patched_imports("the backend", "turboquant_core.vllm.backend")[0]


@pytest.fixture
def cpu_backend(tq, monkeypatch):
    # decode-only steps never call FlashAttention; the impl only checks that it exists
    monkeypatch.setattr(tq, "is_flash_attn_varlen_func_available", lambda: True)
    monkeypatch.setattr(tq, "get_flash_attn_version", lambda head_size=None: 3)
    return tq


def _group(tq, *, max_num_seqs=6):
    """Two centred layers (same RoPE tables) in one builder, each with its own cache."""
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    cent = key_centering_tables(10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D), D, BS, 4096)
    layers = {}
    for name in LAYERS:
        impl = tq.TQAttentionImpl(HQ, D, D ** -0.5, HKV, None, None, FMT)
        impl.key_centering = cent
        layers[name] = SimpleNamespace(impl=impl, layer_name=name)
    config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=FMT),
        model_config=SimpleNamespace(max_model_len=4096, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1), speculative_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048),
        compilation_config=SimpleNamespace(static_forward_context=layers))
    spec = TQFullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, head_size_v=D, dtype=torch.uint8,
                               tq_slot_size=get_format(FMT).bytes_per_token_per_head(D))
    builder = tq.TQAttentionMetadataBuilder(spec, LAYERS, config, torch.device("cpu"))
    shape = tq.TQAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BS, HKV, D, FMT)
    caches = {name: torch.zeros(shape, dtype=torch.uint8) for name in LAYERS}
    return layers, builder, caches


def _metadata(query_lens, seq_lens, block_table, slots):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl, num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slots, seq_lens_cpu_upper_bound=sl)


def _serve(tq, monkeypatch, keep: bool):
    """Requests of 40, 15 and 9 tokens stored in one step (store only), then two decode steps (store + attention)
    per layer; before the second, request 1 ends and vLLM moves request 2 into its row. Each layer's keys carry
    its own shared component. Returns the decode outputs, the caches and the builder."""
    layers, builder, caches = _group(tq)
    if keep:
        kept = builder.keep_center_sums(LAYERS, new_block_epochs(NUM_BLOCKS, "cpu"))
        assert kept is builder.keep_center_sums(LAYERS, kept.block_epochs)  # once: the buffers stay
    g = torch.Generator().manual_seed(0)
    lens = [40, 15, 9]
    table = (torch.randperm(NUM_BLOCKS - 1, generator=g)[:12] + 1).view(3, 4).to(torch.int32)
    keys = {name: [torch.randn(n + 2, HKV, D, generator=g) + 3.0 * (1 - 2 * i) for n in lens]
            for i, name in enumerate(LAYERS)}

    def slots(r, positions):
        return torch.tensor([int(table[r, p // BS]) * BS + p % BS for p in positions], dtype=torch.int64)

    def step(rows, query_lens, done, attend):
        new = [range(done[r], done[r] + q) for r, q in zip(rows, query_lens)]
        sl = torch.cat([slots(r, p) for r, p in zip(rows, new)])
        md = builder.build(0, _metadata(query_lens, [done[r] + q for r, q in zip(rows, query_lens)], table[rows], sl))
        monkeypatch.setattr(tq, "_layer_metadata", lambda _layer: md)
        outs = []
        for name in LAYERS:
            k = torch.cat([keys[name][r][p.start:p.stop] for r, p in zip(rows, new)]).to(torch.bfloat16)
            layers[name].impl.do_kv_cache_update(layers[name], k, k, caches[name], sl)
            if attend:
                q = torch.randn(len(rows), HQ, D, generator=g).to(torch.bfloat16)
                out = torch.zeros_like(q)
                layers[name].impl.forward(layers[name], q, k, k, caches[name], md, output=out)
                outs.append(out)
        for r, q in zip(rows, query_lens):
            done[r] += q
        return outs

    done = [0, 0, 0]
    step([0, 1, 2], lens, done, attend=False)
    outs = step([0, 1, 2], [1, 1, 1], done, attend=True)  # request 1 fills its first page
    outs += step([0, 2], [1, 1], done, attend=True)
    return outs, caches, builder, table


def test_kept_sums_are_per_layer_and_the_same_bits_as_recomputed_ones(cpu_backend, monkeypatch):
    kept_outs, kept_caches, builder, table = _serve(cpu_backend, monkeypatch, keep=True)
    outs, caches, scratch_builder, _ = _serve(cpu_backend, monkeypatch, keep=False)
    assert scratch_builder.kept_center_sums is None
    for a, b in zip(kept_outs, outs, strict=True):
        assert torch.equal(a, b)
    for name in LAYERS:
        assert torch.equal(kept_caches[name], caches[name])
    kept = builder.kept_center_sums
    # rows 0, 1 after the last step hold requests 0 and 2 (9 + 2 tokens: not full, invalid tag)
    first = table[:, 0].tolist()
    assert kept.tags[:, :2, :, 0].tolist() == [[[first[0]] * HKV, [-1] * HKV]] * len(LAYERS)
    # one epoch array for the group: both layers bumped it for every first-page token
    assert kept.block_epochs[table[:, 0].long()].tolist() == [2 * BS, 2 * BS, 2 * 11]
    assert kept.tags[:, 0, :, 1].eq(2 * BS).all()
    # each layer's rows are its own: the layers' keys differ, so do their sums
    sums0, sums1 = (kept.layers[name][0][0] for name in LAYERS)
    assert sums0.abs().max() > 1.0 and not torch.equal(sums0, sums1)


def test_warmup_keeps_sums_for_the_centred_layers_of_every_builder(cpu_backend):
    """Micro-batches: a group has one builder per micro-batch, each with its own rows; one epoch array is shared,
    as any of them may store into a block. A layer without key centering gets no rows."""
    from turboquant_core.vllm.warmup import _keep_center_sums

    layers, builder, _ = _group(cpu_backend)
    _, other, _ = _group(cpu_backend)
    layers[LAYERS[1]].impl.key_centering = None
    group = SimpleNamespace(layer_names=LAYERS, metadata_builders=[builder, other])
    num_layers, nbytes = _keep_center_sums(group, layers, NUM_BLOCKS, "cpu")
    a, b = builder.kept_center_sums, other.kept_center_sums
    assert num_layers == 1 and list(a.layers) == [LAYERS[0]] and a.block_epochs is b.block_epochs
    assert a.sums.data_ptr() != b.sums.data_ptr() and a.sums.shape == (1, 6, HKV, 2, D)
    assert nbytes == 2 * a.nbytes() + NUM_BLOCKS * 4


def test_decode_kernel_option_reaches_the_attention_plans(cpu_backend):
    """--tq-decode-kernel (TQConfig.decode_kernel) is the configuration of the builder's attention plans."""
    from turboquant_core.config import TQConfig

    _, builder, _ = _group(cpu_backend)
    assert builder._new_plan(HQ).config.decode_kernel == "auto"
    builder.tq_config = TQConfig(decode_kernel="wgmma")
    assert builder._new_plan(HQ).config.decode_kernel == "wgmma"


def test_prefill_from_cache_gives_each_token_the_same_attention_however_the_prompt_is_chunked(cpu_backend,
                                                                                               monkeypatch):
    """TQConfig.prefill_from_cache: prefill chunks attend to their own tokens as stored (no FlashAttention pass, so
    the path runs here). A 40-token prompt prefilled in one chunk and in chunks of 25 and 15 gives its last 15
    tokens the same outputs, and both match the reference over the dequantized cache; a decode row in the same
    step takes the decode plan as before."""
    from turboquant_core.config import TQConfig
    from turboquant_core.ops.paged import center_sums_ref, paged_layout, tq_paged_attention_ref

    def run(chunks):
        layers, builder, caches = _group(cpu_backend)
        assert not builder.tq_config.prefill_from_cache
        builder.tq_config = TQConfig(prefill_from_cache=True)
        name = LAYERS[0]
        impl, layer, cache = layers[name].impl, layers[name], caches[name]
        g = torch.Generator().manual_seed(3)
        table = (torch.arange(2 * 4, dtype=torch.int32) + 1).view(2, 4)
        keys = torch.randn(40, HKV, D, generator=g) + 2.0
        queries = torch.randn(40, HQ, D, generator=g).to(torch.bfloat16)
        other = torch.randn(21, HKV, D, generator=g)  # request 1: 20 tokens stored, then one decode token
        slot = lambda r, p: int(table[r, p // BS]) * BS + p % BS  # noqa: E731
        md = builder.build(0, _metadata([20], [20], table[1:], torch.tensor([slot(1, p) for p in range(20)])))
        monkeypatch.setattr(cpu_backend, "_layer_metadata", lambda _layer: md)
        impl.do_kv_cache_update(layer, other[:20].to(torch.bfloat16), other[:20].to(torch.bfloat16), cache,
                                torch.tensor([slot(1, p) for p in range(20)]))
        done, out = 0, None
        for n in chunks:
            # the decode row first (the builder's order), then the prompt's chunk
            sl = torch.tensor([slot(1, 20)] + [slot(0, p) for p in range(done, done + n)])
            md = builder.build(0, _metadata([1, n], [21, done + n], table[[1, 0]], sl))
            assert md.prefill_from_cache and md.num_decodes == 1 and md.num_prefills == 1
            monkeypatch.setattr(cpu_backend, "_layer_metadata", lambda _layer, md=md: md)
            k = torch.cat([other[20:], keys[done:done + n]]).to(torch.bfloat16)
            impl.do_kv_cache_update(layer, k, k, cache, sl)
            q = torch.cat([queries[:1], queries[done:done + n]])
            out = torch.zeros_like(q)
            impl.forward(layer, q, k, k, cache, md, output=out)
            done += n
        lay = paged_layout(FMT, D, BS)
        bt, sl_all = table[:1], torch.tensor([40], dtype=torch.int32)
        qsl = torch.tensor([0, chunks[-1]], dtype=torch.int32)
        sums = center_sums_ref(cache, lay, impl.key_centering, bt, sl_all)
        ref, _ = tq_paged_attention_ref(queries[40 - chunks[-1]:], cache, lay, bt, qsl, sl_all,
                                        centering=impl.key_centering, center_sums=sums)
        torch.testing.assert_close(out[1:].float(), ref.float(), atol=2e-2, rtol=1e-2)
        return out[1:]

    whole = run([40])[25:]
    chunked = run([25, 15])
    torch.testing.assert_close(whole.float(), chunked.float(), atol=2e-3, rtol=2e-3)


def _varlen_causal_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             out, fa_version, **unused):
    """FlashAttention's varlen contract in float64 (the CPU has no FlashAttention): request r's queries
    cu_seqlens_q[r]:[r + 1] against its keys cu_seqlens_k[r]:[r + 1], causal aligned to the last key."""
    assert causal
    g = q.shape[1] // k.shape[1]
    for r in range(cu_seqlens_q.shape[0] - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[r], cu_seqlens_q[r + 1], cu_seqlens_k[r], cu_seqlens_k[r + 1]))
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        kk = k[k0:k1].double().repeat_interleave(g, 1)
        vv = v[k0:k1].double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * softmax_scale
        pos_q = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)
        s = s.masked_fill(torch.arange(k1 - k0)[None, :] > pos_q[:, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).to(out.dtype)
    return out


@pytest.mark.parametrize("max_rows", [None, 64], ids=["dense-rows", "rows-exceed-workspace"])
def test_long_chunks_lay_out_context_and_fresh_rows_for_one_flashattention_pass(cpu_backend, monkeypatch, max_rows):
    """Chunks of at least CONTEXT_GATHER_MIN_QUERY_LEN queries: each prefill request's rows in the builder's workspace
    are its cached context, dequantized with the key centres added back, then its fresh K/V, at cu_seqlens_k; one
    causal pass over them (here FlashAttention's contract in float64) gives every query its context and the chunk's
    tokens up to its own. The planning is host-side (no device sync); a step whose rows exceed the workspace plans
    the compressed kernel instead."""
    from turboquant_core.ops.paged import center_sums_ref, dequant_cached_ref, paged_layout

    if max_rows is not None:
        monkeypatch.setattr(cpu_backend.TQAttentionMetadataBuilder, "CONTEXT_GATHER_MAX_ROWS", max_rows)
    monkeypatch.setattr(cpu_backend, "flash_attn_varlen_func", _varlen_causal_attention, raising=False)
    layers, builder, caches = _group(cpu_backend)
    name = LAYERS[0]
    impl, layer, cache = layers[name].impl, layers[name], caches[name]
    g = torch.Generator().manual_seed(4)
    table = (torch.arange(3 * 4, dtype=torch.int32) + 1).view(3, 4)
    ctx, fresh = [33, 0, 7], [17, 16, 20]  # a later chunk, a first chunk, a prefix hit's tail
    keys = [(torch.randn(c + f, HKV, D, generator=g) + 2.0).to(torch.bfloat16) for c, f in zip(ctx, fresh)]
    vals = [torch.randn(c + f, HKV, D, generator=g).to(torch.bfloat16) for c, f in zip(ctx, fresh)]
    slot = lambda r, p: int(table[r, p // BS]) * BS + p % BS  # noqa: E731
    stored = [r for r in range(3) if ctx[r]]
    sl = torch.tensor([slot(r, p) for r in stored for p in range(ctx[r])])
    md = builder.build(0, _metadata([ctx[r] for r in stored], [ctx[r] for r in stored], table[stored], sl))
    monkeypatch.setattr(cpu_backend, "_layer_metadata", lambda _layer: md)
    impl.do_kv_cache_update(layer, torch.cat([keys[r][:ctx[r]] for r in stored]),
                            torch.cat([vals[r][:ctx[r]] for r in stored]), cache, sl)
    sl = torch.tensor([slot(r, p) for r in range(3) for p in range(ctx[r], ctx[r] + fresh[r])])
    md = builder.build(0, _metadata(fresh, [c + f for c, f in zip(ctx, fresh)], table, sl))
    monkeypatch.setattr(cpu_backend, "_layer_metadata", lambda _layer: md)
    k = torch.cat([keys[r][ctx[r]:] for r in range(3)])
    v = torch.cat([vals[r][ctx[r]:] for r in range(3)])
    impl.do_kv_cache_update(layer, k, v, cache, sl)
    gather = md.context_gather
    assert md.num_prefills == 3 and (gather is not None) == (max_rows is None)
    if gather is None:
        return  # the compressed kernel's path needs FlashAttention for the fresh tokens (GPU test)
    assert gather.cu_seqlens_k.tolist() == [0, 50, 66, 93] and gather.max_seqlen_k == 50
    assert gather.max_context_len == 33
    assert gather.fresh_rows.tolist() == [*range(33, 50), *range(50, 66), *range(73, 93)]
    q = torch.randn(sum(fresh), HQ, D, generator=g).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    impl.forward(layer, q, k, v, cache, md, output=out)
    lay = paged_layout(FMT, D, BS)
    lens = torch.tensor(ctx, dtype=torch.int32)
    sums = center_sums_ref(cache, lay, impl.key_centering, table, lens)
    q0 = 0
    for r in range(3):
        kc, vc = dequant_cached_ref(cache, lay, table[r], ctx[r], centering=impl.key_centering,
                                    center_sums_row=sums[r])
        kk, vv = torch.cat([kc, keys[r][ctx[r]:].float()]), torch.cat([vc, vals[r][ctx[r]:].float()])
        ref = torch.empty(fresh[r], HQ, D, dtype=torch.float64)
        _varlen_causal_attention(q[q0:q0 + fresh[r]], kk, vv, torch.tensor([0, fresh[r]]),
                                 torch.tensor([0, ctx[r] + fresh[r]]), fresh[r], ctx[r] + fresh[r], impl.scale, True,
                                 ref, 3)
        torch.testing.assert_close(out[q0:q0 + fresh[r]].float(), ref.float(), atol=2e-2, rtol=1e-2)
        q0 += fresh[r]


def test_warmup_compiles_ahead_then_runs_every_layer_variant_of_every_group(cpu_backend, monkeypatch):
    """warmup_tq_attention gives compile_ahead one pass over every group's warm-up calls (a centred and a plain layer
    variant here), with the node's CPUs shared among its ranks (or --tq-compile-workers), then makes the same calls
    for real."""
    from turboquant_core.config import TQConfig
    from turboquant_core.ops import compile_ahead
    from turboquant_core.vllm import warmup

    layers, builder, caches = _group(cpu_backend)
    layers[LAYERS[1]].impl.key_centering = None
    for name in LAYERS:
        layers[name].kv_cache = caches[name]
    calls, ahead, phase = [], [], ["real"]

    def warmup_kernels(kv_cache, dtype, centering=None):
        calls.append((phase[0], kv_cache.data_ptr(), dtype, centering is not None))
        return 3

    def recorded_ahead(launch, workers):
        ahead.append(workers)
        phase[0] = "ahead"
        try:
            return compile_ahead.compile_ahead(launch, workers)
        finally:
            phase[0] = "real"

    monkeypatch.setattr(builder, "warmup_kernels", warmup_kernels)
    monkeypatch.setattr(warmup, "attach_key_centering", lambda model_runner: {})
    monkeypatch.setattr(warmup, "compile_ahead", recorded_ahead)
    group = SimpleNamespace(backend=cpu_backend.TQAttentionBackend, layer_names=LAYERS,
                            get_metadata_builder=lambda: builder, metadata_builders=[builder])
    runner = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype=torch.bfloat16), attn_groups=[[group]],
        parallel_config=SimpleNamespace(local_world_size=2, data_parallel_size_local=1))
    warmup.warmup_tq_attention(runner)
    runner.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(turboquant=TQConfig(compile_workers=1)))
    warmup.warmup_tq_attention(runner)  # --tq-compile-workers 1
    assert ahead == [compile_ahead.default_workers(2), 1]
    ptr = caches[LAYERS[0]].data_ptr()
    # each start: recorded inside compile_ahead, then for real; the centred and the plain variant each time
    assert calls == [(p, ptr, torch.bfloat16, c) for p in ("ahead", "real") for c in (True, False)] * 2
    assert builder.kept_center_sums is not None and list(builder.kept_center_sums.layers) == [LAYERS[0]]

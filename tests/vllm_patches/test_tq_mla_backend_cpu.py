# SPDX-License-Identifier: Apache-2.0
"""The TURBOQUANT_MLA backend's glue (turboquant_core/vllm/mla_backend.py, patch 0011) without a GPU: backend
selection for MLA layers, the KV-cache spec and cache shape, and one impl serving stores, decode attention and the
prefill context through vLLM's own MLA code (MLACommonImpl._compute_prefill_context), kernels in Triton's interpreter.

Runs only where a patched vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from turboquant_core.formats import KV_FORMATS, mla_format
from turboquant_core.ops.mla_layout import mla_paged_layout
from turboquant_core.ops.mla_reference import mla_decode_attention_ref, mla_gather_dequant_ref

FMT, LR, R, BS, NUM_BLOCKS = "turboquant_k3v4_nc", 512, 64, 16, 12
HEADS, NOPE, V = 4, 32, 32


@pytest.fixture(scope="module")
def tqm():
    if torch.cuda.is_available():
        pytest.skip("runs the kernels in the interpreter (on a GPU: test_tq_mla_gpu.py)")
    from test_config_layer import _patched_imports

    return _patched_imports("the MLA backend", "turboquant_core.vllm.mla_backend")[0]


def _selector(kv_cache_dtype, **kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=LR + R, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                                   block_size=BS, use_mla=True, **kw)


@pytest.fixture
def cuda_platform(tqm, monkeypatch):
    """vllm.platforms.cuda, imported on a machine without CUDA: its selection logic is plain Python, but the module
    first loads vLLM's compiled CUDA ops, which need libcuda; that one import is left out here."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    monkeypatch.delitem(sys.modules, "vllm.platforms.cuda", raising=False)
    import vllm.platforms.cuda as cuda

    yield cuda
    sys.modules.pop("vllm.platforms.cuda", None)


@pytest.mark.parametrize("major", [8, 9, 12])  # (sm_100 backends touch CUDA at import)
def test_mla_layers_with_a_turboquant_dtype_get_the_turboquant_mla_backend(tqm, cuda_platform, major):
    """The CUDA platform's own selection (priorities, then each backend's validate_configuration): for a turboquant_*
    cache only TURBOQUANT_MLA is valid, and it is valid for no dtype of vLLM's own."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    CudaPlatformBase = cuda_platform.CudaPlatformBase
    cap = DeviceCapability(major, 0)
    for name in (FMT, "turboquant_4bit_nc"):
        valid, _ = CudaPlatformBase.get_valid_backends(cap, _selector(name), num_heads=16)
        assert [c.backend for c in valid] == [AttentionBackendEnum.TURBOQUANT_MLA]
        assert valid[0].backend_class is tqm.TQMLABackend
    for name in ("auto", "fp8"):
        valid, invalid = CudaPlatformBase.get_valid_backends(cap, _selector(name), num_heads=16)
        assert AttentionBackendEnum.TURBOQUANT_MLA not in [c.backend for c in valid]
        assert "kv_cache_dtype not supported" in invalid[AttentionBackendEnum.TURBOQUANT_MLA][1]
    # sparse (indexer) MLA: refused with a reason rather than served wrongly
    _, invalid = CudaPlatformBase.get_valid_backends(cap, _selector(FMT, use_sparse=True), num_heads=16)
    assert "sparse not supported" in invalid[AttentionBackendEnum.TURBOQUANT_MLA][1]


def test_spec_prices_a_page_as_the_turboquant_mla_layout(tqm):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, is_tq_attention_spec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from turboquant_core.vllm.spec import TQMLAAttentionSpec

    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=64))
    for name in KV_FORMATS:
        layer = SimpleNamespace(kv_cache_dtype=name, kv_lora_rank=LR, qk_rope_head_dim=R, head_size=LR + R)
        # the patched MLAAttention.get_kv_cache_spec hands turboquant_* layers to the backend's spec
        spec = MLAAttention.get_kv_cache_spec(layer, config)
        assert isinstance(spec, TQMLAAttentionSpec) and isinstance(spec, MLAAttentionSpec)
        assert spec.page_size_bytes == 64 * mla_format(name).bytes_per_token()
        assert spec.page_size_bytes == mla_paged_layout(name, 64).page_bytes
        assert is_tq_attention_spec(spec) and spec.dtype == torch.uint8
        merged = TQMLAAttentionSpec.merge([spec, spec])
        assert merged.page_size_bytes == spec.page_size_bytes and merged.tq_kv_lora_rank == LR
    # k3v4: 192 B of 3-bit latent + 128 B of bf16 k_pe + 2 B scale = 322 B, 3.58x bf16's 1152 B
    assert MLAAttention.get_kv_cache_spec(
        SimpleNamespace(kv_cache_dtype=FMT, kv_lora_rank=LR, qk_rope_head_dim=R, head_size=LR + R), config
    ).page_size_bytes == 64 * 322
    # a MiniCPM3-shaped latent (256 + 32) is priced by its own split, not DeepSeek's
    small = MLAAttention.get_kv_cache_spec(
        SimpleNamespace(kv_cache_dtype=FMT, kv_lora_rank=256, qk_rope_head_dim=32, head_size=288), config)
    assert small.page_size_bytes == mla_paged_layout(FMT, 64, 256, 32).page_bytes
    assert tqm.TQMLABackend.get_kv_cache_shape(3, 64, 1, 288, FMT) == (3, small.page_size_bytes // 1)
    assert KVCacheSpecRegistry.get_manager_class(spec).__name__ == "FullAttentionManager"


def test_cache_shape_and_bad_input(tqm):
    B = tqm.TQMLABackend
    assert B.get_kv_cache_shape(NUM_BLOCKS, BS, 1, LR + R, FMT) == (NUM_BLOCKS, BS * 322)
    assert B.get_kv_cache_stride_order() == (0, 1)
    with pytest.raises(ValueError, match="turboquant_\\* KV-cache dtypes only.*valid: turboquant"):
        B.get_kv_cache_shape(NUM_BLOCKS, BS, 1, LR + R, "fp8")
    with pytest.raises(ValueError, match="multiple of 16"):
        B.get_kv_cache_shape(NUM_BLOCKS, 5, 1, LR + R, FMT)
    with pytest.raises(ValueError, match="no TurboQuant MLA layer with head size 1000"):
        B.get_kv_cache_shape(NUM_BLOCKS, BS, 1, 1000, FMT)
    assert B.get_name() == "TURBOQUANT_MLA" and B.is_mla() and B.supports_kv_cache_dtype(FMT)
    assert not B.supports_kv_cache_dtype("auto") and not B.supports_kv_cache_dtype(None)


class _Linear(torch.nn.Module):
    """kv_b_proj as vLLM's ColumnParallelLinear returns it: (output, bias)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T, None


def _impl(tqm, monkeypatch, **tq_options):
    from vllm.config import VllmConfig, set_current_vllm_config

    from turboquant_core.config import TQConfig

    g = torch.Generator().manual_seed(5)
    kv_b = _Linear(torch.randn(HEADS * (NOPE + V), LR, generator=g, dtype=torch.float32) / LR ** 0.5)
    config = VllmConfig()
    config.cache_config.turboquant = TQConfig(**tq_options)
    with set_current_vllm_config(config):
        return tqm.TQMLAImpl(
            HEADS, LR + R, (NOPE + R) ** -0.5, 1, None, None, FMT, None, "decoder", None,
            q_lora_rank=None, kv_lora_rank=LR, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, qk_head_dim=NOPE + R,
            v_head_dim=V, kv_b_proj=kv_b,
        )


def _requests(impl, seq_lens, seed=7):
    """Latents of requests with ``seq_lens`` tokens stored through the impl (vLLM's call: k_pe [T, 1, R], a slot
    mapping with a padding row), pages shuffled; -> cache, block table, kv_c, k_pe."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(NUM_BLOCKS, BS * 322, dtype=torch.uint8)
    pages = torch.randperm(NUM_BLOCKS - 1, generator=g)[: sum(-(-n // BS) for n in seq_lens)] + 1
    bt = torch.zeros(len(seq_lens), NUM_BLOCKS, dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(seq_lens):
        k = -(-n // BS)
        bt[r, :k] = pages[used: used + k]
        used += k
        t = torch.arange(n)
        slots.append(bt[r].long()[t // BS] * BS + t % BS)
    slots = torch.cat(slots + [torch.tensor([-1])])
    total = sum(seq_lens)
    kv_c = torch.nn.functional.rms_norm(torch.randn(total + 1, LR, generator=g), (LR,)).to(torch.bfloat16)
    k_pe = torch.randn(total + 1, 1, R, generator=g).to(torch.bfloat16)
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, FMT, torch.ones(()))
    return cache, bt, kv_c[:total], k_pe[:total, 0]


def test_impl_stores_and_decodes_from_the_compressed_pages(tqm, monkeypatch):
    """do_kv_cache_update then forward_mqa with vLLM's inputs (the absorbed query as a transposed bmm output, q_pe
    a split view) against the reference on the same pages; the padding row is not stored."""
    impl = _impl(tqm, monkeypatch)
    seq_lens = [37, 5, 20]
    cache, bt, kv_c, k_pe = _requests(impl, seq_lens)
    lay = impl.layout_for(cache)
    assert lay.block_size == BS and lay.fmt.name == FMT
    g = torch.Generator().manual_seed(8)
    ql_nope = torch.randn(HEADS, len(seq_lens), LR, generator=g).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(len(seq_lens), HEADS, NOPE + R, generator=g).to(torch.bfloat16)[..., NOPE:]
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    decode = tqm.TQMLADecodeMetadata(block_table=bt, seq_lens=sl, dcp_tot_seq_lens=None, num_splits=2)
    md = SimpleNamespace(decode=decode, max_seq_len=max(seq_lens))
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache, md, None)
    ref, ref_lse = mla_decode_attention_ref(ql_nope.float(), q_pe.float(), cache, lay, bt, sl, impl.scale)
    assert out.dtype == torch.bfloat16 and out.shape == (len(seq_lens), HEADS, LR)
    rel = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 1e-2, float(rel.max())
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-2)
    # one concatenated query tensor (vLLM's fp8-query layout) is split the same way
    out2, _ = impl.forward_mqa(torch.cat([ql_nope, q_pe], dim=-1), cache, md, None)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # the stored entries decode back near the latents (3-bit), and nothing but the used pages was written
    dense = mla_gather_dequant_ref(cache, lay, bt, torch.tensor([0, 37, 42, 62]),
                                   torch.repeat_interleave(torch.arange(3), torch.tensor(seq_lens)), 62)
    rel_kv = (dense[:, :LR] - kv_c.float()).norm(dim=-1) / kv_c.float().norm(dim=-1)
    assert rel_kv.max() < 0.3 and torch.equal(dense[:, LR:], k_pe.float())
    untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    untouched[bt[bt > 0].long()] = False
    assert not cache[untouched].any()


def _merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None, **_):
    """Two attention parts merged by their log-sum-exp (lse [H, T], outputs [T, H, D])."""
    m = torch.maximum(prefix_lse, suffix_lse)
    wp, ws = torch.exp(prefix_lse - m), torch.exp(suffix_lse - m)
    total = wp + ws
    merged = (prefix_output.double() * (wp / total).T[..., None] + suffix_output.double() * (ws / total).T[..., None])
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(m + torch.log(total))


def test_prefill_context_goes_through_vllm_mla_prefill_with_our_gather(tqm, monkeypatch):
    """vLLM's MLACommonImpl._compute_prefill_context (patched to call _gather_context_chunk) with our gather, in two
    context chunks, against attention in float64 over the same decoded context: the prefill backend here computes
    exactly what vLLM's FlashAttention call does (non-causal over the chunk, with log-sum-exp)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata

    impl = _impl(tqm, monkeypatch)
    ctx = [30, 18]  # cached context of two prefill requests
    cache, bt, _, _ = _requests(impl, ctx, seed=11)
    lay = impl.layout_for(cache)
    q_lens = [3, 2]
    g = torch.Generator().manual_seed(12)
    q = torch.randn(sum(q_lens), HEADS, NOPE + R, generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    # two chunks of at most 20 context tokens per request: [0, 20) and [20, 30) / [0, 18) and nothing
    starts = [torch.tensor([0, 0], dtype=torch.int32), torch.tensor([20, 18], dtype=torch.int32)]
    lens = [[20, 18], [10, 0]]
    cu = [torch.tensor([0, 20, 38], dtype=torch.int32), torch.tensor([0, 10, 10], dtype=torch.int32)]
    tok = [torch.repeat_interleave(torch.arange(2, dtype=torch.int32), torch.tensor(n)) for n in lens]
    workspace = torch.full((64, LR + R), float("nan"), dtype=torch.bfloat16)
    chunked = MLACommonPrefillMetadata.ChunkedContextMetadata(
        cu_seq_lens=cu, starts=starts, seq_tot=[38, 10], max_seq_lens=[20, 10],
        seq_lens=torch.tensor(lens, dtype=torch.int32), workspace=workspace, token_to_seq=tok,
        chunk_total_token=torch.stack(cu)[:, -1], has_empty_context=[False, True])  # (vLLM's: a CPU tensor)

    def run_chunk(chunk_idx, q, k, v):
        """Non-causal attention of each request's queries over its chunk rows, float64 -> ([T, H, V], lse [H, T])."""
        out = torch.zeros(q.shape[0], HEADS, V, dtype=torch.float64)
        lse = torch.full((HEADS, q.shape[0]), float("-inf"), dtype=torch.float64)
        c = cu[chunk_idx]
        for r in range(2):
            qs = q[qsl[r]: qsl[r + 1]].double()
            ks, vs = k[c[r]: c[r + 1]].double(), v[c[r]: c[r + 1]].double()
            if ks.shape[0] == 0:
                continue
            s = torch.einsum("thd,shd->hts", qs, ks) * impl.scale
            lse[:, qsl[r]: qsl[r + 1]] = torch.logsumexp(s, -1)
            out[qsl[r]: qsl[r + 1]] = torch.einsum("hts,shd->thd", torch.softmax(s, -1), vs)
        return out.to(q.dtype), lse.float()

    prefill = MLACommonPrefillMetadata(block_table=bt, query_start_loc=qsl, max_query_len=3, chunked_context=chunked,
                                       q_data_type=torch.bfloat16,
                                       prefill_backend=SimpleNamespace(run_prefill_context_chunk=run_chunk))
    md = SimpleNamespace(prefill=prefill, num_prefills=2)
    # (vLLM's Triton helpers between the chunks, as plain torch: empty rows already carry lse -inf and out 0 here)
    monkeypatch.setattr("vllm.model_executor.layers.attention.mla_attention.mask_empty_context",
                        lambda lse, out, *a: None)
    monkeypatch.setattr("vllm.model_executor.layers.attention.mla_attention.merge_attn_states", _merge)
    out, lse = impl._compute_prefill_context(q, cache, md, torch.ones(()))
    # reference: every request's whole context, decoded by the reference gather, in one float64 softmax
    dense = mla_gather_dequant_ref(cache, lay, bt, torch.tensor([0, 30, 48]),
                                   torch.repeat_interleave(torch.arange(2), torch.tensor(ctx)), 48).double()
    kv = dense[:, :LR] @ impl.kv_b_proj.weight.double().T
    kv = kv.view(-1, HEADS, NOPE + V)
    k = torch.cat([kv[..., :NOPE], dense[:, None, LR:].expand(-1, HEADS, R)], -1)
    v = kv[..., NOPE:]
    for r, (a, b) in enumerate(((0, 30), (30, 48))):
        qs = q[qsl[r]: qsl[r + 1]].double()
        s = torch.einsum("thd,shd->hts", qs, k[a:b]) * impl.scale
        want = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v[a:b])
        got = out[qsl[r]: qsl[r + 1]].double()
        assert ((got - want).norm() / want.norm()) < 2e-2
        torch.testing.assert_close(lse[:, qsl[r]: qsl[r + 1]].double(), torch.logsumexp(s, -1), rtol=0, atol=2e-2)
    # rows past the chunk's tokens are not written
    assert torch.isnan(workspace[38:].float()).all()


@pytest.mark.parametrize("option,match", [({"boundary_layers": 2}, "tq-boundary-layers 2"),
                                          ({"prefill_from_cache": True}, "tq-prefill-from-cache")])
def test_options_mla_layers_cannot_honour_are_refused(tqm, monkeypatch, option, match):
    with pytest.raises(NotImplementedError, match=match):
        _impl(tqm, monkeypatch, **option)


def test_unsupported_mla_variants_are_refused(tqm):
    with pytest.raises(ValueError, match="turboquant_\\* KV-cache dtypes only"):
        tqm.TQMLAImpl(HEADS, LR + R, 0.1, 1, None, None, "auto", None, "decoder", None)
    with pytest.raises(NotImplementedError, match="sparse"):
        tqm.TQMLAImpl(HEADS, LR + R, 0.1, 1, None, None, FMT, None, "decoder", None, indexer=object())


def _mla_layer(tqm, monkeypatch, act_dtype=torch.float32):
    """vLLM's own MLAAttention with our backend, its absorbed weights made by its process_weights_after_loading. The
    MLA prefill backend (FlashAttention, not importable without CUDA) is left out: decode steps never call it."""
    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    from vllm.config import VllmConfig, set_current_vllm_config

    class _NoPrefillBackend:
        def __init__(self, **_):
            pass

    monkeypatch.setattr(mla_attention, "get_mla_prefill_backend", lambda config: _NoPrefillBackend)
    g = torch.Generator().manual_seed(21)
    kv_b = _Linear(torch.randn(HEADS * (NOPE + V), LR, generator=g) / LR ** 0.5)
    kv_b.quant_method = None
    config = VllmConfig()
    config.cache_config.cache_dtype = FMT
    with set_current_vllm_config(config):
        layer = mla_attention.MLAAttention(
            num_heads=HEADS, scale=(NOPE + R) ** -0.5, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, v_head_dim=V,
            q_lora_rank=None, kv_lora_rank=LR, kv_b_proj=kv_b, cache_config=config.cache_config,
            prefix="model.layers.0.self_attn.attn", attn_backend=tqm.TQMLABackend)
    kv_b_before = kv_b.weight.detach().clone()
    layer.process_weights_after_loading(act_dtype)
    # the rotation went into the decode weights only: prefill still reads kv_b_proj as loaded
    assert layer.impl.rotation_folded and torch.equal(kv_b.weight, kv_b_before)
    layer.impl.dcp_world_size = 1
    return layer


def _decode_through_layer(layer, cache, decode, q, query_start_loc, max_seq_len):
    """One decode step of q [tokens, HEADS, NOPE + R] (query_start_loc: each request's tokens) through
    MLAAttention.forward_impl with our decode metadata -> out [tokens, HEADS * V]."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata

    t, b = q.shape[0], query_start_loc.numel() - 1
    md = MLACommonMetadata(num_reqs=b, max_query_len=int((query_start_loc[1:] - query_start_loc[:-1]).max()),
                           max_seq_len=max_seq_len, num_actual_tokens=t, query_start_loc=query_start_loc,
                           slot_mapping=torch.full((t,), -1, dtype=torch.int64), num_decodes=b, num_decode_tokens=t,
                           num_prefills=0, decode=decode)
    out = torch.full((t, HEADS * V), float("nan"))
    layer.forward_impl(q, torch.zeros(t, LR), torch.zeros(t, 1, R), cache, md, output=out)
    return out


def _mla_attention_ref(layer, cache, lay, block_row, seen, q):
    """MLA attention written out in float64 over the first ``seen`` latents of a request (its block table row):
    keys [kv_c W_UK | k_pe], values kv_c W_UV, per head -> [HEADS * V]."""
    w = layer.kv_b_proj.weight.double().view(HEADS, NOPE + V, LR)
    rows = mla_gather_dequant_ref(cache, lay, block_row, torch.tensor([0, seen]), torch.zeros(seen, dtype=torch.long),
                                  seen).double()
    kv_c, k_pe = rows[:, :LR], rows[:, LR:]
    k = torch.cat([torch.einsum("hpl,tl->htp", w[:, :NOPE], kv_c), k_pe.expand(HEADS, -1, -1)], -1)
    v = torch.einsum("hvl,tl->htv", w[:, NOPE:], kv_c)
    s = torch.einsum("hd,htd->ht", q.double(), k) * layer.impl.scale
    return torch.einsum("ht,htv->hv", torch.softmax(s, -1), v).reshape(-1)


def test_decode_step_through_vllm_mla_layer_is_mla_attention_on_the_stored_latents(tqm, monkeypatch):
    """One decode step through MLAAttention.forward_impl (vLLM's absorbed query W_UK_T, our forward_mqa, vLLM's W_UV)
    against MLA attention written out in float64 over the latents the cache holds: keys [kv_c W_UK | k_pe], values
    kv_c W_UV, per head."""
    layer = _mla_layer(tqm, monkeypatch)
    impl = layer.impl
    seq_lens = [37, 5, 20]
    cache, bt, _, _ = _requests(impl, seq_lens, seed=22)
    lay = impl.layout_for(cache)
    g = torch.Generator().manual_seed(23)
    b = len(seq_lens)
    q = torch.randn(b, HEADS, NOPE + R, generator=g)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    decode = tqm.TQMLADecodeMetadata(block_table=bt, seq_lens=sl, dcp_tot_seq_lens=None, num_splits=2)
    out = _decode_through_layer(layer, cache, decode, q, torch.arange(b + 1, dtype=torch.int32), max(seq_lens))
    for r, n in enumerate(seq_lens):
        want = _mla_attention_ref(layer, cache, lay, bt[r: r + 1], n, q[r])
        rel = (out[r].double() - want).norm() / want.norm()
        assert rel < 1e-2, (r, float(rel))


def test_decode_of_several_query_tokens_through_vllm_mla_layer_is_causal(tqm, monkeypatch):
    """A decode batch whose requests have 1, 3 and 2 query tokens (vLLM sends requests of up to the builder's
    reorder_batch_threshold query tokens as decodes): the builder makes one row per token, and each token's output
    through MLAAttention.forward_impl is MLA attention, in float64, over its request's stored latents up to its own
    position."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

    from turboquant_core.ops.mla import MLA_DECODE_MAX_QUERY_LEN

    assert tqm.TQMLAMetadataBuilder.query_len_support is QueryLenSupport.VARLEN
    assert tqm.TQMLAMetadataBuilder.reorder_batch_threshold == MLA_DECODE_MAX_QUERY_LEN
    layer = _mla_layer(tqm, monkeypatch)
    impl = layer.impl
    seq_lens, q_lens = [37, 5, 20], [1, 3, 2]
    cache, bt, _, _ = _requests(impl, seq_lens, seed=24)
    lay = impl.layout_for(cache)
    b, t = len(seq_lens), sum(q_lens)
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    builder = object.__new__(tqm.TQMLAMetadataBuilder)  # the attributes _build_decode reads
    builder._decode_max_seq_len, builder.num_heads, builder.device, builder.layout = None, HEADS, sl.device, lay
    builder.decode_kernel = "triton"
    decode = builder._build_decode(block_table_tensor=bt, seq_lens_device=sl, max_seq_len=max(seq_lens),
                                   query_start_loc_cpu=qsl, query_start_loc_device=qsl, num_decode_tokens=t,
                                   dcp_tot_seq_lens_device=None)
    assert decode.seq_lens.tolist() == [37, 3, 4, 5, 19, 20] and decode.block_table.shape[0] == t
    # a batch of one token per request keeps vLLM's tensors (the persistent buffers CUDA graphs replay)
    one = builder._build_decode(block_table_tensor=bt, seq_lens_device=sl, max_seq_len=max(seq_lens),
                                query_start_loc_cpu=torch.arange(b + 1, dtype=torch.int32),
                                query_start_loc_device=torch.arange(b + 1, dtype=torch.int32), num_decode_tokens=b,
                                dcp_tot_seq_lens_device=None)
    assert one.block_table is bt and one.seq_lens is sl
    g = torch.Generator().manual_seed(25)
    q = torch.randn(t, HEADS, NOPE + R, generator=g)
    out = _decode_through_layer(layer, cache, decode, q, qsl, max(seq_lens))
    token = 0
    for r, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        for j in range(ql):
            want = _mla_attention_ref(layer, cache, lay, bt[r: r + 1], n - ql + j + 1, q[token])
            rel = (out[token].double() - want).norm() / want.norm()
            assert rel < 1e-2, (r, j, float(rel))
            token += 1


def test_mla_models_with_other_caches_warm_vllms_context_mask(tqm, monkeypatch):
    """Patch 0007 calls ``warmup_mla_context_mask`` for MLA models whose cache is not a turboquant one: it launches
    vLLM's context mask (every variant ``CONTEXT_MASK_SHAPES`` names) for the head count of the model's MLA layers,
    and nothing for a model without them. (That the launches leave no variant to compile is the GPU test's:
    ``test_jit_while_serving_gpu.py``, the MLA model with a bf16 cache.)"""
    import types

    from turboquant_core.vllm import warmup

    seen = []

    def mask(lse, output, query_start_loc, context_start_loc):  # vLLM's Triton is a placeholder without CUDA
        seen.append((lse.shape[0], lse.shape[1], query_start_loc.numel() - 1))

    monkeypatch.setattr(tqm, "mask_empty_context", mask)
    layer = _mla_layer(tqm, monkeypatch)

    def runner(ctx):
        return types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=ctx),
                                     device=torch.device("cpu"))

    assert warmup.warmup_mla_context_mask(runner({"model.layers.0.self_attn.attn": layer})) == 4
    assert seen == [(HEADS, t, r) for t, r in tqm.CONTEXT_MASK_SHAPES]
    seen.clear()
    assert warmup.warmup_mla_context_mask(runner({"model.layers.0.mlp": torch.nn.Linear(2, 2)})) == 0 and not seen

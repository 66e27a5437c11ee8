# SPDX-License-Identifier: Apache-2.0
"""TurboQuantCache on tiny randomly initialised Llama, Qwen2, Qwen3 and Gemma 3 models (CPU, seconds)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicLayer  # noqa: E402

from turboquant_core.formats import get_format  # noqa: E402
from turboquant_core.integrations.transformers_cache import (  # noqa: E402
    TurboQuantCache,
    TurboQuantLayer,
    TurboQuantSlidingWindowLayer,
    cache_kwargs,
)
from turboquant_core.ops.codec import decode_ref  # noqa: E402
from turboquant_core.quantizer import FP8Quantizer, MSEQuantizer  # noqa: E402

HEAD_DIM = 64
VOCAB = 97
SLIDING_WINDOW = 6
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
              head_dim=HEAD_DIM, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _llama():
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **COMMON))


def _qwen2():
    cfg = dict(COMMON, num_key_value_heads=2)
    cfg.pop("head_dim")  # Qwen2 derives head_dim = hidden_size / heads = 32 -> use 128 / 2 = 64
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **dict(cfg, hidden_size=128)))


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **COMMON))


def _gemma3():
    # Sliding layers with a window smaller than the prompt, plus one global layer.
    cfg = Gemma3TextConfig(num_hidden_layers=3, sliding_window=SLIDING_WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"], **COMMON)
    return Gemma3ForCausalLM(cfg)


MODELS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(1234)
    m = MODELS[request.param]().eval()
    # Larger weights than the default init: attention logits that are not flat, so K errors show.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return m


def _prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=g)


def _expected_bytes(model, cache, tokens, preset):
    cfg = model.config
    per_token = cfg.num_key_value_heads * get_format(preset).bytes_per_token_per_head(HEAD_DIM)
    total = 0
    for layer in cache.layers:
        stored = min(tokens, layer.sliding_window - 1) if layer.is_sliding else tokens
        total += stored * per_token
    return total


@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "turboquant_k8v4", "turboquant_2p5bit_nc"])
def test_generate_stores_exact_compressed_bytes(model, preset):
    prompt_len, new = 9, 10
    cache = TurboQuantCache(model.config, preset=preset)
    out = model.generate(_prompt(prompt_len), **cache_kwargs(model, cache), max_new_tokens=new, do_sample=False)
    assert out.shape == (1, prompt_len + new)
    tokens = prompt_len + new - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == tokens
    assert cache.memory_bytes() == _expected_bytes(model, cache, tokens, preset)
    assert cache.memory_breakdown()["full_precision"] == 0
    for layer, stored in zip(cache.layers, cache.stored_tokens()):
        assert isinstance(layer, TurboQuantSlidingWindowLayer if layer.is_sliding else TurboQuantLayer)
        assert layer.store.key_codes.dtype == torch.uint8 and layer.store.value_codes.dtype == torch.uint8
        if layer.is_sliding:
            assert stored == SLIDING_WINDOW - 1 < tokens
        else:
            assert stored == tokens


def _logit_error(model, ids, preset):
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        # Decode mode: every position attends to quantized K/V, its own included (the quantizer's full effect).
        got = model(ids, **cache_kwargs(model, TurboQuantCache(model.config, preset=preset,
                                                         fresh_full_precision=False))).logits
    return float((got - ref).norm() / ref.norm())


def test_logits_close_to_dynamic_cache_and_ordered_by_bits(model):
    ids = _prompt(20, seed=1)
    err4 = _logit_error(model, ids, "turboquant_4bit_nc")
    err3 = _logit_error(model, ids, "turboquant_3bit_nc")
    err2 = _logit_error(model, ids, "turboquant_2bit_nc")
    # Relative logit error: tiny random models with sharp attention amplify K/V error, hence loose bounds;
    # the ordering by bits is the point.
    assert 0 < err4 < err3 < err2
    assert err4 < 0.3 and err4 < 0.6 * err2
    assert err2 < 0.8


def test_incremental_decode_matches_one_forward(model):
    """Prefill + token-by-token steps through the compressed history == one forward over everything."""
    ids = _prompt(16, seed=2)
    preset = "turboquant_k3v4_nc"
    with torch.no_grad():
        full = model(ids, **cache_kwargs(model, TurboQuantCache(model.config, preset=preset,
                                                          fresh_full_precision=False))).logits
        cache = TurboQuantCache(model.config, preset=preset, fresh_full_precision=False)
        step = [model(ids[:, :7], **cache_kwargs(model, cache)).logits]
        for t in range(7, ids.shape[1]):
            step.append(model(ids[:, t : t + 1], **cache_kwargs(model, cache)).logits)
    torch.testing.assert_close(torch.cat(step, dim=1), full, rtol=1e-4, atol=1e-4)


def test_update_returns_dequantized_storage():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 5, HEAD_DIM) * 4, torch.randn(2, 3, 5, HEAD_DIM)
    for preset in ("turboquant_k3v4_nc", "turboquant_k8v4"):
        f = get_format(preset)
        layer = TurboQuantLayer(f, HEAD_DIM, fresh_full_precision=False)
        k_out, v_out = layer.update(keys, values)
        k_ref = (FP8Quantizer(HEAD_DIM, f.key_seed) if f.key.is_fp8
                 else MSEQuantizer(HEAD_DIM, f.key.bits, True, f.key_seed))
        k_expected = k_ref.dequantize(k_ref.quantize(keys))
        torch.testing.assert_close(k_out, k_expected, rtol=1e-5, atol=1e-5)
        v_q = MSEQuantizer(HEAD_DIM, f.value.bits, True, f.value_seed)
        torch.testing.assert_close(v_out, v_q.dequantize(v_q.quantize(values)), rtol=1e-5, atol=1e-5)
        # What is returned is what the stored bytes decode to, and not the input.
        s = layer.store
        v_dec = decode_ref(s.value_codes, s.value_scales, HEAD_DIM, f.value.bits, f.value_seed)
        torch.testing.assert_close(v_out, v_dec)
        assert not torch.allclose(k_out, keys, atol=1e-3)
        assert s.key_codes.shape == (2, 3, 5, f.key.index_bytes(HEAD_DIM))
        assert (s.key_scales is None) == (not f.key.stores_scale)


def test_residual_tokens_stay_full_precision():
    torch.manual_seed(0)
    f = get_format("turboquant_4bit_nc")
    layer = TurboQuantLayer(f, HEAD_DIM, residual_tokens=4)
    steps = [torch.randn(1, 2, n, HEAD_DIM) for n in (3, 5, 1)]
    for k in steps:
        k_out, _ = layer.update(k, -k)
    history = torch.cat(steps, dim=2)
    assert layer.store.recent_tokens == 4 and layer.store.compressed_tokens == 5
    torch.testing.assert_close(k_out[:, :, -4:], history[:, :, -4:], rtol=0, atol=0)
    assert not torch.allclose(k_out[:, :, :5], history[:, :, :5], atol=1e-3)
    assert layer.compressed_nbytes() == 5 * 2 * f.bytes_per_token_per_head(HEAD_DIM)
    assert layer.full_precision_nbytes() == 2 * 4 * 2 * HEAD_DIM * 4  # K and V, fp32


def test_skip_layers_and_crop():
    torch.manual_seed(0)
    m = _llama().eval()
    cache = TurboQuantCache(m.config, preset="turboquant_4bit_nc", skip_layers=[-1])
    assert type(cache.layers[1]) is DynamicLayer and isinstance(cache.layers[0], TurboQuantLayer)
    with torch.no_grad():
        m(_prompt(10), **cache_kwargs(m, cache))
    fp_bytes = 10 * 1 * HEAD_DIM * 4 * 2
    assert cache.memory_breakdown() == {
        "compressed": 10 * get_format("turboquant_4bit_nc").bytes_per_token_per_head(HEAD_DIM),
        "full_precision": fp_bytes,
        "total": 10 * get_format("turboquant_4bit_nc").bytes_per_token_per_head(HEAD_DIM) + fp_bytes,
    }
    cache.crop(-3)
    assert cache.stored_tokens() == [7, 7] and cache.get_seq_length() == 7


def test_batched_generate_with_sliding_window():
    torch.manual_seed(0)
    m = _gemma3().eval()
    ids = torch.cat([_prompt(8, seed=3), _prompt(8, seed=4)])
    cache = TurboQuantCache(m.config, preset="turboquant_3bit_nc")
    out = m.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(m, cache), max_new_tokens=6,
                     do_sample=False)
    assert out.shape == (2, 14)
    assert cache.stored_tokens() == [SLIDING_WINDOW - 1, SLIDING_WINDOW - 1, 13]
    assert cache.memory_bytes() == 2 * (2 * (SLIDING_WINDOW - 1) + 13) * get_format(
        "turboquant_3bit_nc").bytes_per_token_per_head(HEAD_DIM)


def test_layer_kwargs_per_layer_from_either_transformers_api(monkeypatch):
    # Up to transformers 5.17 get_layer_types_and_kwargs returns one kwargs dict for all layers; later releases
    # return a list with one dict per layer. The installed release exercises one shape; this pins the other.
    from turboquant_core.integrations import transformers_cache as tc

    cfg = _gemma3().config
    types, kwargs = tc.get_layer_types_and_kwargs(cfg)
    shared = kwargs if isinstance(kwargs, dict) else kwargs[0]
    per_layer = [dict(shared) if t == "sliding_attention" else {} for t in types]
    for returned in (shared, per_layer):
        monkeypatch.setattr(tc, "get_layer_types_and_kwargs", lambda _cfg, r=returned: (types, r))
        cache = TurboQuantCache(cfg, preset="turboquant_4bit_nc")
        assert [layer.is_sliding for layer in cache.layers] == [True, True, False]
        assert [getattr(layer, "sliding_window", None) for layer in cache.layers[:2]] == [SLIDING_WINDOW] * 2
    monkeypatch.setattr(tc, "get_layer_types_and_kwargs", lambda _cfg: (types, per_layer[:1]))
    with pytest.raises(ValueError, match="1 layer kwargs for 3 layer types"):
        TurboQuantCache(cfg)


def test_cache_path_uses_no_deprecated_transformers_argument():
    # cache_kwargs names the cache argument as the installed transformers wants it: generate and forward with
    # a TurboQuantCache raise no FutureWarning (the newest release in CI deprecates names before removing them).
    torch.manual_seed(0)
    m = _gemma3().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = TurboQuantCache(m.config, preset="turboquant_k3v4_nc")
        out = m.generate(_prompt(8), **cache_kwargs(m, cache), max_new_tokens=3, do_sample=False)
        m(out[:, -1:], **cache_kwargs(m, cache))
    assert cache.get_seq_length() == 8 + 3


def test_bad_inputs_raise_clear_errors():
    cfg = LlamaConfig(num_hidden_layers=1, **dict(COMMON, head_dim=48))
    with pytest.raises(ValueError, match="head_dim 48 is not supported.*64"):
        TurboQuantCache(cfg)
    with pytest.raises(ValueError, match="valid formats: .*turboquant_k3v4_nc"):
        TurboQuantCache(LlamaConfig(num_hidden_layers=1, **COMMON), preset="turboquant_9bit")
    with pytest.raises(ValueError, match="out of range"):
        TurboQuantCache(LlamaConfig(num_hidden_layers=2, **COMMON), skip_layers=[5])
    with pytest.raises(ValueError, match="residual_tokens"):
        TurboQuantCache(LlamaConfig(num_hidden_layers=1, **COMMON), residual_tokens=-1)


def test_without_config_layers_are_created_on_use():
    cache = TurboQuantCache(preset="turboquant_4bit_nc")
    k = torch.randn(1, 2, 3, HEAD_DIM)
    cache.update(k, k, layer_idx=1)
    assert len(cache.layers) == 2 and cache.stored_tokens() == [0, 3]
    with pytest.raises(ValueError, match="head_dim 40 is not supported"):
        cache.update(torch.randn(1, 2, 3, 40), torch.randn(1, 2, 3, 40), layer_idx=2)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "turboquant_k8v4", "turboquant_3p5bit_nc"])
def test_cuda_kernels_store_the_reference_bytes(preset):
    """On CUDA the cache encodes with the fused Triton kernels; the bytes match the CPU reference path."""
    torch.manual_seed(0)
    m = _gemma3().eval()
    ids = _prompt(24, seed=5)
    cpu_cache = TurboQuantCache(m.config, preset=preset)
    gpu_cache = TurboQuantCache(m.config, preset=preset)
    with torch.no_grad():
        cpu_logits = m(ids, **cache_kwargs(m, cpu_cache)).logits
        gpu_logits = m.cuda()(ids.cuda(), **cache_kwargs(m, gpu_cache)).logits.cpu()
    assert gpu_cache.memory_bytes() == cpu_cache.memory_bytes()
    for c, g in zip(cpu_cache.layers, gpu_cache.layers):
        for name in ("key_codes", "value_codes"):
            a, b = getattr(c.store, name), getattr(g.store, name).cpu()
            # Inputs differ by float rounding between devices: allow rare boundary flips.
            assert (a == b).float().mean() > 0.98, name
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("residual_tokens", [0, 3])
@pytest.mark.parametrize("preset", ["turboquant_k3v4_nc", "turboquant_k8v4"])
def test_fresh_full_precision_returns_decoded_history_then_inputs(preset, residual_tokens):
    """Prefill-faithful update: history as a decode-faithful cache returns it, then the new tokens bit-exact."""
    torch.manual_seed(0)
    f = get_format(preset)
    decode = TurboQuantLayer(f, HEAD_DIM, residual_tokens, fresh_full_precision=False)
    fresh = TurboQuantLayer(f, HEAD_DIM, residual_tokens)
    assert fresh.fresh_full_precision  # the default
    assert "fresh_full_precision=True" in repr(fresh) and "fresh" not in repr(decode)
    history_k = history_v = None  # what the decode-faithful layer returned on the previous call
    for n in (5, 4, 1, 2):
        k, v = torch.randn(1, 2, n, HEAD_DIM) * 4, torch.randn(1, 2, n, HEAD_DIM)
        k_out, v_out = fresh.update(k, v)
        if history_k is None:
            assert torch.equal(k_out, k) and torch.equal(v_out, v)  # first call: exactly the inputs
        else:
            assert k_out.shape[2] == history_k.shape[2] + n
            assert torch.equal(k_out[:, :, -n:], k) and torch.equal(v_out[:, :, -n:], v)
            assert torch.equal(k_out[:, :, :-n], history_k) and torch.equal(v_out[:, :, :-n], history_v)
        history_k, history_v = decode.update(k, v)
        if not residual_tokens:  # (with a full-precision tail, the newest tokens are returned as given)
            assert not torch.allclose(history_k[:, :, -n:], k, atol=1e-3)
        # The new tokens were stored just as without the flag.
        for name in ("key_codes", "value_codes", "recent_keys"):
            a, b = getattr(fresh.store, name), getattr(decode.store, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    assert fresh.store.recent_tokens == residual_tokens and fresh.get_seq_length() == 12


def test_fresh_full_precision_sliding_window_keeps_window_minus_one():
    torch.manual_seed(0)
    f = get_format("turboquant_4bit_nc")
    layer = TurboQuantSlidingWindowLayer(f, SLIDING_WINDOW, HEAD_DIM, fresh_full_precision=True)
    seen = 0
    for n in (4, 5, 1, 8, 2):
        before_k, before_v = layer.store.states(torch.float32) if layer.stored_tokens() else (None, None)
        k, v = torch.randn(1, 2, n, HEAD_DIM), torch.randn(1, 2, n, HEAD_DIM)
        k_out, v_out = layer.update(k, v)
        stored_before = min(seen, SLIDING_WINDOW - 1)
        assert k_out.shape[2] == v_out.shape[2] == stored_before + n
        assert torch.equal(k_out[:, :, stored_before:], k) and torch.equal(v_out[:, :, stored_before:], v)
        if before_k is not None:
            assert torch.equal(k_out[:, :, :stored_before], before_k)
            assert torch.equal(v_out[:, :, :stored_before], before_v)
        seen += n
        assert layer.stored_tokens() == min(seen, SLIDING_WINDOW - 1) and layer.get_seq_length() == seen


def _chunked_logits(model, ids, cache, chunk):
    with torch.no_grad():
        return torch.cat([model(ids[:, s : s + chunk], **cache_kwargs(model, cache)).logits
                          for s in range(0, ids.shape[1], chunk)], dim=1)


def test_chunked_prefill_with_fresh_full_precision(model):
    """Chunks attend to themselves in full precision: the first chunk is exact, later ones beat decode mode."""
    ids, chunk, preset = _prompt(20, seed=6), 7, "turboquant_2bit_nc"
    with torch.no_grad():
        ref = model(ids, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        decode = model(ids, **cache_kwargs(model, TurboQuantCache(model.config, preset=preset,
                                                            fresh_full_precision=False))).logits
    cache = TurboQuantCache(model.config, preset=preset, fresh_full_precision=True)
    assert "fresh_full_precision=True" in repr(cache)
    got = _chunked_logits(model, ids, cache, chunk)
    torch.testing.assert_close(got[:, :chunk], ref[:, :chunk], rtol=1e-5, atol=1e-5)
    err_fresh = float((got[:, chunk:] - ref[:, chunk:]).norm())
    err_decode = float((decode[:, chunk:] - ref[:, chunk:]).norm())
    assert 0 < err_fresh < err_decode
    assert cache.get_seq_length() == 20
    for layer, stored in zip(cache.layers, cache.stored_tokens()):
        assert stored == (SLIDING_WINDOW - 1 if layer.is_sliding else 20)
    # Everything kept in full precision: chunked prefill through the cache == one full-precision forward.
    everything = TurboQuantCache(model.config, preset=preset, residual_tokens=20, fresh_full_precision=True)
    torch.testing.assert_close(_chunked_logits(model, ids, everything, chunk), ref, rtol=1e-4, atol=1e-4)


def test_default_prefill_is_full_precision_then_decode_reads_compressed(model):
    """The default (as vLLM serving and transformers' QuantizedCache): a prompt attends to itself in full
    precision, so its logits equal DynamicCache's; the next step reads the prompt from the compressed store."""
    ids, preset = _prompt(18, seed=8), "turboquant_k3v4_nc"
    cache = TurboQuantCache(model.config, preset=preset)
    assert cache.fresh_full_precision
    with torch.no_grad():
        ref_cache = DynamicCache(config=model.config)
        ref = model(ids[:, :17], **cache_kwargs(model, ref_cache)).logits
        got = model(ids[:, :17], **cache_kwargs(model, cache)).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        ref_next = model(ids[:, 17:], **cache_kwargs(model, ref_cache)).logits
        got_next = model(ids[:, 17:], **cache_kwargs(model, cache)).logits
    assert float((got_next - ref_next).abs().max()) > 0  # compressed history
    for layer, stored in zip(cache.layers, cache.stored_tokens()):
        assert stored == (SLIDING_WINDOW - 1 if layer.is_sliding else 18)


# ----------------------------------------------------------------------------------------------
# key centering (the patched vLLM's default key encoding)
# ----------------------------------------------------------------------------------------------


def _rope_keys(n, heads, d, theta, g, shared=3.0):
    """Post-RoPE keys [1, H, n, d] (rotate-half) whose pre-RoPE form is a per-head constant + noise."""
    pre = torch.randn(heads, 1, d, generator=g, dtype=torch.float64) * shared
    pre = pre + torch.randn(heads, n, d, generator=g, dtype=torch.float64)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * theta[None, :]
    cos, sin = torch.cos(ang).repeat(1, 2), torch.sin(ang).repeat(1, 2)
    half = d // 2
    rot = torch.cat([-pre[..., half:], pre[..., :half]], dim=-1)
    return (pre * cos + rot * sin).float()[None]


def test_key_centering_stores_the_serving_bytes_in_any_chunking():
    """The cache's key bytes equal the paged store's (reference) with key centering, whether the 70 tokens
    arrive at once or in pieces, and the decoded keys come back closer to the truth than without centering."""
    from turboquant_core.integrations.transformers_cache import CompressedKVStore
    from turboquant_core.ops.key_centering import key_centering_tables
    from turboquant_core.ops.paged import paged_layout, read_cached_tokens, tq_store_ref

    preset, d, heads, n = "turboquant_k3v4_nc", 64, 2, 70
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cent = key_centering_tables(theta, d, 16, 1024)
    g = torch.Generator().manual_seed(0)
    keys = _rope_keys(n, heads, d, theta, g)
    values = torch.randn(1, heads, n, d, generator=g)
    fmt = get_format(preset)

    one = CompressedKVStore(fmt, d, centering=cent)
    one.append(keys, values)
    pieces = CompressedKVStore(fmt, d, centering=cent)
    for a, b in ((0, 9), (9, 30), (30, 31), (31, 70)):
        pieces.append(keys[:, :, a:b], values[:, :, a:b])
    assert torch.equal(one.key_codes, pieces.key_codes) and torch.equal(one.key_scales, pieces.key_scales)

    lay = paged_layout(preset, d, 16)
    cache = torch.zeros(5, heads, lay.head_page_bytes, dtype=torch.uint8)
    bt = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
    tq_store_ref(keys[0].transpose(0, 1), values[0].transpose(0, 1), cache, torch.arange(n), lay, centering=cent,
                 query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                 seq_lens=torch.tensor([n], dtype=torch.int32), block_table=bt)
    k_idx, k_scale, _, _ = read_cached_tokens(cache, lay, bt[0], n)
    assert torch.equal(one.key_codes[0].transpose(0, 1), k_idx)
    assert torch.equal(one.key_scales[0].transpose(0, 1), k_scale)

    plain = CompressedKVStore(fmt, d)
    plain.append(keys, values)
    err_c = (one.states(torch.float32)[0] - keys)[:, :, 16:].pow(2).sum()
    err_p = (plain.states(torch.float32)[0] - keys)[:, :, 16:].pow(2).sum()
    assert err_c < 0.5 * err_p


def test_key_centering_in_the_cache_on_a_model(model):
    """TurboQuantCache(key_centering=...) on every tiny model: generation runs, full-attention layers carry
    the centre and sliding layers do not, cropping into the first page resets it, fp8 keys ignore it."""
    from turboquant_core.integrations.transformers_cache import key_centering_for_model

    cent = key_centering_for_model(model)
    assert cent.head_dim == HEAD_DIM and cent.page == 16
    cache = TurboQuantCache(model.config, preset="turboquant_k3v4_nc", key_centering=cent)
    ids = _prompt(40)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    for layer in cache.layers:
        if isinstance(layer, TurboQuantSlidingWindowLayer):
            assert layer.store.centering is None
        else:
            assert layer.store.center is not None
    full = [layer for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
    for layer in full:  # (sliding layers past their window cannot crop at all)
        layer.crop(10)
    assert full and all(layer.store.center is None for layer in full)
    fp8 = TurboQuantCache(model.config, preset="turboquant_k8v4", key_centering=cent)
    assert fp8.key_centering is None

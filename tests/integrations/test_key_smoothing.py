# SPDX-License-Identifier: Apache-2.0
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turboquant_core.integrations.key_smoothing import (  # noqa: E402
    KeySmoothingUnsupported,
    apply_key_smoothing,
    apply_key_smoothing_fused,
    pair_rms,
    smooth_fused_layer,
    smoothing_scales,
    weight_scales,
)
from turboquant_core.quantizer import MSEQuantizer  # noqa: E402


def _tiny(kind: str, kv_heads: int = 2):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(attention_bias=True, **common)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common)
    else:
        cfg = transformers.Gemma3TextConfig(sliding_window=16, query_pre_attn_scalar=32, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # uneven per-channel gains, as trained models have
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 2.0)
            elif "bias" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_logits_unchanged_and_keys_rescaled(kind):
    model = _tiny(kind)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        keys_before = model(ids, use_cache=True).past_key_values.layers[0].keys.clone()
    layers = apply_key_smoothing(model)
    with torch.no_grad():
        after = model(ids).logits
        keys_after = model(ids, use_cache=True).past_key_values.layers[0].keys
    assert len(layers) == 2
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    s = layers[0].scales
    assert s.shape[-1] == 32 and torch.equal(s[..., :16], s[..., 16:])  # one scale per RoPE pair
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(s.shape[0]), atol=1e-5, rtol=0)  # geometric mean 1
    assert not torch.allclose(s, torch.ones_like(s))
    # the cache now holds k * s (per KV head, or shared when q/k norms carry the gains)
    torch.testing.assert_close(keys_after, keys_before * s[None, :, None, :].expand_as(keys_before)
                               if s.shape[0] > 1 else keys_before * s, rtol=1e-4, atol=1e-4)


def test_smoothing_lowers_the_logit_error_of_quantized_keys():
    # Keys strong where queries are weak: the case the scale is made for.
    g = torch.Generator().manual_seed(3)
    d, n = 64, 4096
    k_rms = torch.cat([torch.full((8,), 8.0), torch.ones(24)]).repeat(2)
    q_rms = torch.cat([torch.full((8,), 0.2), torch.ones(24)]).repeat(2)
    k = torch.randn(n, d, generator=g) * k_rms
    q = torch.randn(n, d, generator=g) * q_rms
    quant = MSEQuantizer(d, 4, True, 11)

    def logit_err(qq, kk):
        return ((qq * (quant.dequantize(quant.quantize(kk)) - kk)).sum(-1)).pow(2).mean()

    s = smoothing_scales(pair_rms(q).pow(2).mean(0, keepdim=True).sqrt(),
                         pair_rms(k).pow(2).mean(0, keepdim=True).sqrt())
    assert logit_err(q / s, k * s) < 0.5 * logit_err(q, k)


def test_bad_inputs():
    with pytest.raises(ValueError, match="must match"):
        smoothing_scales(torch.ones(2, 4), torch.ones(2, 8))
    with pytest.raises(ValueError, match="supports decoder models"):
        apply_key_smoothing(_NotADecoder())


class _NotADecoder(torch.nn.Module):
    """A module with a real transformers config but no decoder layers."""

    def __init__(self):
        super().__init__()
        self.config = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1)


# ----------------------------------------------------------------------------------------------
# The fused (vLLM-style) front-end. The classes below mirror the attributes vLLM 0.26's Llama /
# Qwen2 / Qwen3 / Gemma 3 decoder layers expose (vLLM itself is not needed): a fused qkv_proj of
# [q rows | k rows | v rows] per tensor-parallel rank, RMSNorm (x * w) or GemmaRMSNorm (x * (1 + w)),
# rotary_emb with is_neox_style / rotary_dim / head_size.
# ----------------------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    def __init__(self, weight, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.has_weight = True
        self.eps = eps

    def gain(self):
        return self.weight.float()

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain()


class GemmaRMSNorm(RMSNorm):  # vLLM's GemmaRMSNorm is not an RMSNorm subclass; the name is what counts
    def gain(self):
        return 1.0 + self.weight.float()


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_size, rotary_dim=None, is_neox_style=True):
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim or head_size
        self.is_neox_style = is_neox_style

    def forward(self, positions, x):  # x [T, H, d]; rotate-half pairs (i, i + d/2)
        h = self.head_size // 2
        inv = 1.0 / (10000 ** (torch.arange(h, dtype=torch.float32) / h))
        ang = positions.float()[:, None, None] * inv
        cos, sin = ang.cos(), ang.sin()
        a, b = x[..., :h], x[..., h:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class FusedAttention(torch.nn.Module):
    def __init__(self, qkv_weight, qkv_bias, n_q, n_kv, d, q_norm=None, k_norm=None, rope=None, total_kv=None):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(qkv_weight.shape[1], qkv_weight.shape[0], bias=qkv_bias is not None)
        with torch.no_grad():
            self.qkv_proj.weight.copy_(qkv_weight)
            if qkv_bias is not None:
                self.qkv_proj.bias.copy_(qkv_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = n_q, n_kv, d
        self.total_num_kv_heads = total_kv or n_kv
        self.q_size, self.kv_size = n_q * d, n_kv * d
        self.rotary_emb = rope if rope is not None else RotaryEmbedding(d)
        if q_norm is not None:
            self.q_norm, self.k_norm = q_norm, k_norm

    @torch.no_grad()
    def qk(self, x):
        """x [T, hidden] (normalized) -> q [T, n_q, d], k [T, n_kv, d] after q/k norm and RoPE."""
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].unflatten(-1, (self.num_heads, self.head_dim))
        k = qkv[:, self.q_size:self.q_size + self.kv_size].unflatten(-1, (self.num_kv_heads, self.head_dim))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        pos = torch.arange(x.shape[0])
        return self.rotary_emb(pos, q), self.rotary_emb(pos, k)


class FusedLayer(torch.nn.Module):
    def __init__(self, self_attn, input_layernorm):
        super().__init__()
        self.self_attn, self.input_layernorm = self_attn, input_layernorm

    def logits(self, hidden):
        q, k = self.self_attn.qk(self.input_layernorm(hidden))
        g = q.shape[1] // k.shape[1]
        return torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, dim=1)), k


class FusedModel(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(layers)


def _fused_from_hf(hf, tp_rank=0, tp_size=1):
    """A vLLM-style copy of the HF model's attention weights (rank ``tp_rank`` of ``tp_size``)."""
    cfg = hf.config.get_text_config(decoder=True)
    norm_cls = GemmaRMSNorm if cfg.model_type.startswith("gemma") else RMSNorm
    n_q, n_kv, d = cfg.num_attention_heads // tp_size, max(1, cfg.num_key_value_heads // tp_size), cfg.head_dim
    kv0 = (tp_rank * cfg.num_key_value_heads // tp_size) if cfg.num_key_value_heads >= tp_size else 0
    qs, ks = slice(tp_rank * n_q * d, (tp_rank + 1) * n_q * d), slice(kv0 * d, (kv0 + n_kv) * d)
    layers = []
    for hl in hf.model.layers:
        a = hl.self_attn
        w = torch.cat([a.q_proj.weight[qs], a.k_proj.weight[ks], a.v_proj.weight[ks]])
        b = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias[qs], a.k_proj.bias[ks], a.v_proj.bias[ks]])
        qn = kn = None
        if hasattr(a, "q_norm"):
            qn, kn = norm_cls(a.q_norm.weight), norm_cls(a.k_norm.weight)
        layers.append(FusedLayer(FusedAttention(w, b, n_q, n_kv, d, qn, kn, total_kv=cfg.num_key_value_heads),
                                 norm_cls(hl.input_layernorm.weight)))
    return FusedModel(layers)


KINDS = ["llama", "qwen3", "gemma3"]


@pytest.mark.parametrize("kind", KINDS)
def test_fused_front_end_matches_hf(kind):
    hf = _tiny(kind)
    fused = _fused_from_hf(hf)
    # rows: 4 query heads x 32 | 2 KV heads x 32 (k) | 2 x 32 (v)
    v_rows = [layer.self_attn.qkv_proj.weight[192:].clone() for layer in fused.model.layers]
    hf_layers = apply_key_smoothing(hf)
    fused_scales = [smooth_fused_layer(layer) for layer in fused.model.layers]
    for hl, fl, s_hf, s_f, v_before in zip(hf.model.layers, fused.model.layers, hf_layers, fused_scales, v_rows):
        torch.testing.assert_close(s_f, s_hf.scales, rtol=1e-6, atol=0)
        a, w = hl.self_attn, fl.self_attn.qkv_proj.weight
        # The same weights come out: q rows, k rows (and biases), or the q/k norm gains; v untouched.
        torch.testing.assert_close(w[:128], a.q_proj.weight, rtol=1e-6, atol=0)
        torch.testing.assert_close(w[128:192], a.k_proj.weight, rtol=1e-6, atol=0)
        assert torch.equal(w[192:], v_before)
        if a.q_proj.bias is not None:
            torch.testing.assert_close(fl.self_attn.qkv_proj.bias[:192], torch.cat([a.q_proj.bias, a.k_proj.bias]),
                                       rtol=1e-6, atol=0)
        if hasattr(a, "q_norm"):
            torch.testing.assert_close(fl.self_attn.q_norm.weight, a.q_norm.weight, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(fl.self_attn.k_norm.weight, a.k_norm.weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_logits_after_rope_unchanged_and_keys_rescaled(kind):
    fused = _fused_from_hf(_tiny(kind))
    hidden = torch.randn(20, 64, generator=torch.Generator().manual_seed(5))
    before = [layer.logits(hidden) for layer in fused.model.layers]
    summary = apply_key_smoothing_fused(fused)
    assert summary.smoothed == ["model.layers.0", "model.layers.1"] and summary.skipped == []
    assert summary.describe() == "2 of 2 decoder layers smoothed"
    for layer, (logits0, k0) in zip(fused.model.layers, before):
        logits1, k1 = layer.logits(hidden)
        torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5 * logits0.abs().max().item())
        rms0, rms1 = k0.pow(2).mean(0).sqrt(), k1.pow(2).mean(0).sqrt()  # per KV head and channel
        assert not torch.allclose(rms1, rms0, rtol=0.05)
        # one scale per RoPE pair: the pair rms of the keys changes by exactly s
        s = (pair_rms(k1) / pair_rms(k0)).mean(0)
        torch.testing.assert_close(pair_rms(k1), pair_rms(k0) * s, rtol=1e-4, atol=1e-6)


def test_fused_tensor_parallel_rank_uses_its_kv_heads():
    hf = _tiny("llama")  # 4 query heads, 2 KV heads: with 2 ranks, one KV head each
    ref = apply_key_smoothing(_tiny("llama"))
    for rank in range(2):
        fused = _fused_from_hf(hf, rank, 2)
        s = smooth_fused_layer(fused.model.layers[0])
        torch.testing.assert_close(s, ref[0].scales[rank:rank + 1], rtol=1e-6, atol=0)


def _tensor_parallel_rank(rank: int, size: int, init: str, kind: str, kv_heads: int) -> None:
    """One rank of a gloo group: smooth this rank's shard with the group, compare with one rank's result."""
    import torch.distributed as dist

    from turboquant_core.integrations.key_smoothing import TensorParallelHeads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        hf = _tiny(kind, kv_heads)
        whole, shard = _fused_from_hf(hf), _fused_from_hf(hf, rank, size)
        summary = apply_key_smoothing_fused(shard, tp=TensorParallelHeads(rank, size, dist.group.WORLD))
        assert summary.skipped == [], summary.skipped
        apply_key_smoothing_fused(whole)
        ref = _fused_from_hf(_WholeAsHF(whole, hf), rank, size)  # the one-rank result, cut as the rank's shard
        for got, want in zip(shard.model.layers, ref.model.layers):
            torch.testing.assert_close(got.self_attn.qkv_proj.weight, want.self_attn.qkv_proj.weight,
                                       rtol=1e-6, atol=0)
            if hasattr(want.self_attn, "q_norm"):
                torch.testing.assert_close(got.self_attn.q_norm.weight, want.self_attn.q_norm.weight,
                                           rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(got.self_attn.k_norm.weight, want.self_attn.k_norm.weight,
                                           rtol=1e-6, atol=1e-7)
        dist.barrier()  # both ranks done with the group before either tears it down
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where gloo's worker threads have aborted a rank ("terminate
    # called without an active exception") after its work was done. A failure above still reaches mp.spawn.
    os._exit(0)


class _WholeAsHF:
    """A smoothed one-rank fused model seen as ``_fused_from_hf``'s input (q/k/v projections and norms)."""

    def __init__(self, fused, hf):
        self.config = hf.config
        self.model = torch.nn.Module()
        self.model.layers = []
        for fl in fused.model.layers:
            a, w = fl.self_attn, fl.self_attn.qkv_proj.weight
            b = fl.self_attn.qkv_proj.bias
            q, k = slice(0, a.q_size), slice(a.q_size, a.q_size + a.kv_size)
            v = slice(a.q_size + a.kv_size, None)
            attn = torch.nn.Module()
            for name, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                proj = torch.nn.Module()
                proj.weight, proj.bias = w[rows], None if b is None else b[rows]
                setattr(attn, name, proj)
            if hasattr(a, "q_norm"):
                attn.q_norm, attn.k_norm = a.q_norm, a.k_norm
            layer = torch.nn.Module()
            layer.self_attn, layer.input_layernorm = attn, fl.input_layernorm
            self.model.layers.append(layer)


@pytest.mark.parametrize("kind,kv_heads", [("llama", 2), ("qwen3", 2), ("gemma3", 2), ("llama", 1), ("qwen3", 1)])
def test_fused_tensor_parallel_ranks_fold_the_one_rank_scales(kind, kv_heads, tmp_path):
    """Two gloo ranks, each with its contiguous query heads and its KV head (or, with one KV head, a replica of
    it): every rank's smoothed weights and norm gains equal the one-rank result's rows of that rank."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_tensor_parallel_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", kind, kv_heads), nprocs=2)


def _random_layer(d=32, n_q=4, n_kv=2, hidden=48, qk_norm=False, rope=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    w = torch.randn((n_q + 2 * n_kv) * d, hidden, generator=g)
    qn = kn = None
    if qk_norm:
        qn, kn = RMSNorm(torch.rand(d, generator=g) * 2), RMSNorm(torch.rand(d, generator=g) * 2)
    attn = FusedAttention(w, None, n_q, n_kv, d, qn, kn, rope)
    attn.qkv_proj.weight = torch.nn.Parameter(attn.qkv_proj.weight.detach().to(dtype), requires_grad=False)
    return FusedLayer(attn, RMSNorm(torch.rand(hidden, generator=g) + 0.5))


def _state(layer):  # float8 has no torch.equal on the CPU: compare the bytes
    return {k: v.detach().clone().view(torch.uint8) if v.element_size() == 1 else v.detach().clone()
            for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("case, reason", [
    ("interleaved", "not rotate-half"),
    ("partial_rotary", "rotary_dim 16"),
    ("no_rope", "no rotary_emb"),
    ("int8", "int8, not float16/bfloat16/float32"),
    ("float8", "float8_e4m3fn, not float16/bfloat16/float32"),
    ("odd_head_dim", "odd head_dim 7"),
    ("layernorm_qk", "LayerNorm, not RMSNorm"),
    ("bad_shape", "expected (256, hidden)"),
])
def test_fused_refusals_leave_the_layer_untouched(case, reason):
    kw = {}
    if case == "interleaved":
        kw["rope"] = RotaryEmbedding(32, is_neox_style=False)
    elif case == "partial_rotary":
        kw["rope"] = RotaryEmbedding(32, rotary_dim=16)
    elif case == "int8":
        kw["dtype"] = torch.int8
    elif case == "float8":
        kw["dtype"] = torch.float8_e4m3fn
    elif case == "odd_head_dim":
        kw = dict(d=7, rope=RotaryEmbedding(7))
    elif case == "layernorm_qk":
        kw["qk_norm"] = True
    layer = _random_layer(**kw)
    if case == "no_rope":
        del layer.self_attn.rotary_emb
    elif case == "layernorm_qk":
        layer.self_attn.k_norm = torch.nn.LayerNorm(32)
    elif case == "bad_shape":
        layer.self_attn.qkv_proj.weight.data = layer.self_attn.qkv_proj.weight.data[:-8]
    state = _state(layer)
    with pytest.raises(KeySmoothingUnsupported, match=re.escape(reason)):
        smooth_fused_layer(layer)
    after = _state(layer)
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)

    model = FusedModel([_random_layer(), layer])
    summary = apply_key_smoothing_fused(model)
    assert summary.smoothed == ["model.layers.0"]
    assert summary.skipped[0][0] == "model.layers.1" and reason in summary.skipped[0][1]
    assert summary.describe().startswith("1 of 2 decoder layers smoothed; skipped: 1 x ")


def test_fused_without_row_folding_only_smooths_qk_norm_layers():
    model = FusedModel([_random_layer(), _random_layer(qk_norm=True)])
    state = _state(model.model.layers[0])
    summary = apply_key_smoothing_fused(model, fold_qkv_rows=False)
    assert summary.smoothed == ["model.layers.1"]
    assert "folding into the qkv_proj rows is off" in summary.skipped[0][1]
    assert all(torch.equal(v, state[k]) for k, v in _state(model.model.layers[0]).items())
    # the qkv weights of the q/k-norm layer are untouched too: the scale went into the norm gains
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, _random_layer(qk_norm=True).self_attn
                       .qkv_proj.weight)


def test_fused_bfloat16_weights_and_no_layers():
    layer = _random_layer(dtype=torch.bfloat16)
    w0 = layer.self_attn.qkv_proj.weight.clone()
    s = smooth_fused_layer(layer)
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16 and s.shape == (2, 32)
    assert not torch.equal(layer.self_attn.qkv_proj.weight, w0)
    assert apply_key_smoothing_fused(torch.nn.Linear(2, 2)).describe().startswith("no decoder layers")


def test_weight_scales_bad_inputs():
    w = torch.randn(4 * 7, 8)
    with pytest.raises(ValueError, match="even head_dim"):
        weight_scales(w, w, torch.ones(8), 4, 4, 7)
    w = torch.randn(3 * 8, 8)
    with pytest.raises(ValueError, match="do not divide"):
        weight_scales(w, w[:16], torch.ones(8), 3, 2, 8)
    with pytest.raises(ValueError, match="both be given"):
        weight_scales(w, w, torch.ones(8), 3, 3, 8, q_gain=torch.ones(8))


class _PackedQKV(torch.nn.Module):
    """A qkv_proj whose weight is TurboQuant-encoded (what ``--quantization tq4`` leaves): uint8 indices, fp16
    scales, and a quant method that decodes them (``TQLinearMethod.dequantized_weight``'s contract)."""

    def __init__(self, weight, fmt="tq4"):
        super().__init__()
        from turboquant_core.ops.weight_codec import quantize_weight

        q = quantize_weight(weight, fmt)
        self.weight = torch.nn.Parameter(q.packed, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(q.scales, requires_grad=False)
        self.input_size_per_partition = weight.shape[1]
        self.quant_method = self
        self.fmt = fmt

    def dequantized_weight(self, layer):
        from turboquant_core.ops.weight_codec import TQWeight, dequantize_weight

        return dequantize_weight(TQWeight(self.fmt, layer.weight, layer.weight_scale, layer.input_size_per_partition))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_weight_quantized_qkv_folds_into_the_norm_gains_only(qk_norm):
    """With an encoded qkv_proj, the scales come from the decoded weight (the same as smoothing a float layer that
    holds it) and go into the q/k-norm gains; the packed bytes never change; without q/k norms it is refused."""
    packed_layer = _random_layer(hidden=256, qk_norm=qk_norm)
    w = packed_layer.self_attn.qkv_proj.weight.detach()
    packed_layer.self_attn.qkv_proj = _PackedQKV(w)
    float_layer = _random_layer(hidden=256, qk_norm=qk_norm)
    decoded = packed_layer.self_attn.qkv_proj.dequantized_weight(packed_layer.self_attn.qkv_proj)
    float_layer.self_attn.qkv_proj.weight = torch.nn.Parameter(decoded, requires_grad=False)
    before = packed_layer.self_attn.qkv_proj.weight.clone()
    if not qk_norm:
        with pytest.raises(KeySmoothingUnsupported, match="weight-quantized and the layer has no q/k norms"):
            smooth_fused_layer(packed_layer)
    else:
        s_packed, s_float = smooth_fused_layer(packed_layer), smooth_fused_layer(float_layer)
        torch.testing.assert_close(s_packed, s_float)
        for norm in ("q_norm", "k_norm"):
            torch.testing.assert_close(getattr(packed_layer.self_attn, norm).weight,
                                       getattr(float_layer.self_attn, norm).weight)
    assert torch.equal(packed_layer.self_attn.qkv_proj.weight, before)

# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

transformers = pytest.importorskip("transformers")

from turboquant_core.integrations.key_smoothing import apply_key_smoothing, pair_rms, smoothing_scales  # noqa: E402
from turboquant_core.quantizer import MSEQuantizer  # noqa: E402


def _tiny(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
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

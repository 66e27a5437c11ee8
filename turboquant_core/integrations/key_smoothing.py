# SPDX-License-Identifier: Apache-2.0
"""Key smoothing folded into the attention weights: data-free, exact in full precision.

The MSE quantizer's error on a key is isotropic after the random rotation and proportional to the key's
norm, so the error of a logit q . k_hat has variance ~ |q|^2 |k|^2. Scaling key channel i by s_i and the
query channel by 1 / s_i leaves every q . k unchanged and changes that variance to |q / s|^2 |k * s|^2,
which is smallest for s_i^2 = rms(q_i) / rms(k_i): channels where queries are weak and keys strong (a
common pattern, e.g. behind per-head q/k norm gains) stop dominating the key norm.

The rms values come from the weights alone (no calibration data): with a normalized hidden state, the
rms of channel i is about the norm of row i of W * g (g the input RMSNorm gain); models with q/k
RMSNorm use the normalized row norms times their gain. RoPE rotates channel pairs (i, i + d/2) of
the rotate-half convention, so one s serves each pair and commutes with RoPE. The scale goes
into the weights once, at load time:

- no q/k norm (Llama, Qwen2, Mistral): rows of W_k (and its bias) times s, rows of W_q times 1/s
  (each query head with the s of its KV head); s per layer and KV head;
- q/k norm with one gain shared by all heads (Qwen3, Gemma 3): the k_norm gain times s and the q_norm
  gain times 1/s (Gemma's "1 + w" gains accordingly); s per layer, shared by the heads.

Measured on the CPU (benchmarks/results/eval-ppl-cpu/key-research): Gemma 3 270M, 4-bit keys and
values: +11.5 % -> +2.5 % perplexity; neutral on SmolLM2-135M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pair_rms(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d/2]: rms over each rotate-half RoPE pair (i, i + d/2)."""
    h = x.shape[-1] // 2
    return ((x[..., :h].pow(2) + x[..., h:].pow(2)) / 2).sqrt()


def smoothing_scales(rms_q: torch.Tensor, rms_k: torch.Tensor, power: float = 0.5) -> torch.Tensor:
    """[H, d/2] query and key pair rms -> s [H, d] = (rms_q / rms_k) ** power per pair, geometric mean 1
    per row (an overall factor does not change the quantization error of a normalized key)."""
    if rms_q.shape != rms_k.shape:
        raise ValueError(f"rms_q {tuple(rms_q.shape)} and rms_k {tuple(rms_k.shape)} must match")
    ratio = (rms_q.clamp_min(1e-12) / rms_k.clamp_min(1e-12)).pow(power)
    ratio = ratio / ratio.log().mean(-1, keepdim=True).exp()
    return torch.cat([ratio, ratio], dim=-1)


@dataclass
class SmoothedLayer:
    layer: int
    scales: torch.Tensor  # [Hkv or 1, d]


def _attention_modules(model):
    text = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(text, "layers", None)
    if layers is None:
        raise ValueError(f"key smoothing supports decoder models with .layers, got {type(model).__name__}")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        norm = getattr(layer, "input_layernorm", None)
        if attn is None or norm is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj")):
            raise ValueError(f"layer {i} of {type(model).__name__} has no self_attn.q_proj/k_proj/input_layernorm; "
                             "key smoothing supports Llama, Qwen2/3, Mistral and Gemma 3 style decoders")
        yield i, attn, norm


def _gain(norm: torch.nn.Module, one_plus: bool) -> torch.Tensor:
    w = norm.weight.detach().float()
    return 1.0 + w if one_plus else w


def _one_plus(model) -> bool:
    # Gemma's RMSNorm multiplies by (1 + weight); the others by weight.
    return getattr(model.config.get_text_config(decoder=True), "model_type", "").startswith("gemma")


@torch.no_grad()
def apply_key_smoothing(model, power: float = 0.5) -> list[SmoothedLayer]:
    """Fold weight-derived key smoothing into ``model`` in place; returns the scales per layer.

    Logits are unchanged up to floating-point rounding; only the keys the cache stores (and so their
    quantization error) change."""
    cfg = model.config.get_text_config(decoder=True)
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    if d % 2:
        raise ValueError(f"key smoothing needs an even head_dim, got {d}")
    one_plus = _one_plus(model)
    out = []
    for i, attn, norm in _attention_modules(model):
        g = _gain(norm, one_plus)
        rq = (attn.q_proj.weight.detach().float() * g).norm(dim=1).view(n_q, d)
        rk = (attn.k_proj.weight.detach().float() * g).norm(dim=1).view(n_kv, d)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"layer {i}: q_norm and k_norm must both be present or both absent")
        if q_norm is not None:
            # Per-head RMSNorm after the projection: the row norms matter only relative to their head.
            rq = rq / rq.pow(2).mean(-1, keepdim=True).sqrt() * _gain(q_norm, one_plus)
            rk = rk / rk.pow(2).mean(-1, keepdim=True).sqrt() * _gain(k_norm, one_plus)
            if q_norm.weight.numel() != d or k_norm.weight.numel() != d:
                raise ValueError(f"layer {i}: q_norm/k_norm gains of {q_norm.weight.numel()} channels, expected {d}")
            # One gain shared by all heads: one s per layer, from the rms pooled over heads.
            s = smoothing_scales(pair_rms(rq).pow(2).mean(0, keepdim=True).sqrt(),
                                 pair_rms(rk).pow(2).mean(0, keepdim=True).sqrt(), power)[0]
            for mod, factor in ((k_norm, s), (q_norm, 1.0 / s)):
                w = mod.weight
                new = (1.0 + w.float()) * factor - 1.0 if one_plus else w.float() * factor
                w.copy_(new.to(w.dtype))
            out.append(SmoothedLayer(i, s[None].clone()))
            continue
        rq_kv = pair_rms(rq).pow(2).view(n_kv, n_q // n_kv, d // 2).mean(1).sqrt()
        s = smoothing_scales(rq_kv, pair_rms(rk), power)  # [Hkv, d]
        k_rows = s.reshape(-1)
        q_rows = (1.0 / s).repeat_interleave(n_q // n_kv, dim=0).reshape(-1)
        for proj, rows in ((attn.k_proj, k_rows), (attn.q_proj, q_rows)):
            proj.weight.mul_(rows.to(proj.weight.dtype)[:, None])
            if getattr(proj, "bias", None) is not None:
                proj.bias.mul_(rows.to(proj.bias.dtype))
        out.append(SmoothedLayer(i, s.clone()))
    return out


__all__ = ["SmoothedLayer", "apply_key_smoothing", "pair_rms", "smoothing_scales"]

# SPDX-License-Identifier: Apache-2.0
"""Key/value encodings around the TurboQuant MSE quantizer that lower the perplexity cost of 4- and 3-bit keys.

Every variant keeps the quantizer itself (random rotation + Lloyd-Max codebook, ``MSEQuantizer``, norm
correction, the format table's seeds) and changes only what is fed to it, in ways an attention kernel can undo
exactly or ignore:

- key smoothing: k' = k * s after RoPE, q' = q / s (q . k unchanged), quantize k'. s is per layer, KV head and
  RoPE pair (channels i and i + d/2 share one s, so it commutes with RoPE and can be folded into W_k / W_q or
  the q/k RMSNorm gains). s_i^2 = rms(q_i) / rms(k_i) minimises E|q/s|^2 E|k s|^2, the variance of the logit
  error for an isotropic quantization error proportional to |k s|. Sources of the rms:
  ``weights`` (data free: row norms of W_q, W_k with the input RMSNorm gain, and the q/k-norm gains where the
  model has them), ``window`` (the window's own q and k: an oracle), ``prefix`` (tokens 1-64 of the sequence).
- key centering: quantize k - mu, mu = per-head mean of tokens 1-64 (``prefix``) or of the window (oracle).
  Softmax is invariant to q . mu, so the attention kernel may drop mu.
- sink: the first N tokens' keys and values kept in full precision (side data per sequence).
- value smoothing: v' = v * t, W_o columns / t (o = W_o diag(1/t) sum p v'), t_i^2 = |W_o[:, i]| / rms(v_i)
  from the weights (data free), foldable into W_v rows and W_o columns.
- value centering: quantize v - mu_v, add mu_v to the attention output (sum p = 1, exact).

Same windows and scoring as ``tq eval-ppl`` and ``key_error_diagnostics.py`` (each layer's K/V are replaced by
their dequantized encodings before attention, so every position attends to quantized K/V). The baseline logits
are computed once per window and reused by all variants.

Usage: python benchmarks/results/eval-ppl-cpu/key-research/key_variants.py --model smollm2-135m-instruct --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from turboquant_core.integrations.models import load_model
from turboquant_core.integrations.perplexity import read_text, token_windows
from turboquant_core.quantizer import MSEQuantizer

KEY_SEED, VALUE_SEED = 0x7C01, 0x7C02  # the format table's rotation seeds


@dataclass(frozen=True)
class Variant:
    k_bits: float
    v_bits: float = 4
    k_smooth: str | None = None  # None | "weights" | "window" | "prefix"
    k_center: str | None = None  # None | "window" | "prefix" | "prerope-prefix" | "prerope-window" | "prerope-page0"
    page: int = 16  # "prerope-page0": tokens < page stored plain, mu_pre from their decoded keys 1..page-1
    sink: int = 0  # first tokens kept in full precision (K, and V unless sink_keys_only)
    sink_keys_only: bool = False
    prefix: int = 64  # tokens 1..prefix give the causal ("prefix") estimates
    v_smooth: str | None = None  # None | "weights"
    v_center: str | None = None  # None | "prefix"
    smooth_power: float = 0.5  # s = (rms_q / rms_k) ** smooth_power (0.5 is the isotropic optimum)
    page0_bits: tuple[float, float] | None = None  # (K, V) bits of the first page's tokens, else the preset's

    def extra_bytes(self, d: int) -> str:
        """Side data beyond the preset's fixed bytes per token (fp16 numbers)."""
        parts = []
        if self.k_smooth == "weights":
            parts.append("0 (s folded into W_q/W_k)")
        elif self.k_smooth:
            parts.append(f"{d} B/seq/layer/kv-head (s, d/2 fp16)")
        if self.k_center in ("prerope-page0", "prerope-page0-paged"):
            parts.append("0 (mu_k before RoPE: recomputed from the first page)")
        elif self.k_center:
            parts.append(f"{2 * d} B/seq/layer/kv-head (mu_k{' before RoPE' if 'prerope' in self.k_center else ''})")
        if self.sink:
            what, per = ("K", 2 * d) if self.sink_keys_only else ("K,V", 4 * d)
            parts.append(f"{per * self.sink} B/seq/layer/kv-head (fp16 {what} of {self.sink} token(s))")
        if self.v_smooth:
            parts.append("0 (t folded into W_v/W_o)")
        if self.v_center:
            parts.append(f"{2 * d} B/seq/layer/kv-head (mu_v)")
        if self.page0_bits:
            parts.append(f"0 (first page K{self.page0_bits[0]:g} V{self.page0_bits[1]:g})")
        return "; ".join(parts) or "0"


def variant_table(preset_bits: dict[str, float]) -> dict[str, Variant]:
    table = {}
    for preset, kb in preset_bits.items():
        rows = {
            "plain": Variant(kb),
            "K smooth (weights)": Variant(kb, k_smooth="weights"),
            "K smooth (window, oracle)": Variant(kb, k_smooth="window"),
            "K smooth (prefix 1-64)": Variant(kb, k_smooth="prefix"),
            "K center (prefix)": Variant(kb, k_center="prefix"),
            "K center (prefix) + smooth (weights)": Variant(kb, k_center="prefix", k_smooth="weights"),
            "K center (prefix) + smooth (prefix)": Variant(kb, k_center="prefix", k_smooth="prefix"),
            "K center (window) + smooth (window), oracle": Variant(kb, k_center="window", k_smooth="window"),
            "sink 1": Variant(kb, sink=1),
            "sink 1 + K smooth (weights)": Variant(kb, sink=1, k_smooth="weights"),
            "sink 1 + K center (prefix) + smooth (weights)": Variant(kb, sink=1, k_center="prefix", k_smooth="weights"),
            "K center pre-RoPE (prefix)": Variant(kb, k_center="prerope-prefix"),
            "sink 1 + K center pre-RoPE (prefix)": Variant(kb, sink=1, k_center="prerope-prefix"),
            "sink 1 + K center pre-RoPE (window), oracle": Variant(kb, sink=1, k_center="prerope-window"),
            "sink 1 + K center pre-RoPE (prefix) + smooth (weights)": Variant(
                kb, sink=1, k_center="prerope-prefix", k_smooth="weights"),
            "sink 1 (K only) + K center pre-RoPE (prefix)": Variant(
                kb, sink=1, sink_keys_only=True, k_center="prerope-prefix"),
            "sink 4 + K center pre-RoPE (prefix)": Variant(kb, sink=4, k_center="prerope-prefix"),
            "sink 1 + K center pre-RoPE (prefix 1-16)": Variant(kb, sink=1, k_center="prerope-prefix", prefix=16),
            "K center pre-RoPE (page 0 of 16 plain)": Variant(kb, k_center="prerope-page0", page=16),
            "K center pre-RoPE, page-constant (page 0 of 16 plain)": Variant(
                kb, k_center="prerope-page0-paged", page=16),
            "sink 1 + K center pre-RoPE (prefix) + V smooth (weights)": Variant(
                kb, sink=1, k_center="prerope-prefix", v_smooth="weights"),
            "sink 1 + K center pre-RoPE (prefix) + V center (prefix)": Variant(
                kb, sink=1, k_center="prerope-prefix", v_center="prefix"),
            "K center pre-RoPE, page-constant (page 0 of 16 plain) + sink 1 (K only)": Variant(
                kb, k_center="prerope-page0-paged", page=16, sink=1, sink_keys_only=True),
            "K center pre-RoPE, page-constant (page 0 of 16 plain, K4 V3)": Variant(
                kb, k_center="prerope-page0-paged", page=16, page0_bits=(4, 3)),
            "K center pre-RoPE (page 0 of 16 plain, K4 V3)": Variant(
                kb, k_center="prerope-page0", page=16, page0_bits=(4, 3)),
            "V smooth (weights)": Variant(kb, v_smooth="weights"),
            "V center (prefix)": Variant(kb, v_center="prefix"),
        }
        for name, v in rows.items():
            table[f"{preset} | {name}"] = v
    return table


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def pair_rms(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d/2]: sqrt of the mean square over the RoPE pair (i, i + d/2), which RoPE preserves."""
    h = x.shape[-1] // 2
    return ((x[..., :h].pow(2) + x[..., h:].pow(2)) / 2).sqrt()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The model's RoPE convention (pairs (i, i + d/2)); cos, sin [T, d] as the model passes them to attention."""
    return x * cos + rotate_half(x) * sin


def expand_pairs(s_half: torch.Tensor) -> torch.Tensor:
    return torch.cat([s_half, s_half], dim=-1)


def smoothing_from_rms(rms_q: torch.Tensor, rms_k: torch.Tensor, power: float) -> torch.Tensor:
    """[Hkv, d/2] rms -> [Hkv, d] s with geometric mean 1 per head (scale does not matter to the quantizer)."""
    ratio = (rms_q.clamp_min(1e-12) / rms_k.clamp_min(1e-12)).pow(power)
    ratio = ratio / ratio.log().mean(-1, keepdim=True).exp()
    return expand_pairs(ratio)


def group_q(rms_q_heads: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[Hq, m] per query head -> [Hkv, m]: rms over the query heads that share each KV head."""
    hq, m = rms_q_heads.shape
    return rms_q_heads.pow(2).view(n_kv, hq // n_kv, m).mean(1).sqrt()


def weight_stats(attn, input_norm, d: int, n_q: int, n_kv: int, gemma_norm: bool):
    """Data-free per-channel scales of q, k, v and of W_o's columns, from the weights alone.

    Assumes an isotropic normalized hidden state: rms(q_i) ~ |W_q[i, :] * g| with g the input RMSNorm gain;
    for models with q/k RMSNorm (Gemma 3) the per-head normalization is applied to the row norms, then the gain.
    """
    g = input_norm.weight.float()
    if gemma_norm:
        g = 1.0 + g
    wq = attn.q_proj.weight.float() * g
    wk = attn.k_proj.weight.float() * g
    wv = attn.v_proj.weight.float() * g
    rq = wq.norm(dim=1).view(n_q, d)
    rk = wk.norm(dim=1).view(n_kv, d)
    rv = wv.norm(dim=1).view(n_kv, d)
    if getattr(attn, "q_norm", None) is not None:
        rq = rq / rq.pow(2).mean(-1, keepdim=True).sqrt() * (1.0 + attn.q_norm.weight.float())
        rk = rk / rk.pow(2).mean(-1, keepdim=True).sqrt() * (1.0 + attn.k_norm.weight.float())
    wo_cols = attn.o_proj.weight.float().norm(dim=0).view(n_q, d)
    return {
        "rms_q": group_q(pair_rms(rq), n_kv),  # [Hkv, d/2]
        "rms_k": pair_rms(rk),  # [Hkv, d/2]
        "rms_v": rv,  # [Hkv, d]
        "wo": group_q(wo_cols, n_kv),  # [Hkv, d]
    }


# ---------------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------------


class DequantizedLayer(DynamicLayer):
    """Stores key_fn(K), value_fn(V) (the dequantized encodings) instead of K, V."""

    def __init__(self, key_fn, value_fn):
        super().__init__()
        self.key_fn, self.value_fn = key_fn, value_fn

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(self.key_fn(key_states), self.value_fn(value_states))


def make_fns(v: Variant, d: int, wstats: dict, win: dict, quantizers: dict):
    """(key_fn, value_fn) for one layer. win: this window's q pair-rms [Hkv, d/2] and full K, V [Hkv, T, d]."""
    kq, vq = quantizers[("k", v.k_bits)], quantizers[("v", v.v_bits)]
    kq0, vq0 = (kq, vq) if v.page0_bits is None else (quantizers[("k", v.page0_bits[0])],
                                                       quantizers[("v", v.page0_bits[1])])
    prefix = slice(1, v.prefix + 1)  # token 0 (often an attention sink) is left out of the estimates
    k_all, v_all = win["k"], win["v"]

    def rms_k_of(keys):
        return pair_rms(keys).pow(2).mean(1).sqrt()  # [Hkv, d/2]

    mu = torch.zeros(k_all.shape[0], 1, d)
    if v.k_center in ("prerope-prefix", "prerope-window"):
        # A constant key component before RoPE is R_j mu after it: subtract the rotated mean, position by position.
        # Softmax is not invariant to q . R_j mu, so the kernel adds that term back (see the report).
        k_pre = win["k_pre"]
        mu_pre = (k_pre[:, prefix] if v.k_center == "prerope-prefix" else k_pre).mean(1, keepdim=True)
        mu = apply_rope(mu_pre.expand_as(k_pre), win["cos"], win["sin"])  # [Hkv, T, d]
    elif v.k_center in ("prerope-page0", "prerope-page0-paged"):
        # The serving layout: the first page (tokens < page) is encoded plain; mu_pre is the mean of its
        # decoded keys 1..page-1 rotated back by RoPE, so it is a function of the first page's bytes alone.
        cos, sin = win["cos"], win["sin"]
        k0 = kq0.dequantize(kq0.quantize(k_all[:, 1:v.page].float()))
        inv = apply_rope(k0, cos[1:v.page], -sin[1:v.page])  # R_j^-1 = R_j with sin negated
        mu_pre = inv.mean(1, keepdim=True)
        if v.k_center == "prerope-page0":
            mu = apply_rope(mu_pre.expand_as(k_all), cos, sin)
        else:
            # One centre per page: RoPE_m(mu_pre) at the page's middle m, each pair shrunk by
            # rho_f = |mean over the page of e^{i t theta_f}| (the least-squares constant for that pair).
            h, P, T = d // 2, v.page, k_all.shape[1]
            theta = torch.atan2(sin[1, :h].double(), cos[1, :h].double())
            rho = torch.sin(P * theta / 2) / (P * torch.sin(theta / 2))
            mid = (torch.arange(T, dtype=torch.float64) // P) * P + (P - 1) / 2
            ang = mid[:, None] * theta[None, :]
            c = torch.cat([torch.cos(ang), torch.cos(ang)], -1).float()
            s_ = torch.cat([torch.sin(ang), torch.sin(ang)], -1).float()
            mu = apply_rope(mu_pre.expand_as(k_all) * torch.cat([rho, rho]).float(), c, s_)
        mu[:, : v.page] = 0.0
    elif v.k_center == "window":
        mu = k_all.mean(1, keepdim=True)
    elif v.k_center == "prefix":
        mu = k_all[:, prefix].mean(1, keepdim=True)
    s = torch.ones(k_all.shape[0], d)
    if v.k_smooth == "weights":
        s = smoothing_from_rms(wstats["rms_q"], wstats["rms_k"], v.smooth_power)
    elif v.k_smooth == "window":
        s = smoothing_from_rms(win["rms_q"], rms_k_of(k_all - mu), v.smooth_power)
    elif v.k_smooth == "prefix":
        rms_q_prefix = group_q(pair_rms(win["q"][:, prefix]).pow(2).mean(1).sqrt(), k_all.shape[0])
        s = smoothing_from_rms(rms_q_prefix, rms_k_of((k_all - mu)[:, prefix]), v.smooth_power)
    s = s[:, None, :]

    mu_v = torch.zeros(v_all.shape[0], 1, d)
    if v.v_center == "prefix":
        mu_v = v_all[:, prefix].mean(1, keepdim=True)
    t = torch.ones(v_all.shape[0], d)
    if v.v_smooth == "weights":
        r = (wstats["wo"].clamp_min(1e-12) / wstats["rms_v"].clamp_min(1e-12)).sqrt()
        t = r / r.log().mean(-1, keepdim=True).exp()
    t = t[:, None, :]

    def key_fn(x):
        xf = x.float()
        y = (xf - mu) * s
        out = kq.dequantize(kq.quantize(y)) / s + mu
        if v.page0_bits is not None:
            out[..., : v.page, :] = kq0.dequantize(kq0.quantize(y[..., : v.page, :])) / s + mu[..., : v.page, :]
        if v.sink:
            out[..., : v.sink, :] = xf[..., : v.sink, :]
        return out.to(x.dtype)

    def value_fn(x):
        xf = x.float()
        y = (xf - mu_v) * t
        out = vq.dequantize(vq.quantize(y)) / t + mu_v
        if v.page0_bits is not None:
            out[..., : v.page, :] = vq0.dequantize(vq0.quantize(y[..., : v.page, :])) / t + mu_v
        if v.sink and not v.sink_keys_only:
            out[..., : v.sink, :] = xf[..., : v.sink, :]
        return out.to(x.dtype)

    return key_fn, value_fn


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def layers_of(model):
    inner = model.model
    inner = getattr(inner, "language_model", inner)
    return inner.layers


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presets", default="turboquant_4bit_nc=4,turboquant_k3v4_nc=3",
                    help="comma-separated name=key_bits (values are 4-bit)")
    ap.add_argument("--only", default=None,
                    help="comma-separated substrings of 'preset | variant' names, or =variant for an exact "
                         "variant name: run only the matching variants")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    preset_bits = {}
    for item in args.presets.split(","):
        name, _, bits = item.partition("=")
        preset_bits[name] = float(bits)
    loaded = load_model(args.model, dtype=torch.float32)
    model, cfg = loaded.model, loaded.model.config.get_text_config(decoder=True)
    text, label = read_text(None)
    windows = token_windows(loaded.tokenizer, text, args.window, args.windows)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_q, n_kv, n_layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    gemma_norm = "gemma" in cfg.model_type
    table = variant_table(preset_bits)
    if args.only:
        keys = [s.strip() for s in args.only.split(",")]
        exact = {s[1:] for s in keys if s.startswith("=")}
        table = {k: v for k, v in table.items()
                 if k.partition(" | ")[2] in exact or any(s in k for s in keys if not s.startswith("="))}
    quantizers = {}
    for v in table.values():
        for kb, vb in [(v.k_bits, v.v_bits)] + ([v.page0_bits] if v.page0_bits else []):
            quantizers.setdefault(("k", kb), MSEQuantizer(d, kb, True, KEY_SEED))
            quantizers.setdefault(("v", vb), MSEQuantizer(d, vb, True, VALUE_SEED))
    layers = layers_of(model)
    wstats = [weight_stats(layer.self_attn, layer.input_layernorm, d, n_q, n_kv, gemma_norm) for layer in layers]

    # Capture the query (after q-norm, before RoPE: RoPE keeps the pair energy) during the baseline forward.
    captured: dict[int, torch.Tensor] = {}

    def q_hook(idx):
        def hook(_module, _inp, out):
            if out.dim() == 3:  # q_proj output [B, T, Hq*d]
                out = out.view(out.shape[0], out.shape[1], n_q, d).transpose(1, 2)
            captured[idx] = out[0].float()  # [Hq, T, d]
        return hook

    captured_k: dict[int, torch.Tensor] = {}
    captured_v: dict[int, torch.Tensor] = {}
    captured_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def k_hook(idx):
        def hook(_module, _inp, out):
            if out.dim() == 3:  # k_proj output [B, T, Hkv*d]
                out = out.view(out.shape[0], out.shape[1], n_kv, d).transpose(1, 2)
            captured_k[idx] = out[0].float()  # [Hkv, T, d], before RoPE
        return hook

    def v_hook(idx):
        def hook(_module, _inp, out):
            captured_v[idx] = out[0].float().view(out.shape[1], n_kv, d).transpose(0, 1)  # [Hkv, T, d]
        return hook

    def rope_hook(idx):
        def hook(_module, _args, kwargs):
            cos, sin = kwargs["position_embeddings"]
            captured_rope[idx] = (cos[0].float(), sin[0].float())
        return hook

    for i, layer in enumerate(layers):
        attn = layer.self_attn
        has_norm = getattr(attn, "q_norm", None) is not None
        (attn.q_norm if has_norm else attn.q_proj).register_forward_hook(q_hook(i))
        (attn.k_norm if has_norm else attn.k_proj).register_forward_hook(k_hook(i))
        attn.v_proj.register_forward_hook(v_hook(i))
        attn.register_forward_pre_hook(rope_hook(i), with_kwargs=True)

    nll = dict.fromkeys(table, 0.0)
    kl = dict.fromkeys(table, 0.0)
    top1 = dict.fromkeys(table, 0)
    base_nll, n = 0.0, 0
    t0 = time.time()
    for row in tqdm(windows, desc="windows"):
        ids, tgt = row[None], row[1:, None]
        cache = DynamicCache(config=model.config)
        base = torch.log_softmax(model(ids, past_key_values=cache).logits[0, :-1].float(), -1)
        base_top = base.argmax(-1)
        base_nll += float(-base.gather(-1, tgt).sum())
        n += tgt.numel()
        wins = []
        for i, layer in enumerate(cache.layers):
            q = captured[i]
            cos, sin = captured_rope[i]
            k = apply_rope(captured_k[i], cos, sin)
            # The cached keys must equal RoPE(captured pre-RoPE keys) (else the hooks are wrong). Sliding-window
            # layers keep only the last tokens, hence the comparison on the cached tail.
            cached = layer.keys[0].float()
            rope_err = float((k[:, -cached.shape[1]:] - cached).abs().max())
            if rope_err > 1e-3:
                raise RuntimeError(f"layer {i}: pre-RoPE key capture does not match the cache (error {rope_err:.3g})")
            wins.append({"k": k, "v": captured_v[i], "k_pre": captured_k[i], "cos": cos, "sin": sin, "q": q,
                         "rms_q": group_q(pair_rms(q).pow(2).mean(1).sqrt(), n_kv)})
        for name, var in tqdm(table.items(), desc="variants", leave=False):
            fns = [make_fns(var, d, wstats[i], wins[i], quantizers) for i in range(n_layers)]
            c = Cache(layers=[DequantizedLayer(kf, vf) for kf, vf in fns])
            lp = torch.log_softmax(model(ids, past_key_values=c).logits[0, :-1].float(), -1)
            nll[name] += float(-lp.gather(-1, tgt).sum())
            kl[name] += float((base.exp() * (base - lp)).sum())
            top1[name] += int((lp.argmax(-1) == base_top).sum())
    base_ppl = math.exp(base_nll / n)
    out = {"model": args.model, "text": label, "window": args.window, "windows": len(windows), "tokens_scored": n,
           "head_dim": d, "baseline_ppl": base_ppl, "seconds": round(time.time() - t0, 1),
           "torch": torch.__version__, "variants": {}}
    print(f"{args.model}: {len(windows)} windows x {args.window}, baseline ppl {base_ppl:.4f}")
    print("| preset | variant | extra bytes | ppl | d ppl % | KL nats/token | top-1 % |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, var in table.items():
        ppl = math.exp(nll[name] / n)
        preset, _, vname = name.partition(" | ")
        row = {"preset": preset, "variant": vname, "extra_bytes": var.extra_bytes(d), "ppl": ppl,
               "delta_ppl_pct": 100 * (ppl / base_ppl - 1), "kl_per_token": kl[name] / n,
               "top1_pct": 100 * top1[name] / n, "config": var.__dict__}
        out["variants"][name] = row
        print(f"| {preset} | {vname} | {row['extra_bytes']} | {ppl:.4f} | {row['delta_ppl_pct']:+.2f} | "
              f"{row['kl_per_token']:.4f} | {row['top1_pct']:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

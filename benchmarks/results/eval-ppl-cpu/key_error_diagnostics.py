# SPDX-License-Identifier: Apache-2.0
"""Where the perplexity loss of 4-bit TurboQuant K/V comes from (diagnostic, not a format).

Same windows and scoring as ``tq eval-ppl``, but each variant quantizes K and/or V with the reference
``MSEQuantizer`` (4 or 3 bits, norm correction) inside a plain cache layer, so that one part can be
switched off or changed:

- K only / V only: which of the two costs the perplexity;
- K centered: quantize k - mu and add mu back, mu = per-head mean of the keys (of the whole window, or
  of tokens 1-64 only, as a causal estimate). Softmax is invariant to a per-head constant in the keys
  (q . mu is the same for every key of a query), so an encoder could drop mu altogether; only the
  quantization error changes. This is an experiment, not one of the formats.

Usage: python benchmarks/results/eval-ppl-cpu/key_error_diagnostics.py --model smollm2-135m-instruct --windows 8
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from turboquant_core.integrations.models import load_model
from turboquant_core.integrations.perplexity import read_text, token_windows
from turboquant_core.quantizer import MSEQuantizer

KEY_SEED, VALUE_SEED = 0x7C01, 0x7C02  # the format table's rotation seeds


class QuantizeOnWriteLayer(DynamicLayer):
    """A full-precision layer that stores f(K), g(V) instead of K, V (None: unchanged)."""

    def __init__(self, key_fn, value_fn):
        super().__init__()
        self.key_fn, self.value_fn = key_fn, value_fn

    def update(self, key_states, value_states, *args, **kwargs):
        k = self.key_fn(key_states) if self.key_fn else key_states
        v = self.value_fn(value_states) if self.value_fn else value_states
        return super().update(k, v)


def mse(head_dim: int, bits: float, seed: int, center: str | None = None):
    q = MSEQuantizer(head_dim, bits, True, seed)

    def fn(x):
        if center == "window":
            mu = x.mean(dim=2, keepdim=True)
        elif center == "prefix":
            mu = x[:, :, 1:65].mean(dim=2, keepdim=True)
        else:
            mu = torch.zeros_like(x[:, :, :1])
        return (q.dequantize(q.quantize(x - mu)) + mu).to(x.dtype)

    return fn


def variants(d: int):
    return {
        "K4 V4 (the turboquant_4bit_nc quantizers)": (mse(d, 4, KEY_SEED), mse(d, 4, VALUE_SEED)),
        "K4 only (V full precision)": (mse(d, 4, KEY_SEED), None),
        "V4 only (K full precision)": (None, mse(d, 4, VALUE_SEED)),
        "K3 V4 (the turboquant_k3v4_nc quantizers)": (mse(d, 3, KEY_SEED), mse(d, 4, VALUE_SEED)),
        "K4 V4, K centered (mean of the window)": (mse(d, 4, KEY_SEED, "window"), mse(d, 4, VALUE_SEED)),
        "K4 V4, K centered (mean of tokens 1-64)": (mse(d, 4, KEY_SEED, "prefix"), mse(d, 4, VALUE_SEED)),
        "K3 V4, K centered (mean of tokens 1-64)": (mse(d, 3, KEY_SEED, "prefix"), mse(d, 4, VALUE_SEED)),
    }


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=torch.float32)
    model, cfg = loaded.model, loaded.model.config.get_text_config(decoder=True)
    text, label = read_text(None)
    windows = token_windows(loaded.tokenizer, text, args.window, args.windows)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    table = variants(d)
    nll = dict.fromkeys(table, 0.0)
    kl = dict.fromkeys(table, 0.0)
    base_nll, n = 0.0, 0
    mean_ratio = []
    key_quantizers = {4: mse(d, 4, KEY_SEED), 3: mse(d, 3, KEY_SEED)}
    key_mse = {4: [], 3: []}
    for row in windows:
        ids, tgt = row[None], row[1:, None]
        cache = DynamicCache(config=model.config)
        base = torch.log_softmax(model(ids, past_key_values=cache).logits[0, :-1].float(), -1)
        base_nll += float(-base.gather(-1, tgt).sum())
        n += tgt.numel()
        for layer in cache.layers:
            k = layer.keys[0].float()
            # Share of key energy in the per-head mean: |mean|^2 / mean(|k|^2).
            mean_ratio.append(float((k.mean(1).pow(2).sum(-1) / k.pow(2).sum(-1).mean(1)).mean()))
            # Relative squared error of the key quantizers, E|k - k_hat|^2 / E|k|^2 (paper: 0.0095 / 0.0345
            # upper bounds at 4 / 3 bits for unit vectors).
            for bits in (4, 3):
                err = k - key_quantizers[bits](k[None])[0].float()
                key_mse[bits].append(float(err.pow(2).sum() / k.pow(2).sum()))
        for name, (kf, vf) in table.items():
            c = Cache(layers=[QuantizeOnWriteLayer(kf, vf) for _ in range(cfg.num_hidden_layers)])
            lp = torch.log_softmax(model(ids, past_key_values=c).logits[0, :-1].float(), -1)
            nll[name] += float(-lp.gather(-1, tgt).sum())
            kl[name] += float((base.exp() * (base - lp)).sum())
    base_ppl = math.exp(base_nll / n)
    out = {"model": args.model, "text": label, "window": args.window, "windows": len(windows), "tokens_scored": n,
           "baseline_ppl": base_ppl, "key_energy_in_mean": sum(mean_ratio) / len(mean_ratio),
           "key_relative_mse": {f"{b}-bit": sum(v) / len(v) for b, v in key_mse.items()}, "variants": {}}
    print(f"{args.model}: {len(windows)} windows x {args.window}, baseline ppl {base_ppl:.4f}, "
          f"share of key energy in the per-head mean {out['key_energy_in_mean']:.2f}, "
          f"key relative MSE {out['key_relative_mse']}")
    print("| variant | ppl | d ppl % | KL nats/token |\n|---|---:|---:|---:|")
    for name in table:
        ppl = math.exp(nll[name] / n)
        out["variants"][name] = {"ppl": ppl, "delta_ppl_pct": 100 * (ppl / base_ppl - 1), "kl_per_token": kl[name] / n}
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base_ppl - 1):+.2f} | {kl[name] / n:.4f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

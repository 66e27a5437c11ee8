# SPDX-License-Identifier: Apache-2.0
"""3-bit keys in a calibrated pre-RoPE basis: attention error on SmolLM2 against the served encoding (CPU).

`turboquant_k3v4_nc` stays short of bf16 NIAH on SmolLM2 at 2k (issue 4). A random rotation makes every
coordinate of a key equally important, so 3 bits per coordinate cost the same everywhere. The keys of a
head are not isotropic before RoPE: their covariance has a skewed spectrum that RoPE scrambles (the phase
of each pair turns with the position). This script measures what a transform code in the key's own basis
buys at the same bytes (192 index bits + one fp16 scale = 26 B per key at d = 64):

- x_j = R_{j - m(j)} (k_pre_j - mu): the pre-RoPE key, centred by its sequence's mean of tokens 1-15 (as the
  served centring), turned by RoPE over the distance to the middle m(j) of its tile of ``tile`` positions
  (``tile`` 0: no turn, the exact pre-RoPE key). In post-RoPE terms x_j = R_m^-1 (k_j - RoPE_j(mu)): a
  decode kernel can apply R_m^-1 U to the query once per tile instead of once per key. ``post-RoPE``: the
  centred post-RoPE key k_j - RoPE_j(mu) itself, with no turn (a basis a kernel could use like the rotation).
- y = U^T x with U, sigma^2 the eigenvectors / eigenvalues of the covariance of x per layer and KV head,
  from *other* windows of the text (``calibrated``), the evaluated window itself (``oracle``, a bound) or
  the weights alone (W_k times the input RMSNorm gain, hidden state taken as isotropic: ``weights``).
- bit layout over the coordinates in decreasing sigma: 16 x 4 + 32 x 3 + 16 x 2 bits ("4/3/2") or
  32 x 4 + 32 x 2 ("4/2", two segments as the fractional presets already pack); coordinate i is quantized
  with the N(0, 1) Lloyd-Max codebook at scale g sigma_i, g = |y| / |sigma| per key, then the key is
  rescaled to |y| (norm correction); the fp16 scale is the only per-key number.

Baselines: the served encoding's quantizer (random rotation + Lloyd-Max, norm correction) on the same
centred keys at 3 and 4 bits. In every variant token 0 (the attention sink) is kept exact, so the rows
compare the code on the other keys. Measure: mean KL of each attention row (query positions 64+, every
query head) against full precision, and the mean squared logit error over keys past the first 16.

Usage: python key_basis_attention.py [--tokens 1024] [--calib-windows 1] [--layers 30]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from key_basis import (
    CENTRE_TOKENS,
    LAYOUTS,
    basis_from,
    capture,
    code_in_basis,
    rope,
    served_quantizer,
    tile_offset,
    turned,
)

from turboquant_core.integrations.models import load_model
from turboquant_core.integrations.perplexity import read_text, token_windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--calib-windows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="first N layers only (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, cfg = loaded.model, loaded.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = model.model.rotary_emb.inv_freq.float()
    text, _ = read_text(None)
    windows = token_windows(loaded.tokenizer, text, args.tokens, 1 + args.calib_windows)
    evaluated = capture(model, windows[0][None], d, nq, nkv)
    calib = [capture(model, w[None], d, nq, nkv) for w in windows[1:]]
    T, P = args.tokens, CENTRE_TOKENS
    pos = torch.arange(T)
    ang = pos.float()[:, None] * inv_freq[None]
    variants = ["served quantizer, 3 bits", "served quantizer, 4 bits",
                "oracle basis, exact, 4/3/2", "calibrated basis, exact, 4/3/2", "calibrated basis, exact, 4/2",
                "calibrated basis, tile 16, 4/3/2", "calibrated basis, tile 16, 4/2",
                "calibrated basis, tile 64, 4/3/2", "calibrated basis, tile 64, 4/2",
                "weights basis, exact, 4/3/2", "calibrated basis, post-RoPE, 4/3/2"]
    res = {v: [] for v in variants}
    n_layers = args.layers or len(evaluated)
    for li in range(n_layers):
        q_pre, k_pre = evaluated[li]
        q, k = rope(q_pre, ang), rope(k_pre, ang)
        mu = k_pre[:, 1:P].mean(1, keepdim=True)
        kc_pre = k_pre - mu
        shift = k - rope(kc_pre, ang)  # RoPE_j(mu)
        recon = {"served quantizer, 3 bits": served_quantizer(k - shift, 3) + shift,
                 "served quantizer, 4 bits": served_quantizer(k - shift, 4) + shift}
        for v in variants[2:]:
            source, where, layout = v.split(", ")
            post = where == "post-RoPE"  # the basis of the post-RoPE keys: no turn undoes RoPE
            tile = 0 if where in ("exact", "post-RoPE") else int(where.split()[1])
            x = rope(kc_pre, ang) if post else turned(kc_pre, inv_freq, tile)
            if source.startswith("oracle"):
                ev, vec = basis_from(x[:, P:])
            elif source.startswith("calibrated"):
                xs = []
                for c in calib:
                    kp = c[li][1]
                    kp_c = kp - kp[:, 1:P].mean(1, keepdim=True)
                    xs.append((rope(kp_c, ang) if post else turned(kp_c, inv_freq, tile))[:, P:])
                ev, vec = basis_from(torch.cat(xs, 1))
            else:
                layer = model.model.layers[li]
                wk = (layer.self_attn.k_proj.weight.float() * layer.input_layernorm.weight.float()).view(nkv, d, -1)
                ev, vec = torch.linalg.eigh(wk @ wk.transpose(-1, -2))
                ev, vec = ev.flip(-1).clamp_min(1e-10), vec.flip(-1)
            xh = code_in_basis(x, ev, vec, LAYOUTS[layout])
            back = rope(xh, -ang if post else -tile_offset(pos, tile)[:, None] * inv_freq[None])
            recon[v] = rope(back + mu, ang)
        full = torch.ones(T, T).tril().bool()
        past_first = full.clone()
        past_first[:, :P] = False
        g = nq // nkv
        for v, kh in recon.items():
            kh = kh.clone()
            kh[:, 0] = k[:, 0]
            kl_sum = err_sum = 0.0
            for hq in range(nq):
                lg = q[hq] @ k[hq // g].T / math.sqrt(d)
                lh = q[hq] @ kh[hq // g].T / math.sqrt(d)
                p = torch.softmax(lg.masked_fill(~full, -1e30), -1)
                logph = torch.log_softmax(lh.masked_fill(~full, -1e30), -1)
                kl = (p * (torch.log(p.clamp_min(1e-30)) - logph)).masked_fill(~full, 0).sum(-1)[4 * P:].mean()
                kl_sum += float(kl)
                err_sum += float(((lg - lh)[past_first] ** 2).mean())
            res[v].append({"attention_kl": kl_sum / nq, "logit_err2": err_sum / nq})
        print(f"layer {li}: " + " ".join(f"{r[-1]['attention_kl']:.4f}" for r in res.values()), flush=True)
    summary = {v: {m: sum(r[m] for r in rows) / len(rows) for m in ("attention_kl", "logit_err2")}
               for v, rows in res.items()}
    print(f"\nSmolLM2-135M-Instruct, {T} tokens, {n_layers} layers, {args.calib_windows} calibration window(s)")
    print("| keys (26 B per key at d = 64 except the 4-bit row) | attention KL | logit err^2 |\n|---|---:|---:|")
    for v, s in summary.items():
        print(f"| {v} | {s['attention_kl']:.4f} | {s['logit_err2']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv[1:]), "torch": torch.__version__,
                                               "summary": summary, "per_layer": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
"""Would a variance-based channel split help 3-bit keys? Attention error of SmolLM2's centred keys (CPU).

One WikiText-2 window of T tokens (argument, default 1024) through SmolLM2-135M-Instruct; per layer and KV head
the post-RoPE queries and keys. Keys are centred before RoPE as the serving kernels do (mean of tokens 1-15,
per-token exact here). Variants, each a random rotation + Lloyd-Max codebook with norm correction:
u3 / u4 (uniform 3 / 4 bits), split_prefix / split_oracle (the RoPE pairs holding the most energy of the
centred keys, half of them, at 4 bits and the rest at 2: 3 bits on average, one norm per half; energies from
tokens 1-15 / from all tokens), split_w3 (the same halves at 3 bits each: the cost of the second norm alone),
u3_nocenter. Printed: mean squared logit error over keys past the first 16, and the mean KL of the attention
rows (query heads, positions 64+) against full precision; then per layer for u3, u4 and the splits.
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval-ppl-cpu" / "key-research"))
from key_variants import apply_rope, layers_of

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.integrations.models import load_model
from turboquant_core.integrations.perplexity import read_text, token_windows

torch.set_num_threads(2)
torch.manual_seed(0)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
model = loaded.model
cfg = model.config
text, _ = read_text(None)
ids = token_windows(loaded.tokenizer, text, T, 1)[0][None]
d = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
cap = {}


def hk(i, name, n):
    def h(m, a, o):
        cap[(i, name)] = o[0].float().view(o.shape[1], n, d).transpose(0, 1)

    return h


def hr(i):
    def h(m, a, kw):
        c, s = kw["position_embeddings"]
        cap[(i, "rope")] = (c[0].float(), s[0].float())

    return h


for i, L in enumerate(layers_of(model)):
    L.self_attn.q_proj.register_forward_hook(hk(i, "q", nq))
    L.self_attn.k_proj.register_forward_hook(hk(i, "k", nkv))
    L.self_attn.register_forward_pre_hook(hr(i), with_kwargs=True)
with torch.inference_mode():
    model(ids)
rots = {}


def Q(x, bits, seed):
    n = x.shape[-1]
    if (n, seed) not in rots:
        g = torch.Generator().manual_seed(seed)
        rots[(n, seed)] = torch.linalg.qr(torch.randn(n, n, generator=g))[0]
    R = rots[(n, seed)]
    nrm = x.norm(dim=-1, keepdim=True)
    t = x @ R.T * math.sqrt(n) / nrm.clamp_min(1e-12)
    cent, bnd = codebook_tensors(bits, n, "cpu")
    c = cent[torch.bucketize(t.contiguous(), bnd)]
    sc = nrm / c.norm(dim=-1, keepdim=True)
    return (c * sc) @ R


def split(kc, pe, bits_top, bits_rest):
    """Per KV head of kc [Hkv, T, d]: the half of the RoPE pairs with the most energy pe [Hkv, d/2] at
    bits_top, the rest at bits_rest, each half its own rotation and norm."""
    half = kc.shape[-1] // 2
    r = torch.empty_like(kc)
    for h in range(kc.shape[0]):
        top = torch.zeros(half, dtype=torch.bool)
        top[pe[h].argsort(descending=True)[: half // 2]] = True
        ch = torch.cat([top, top])
        r[h][:, ch] = Q(kc[h][:, ch], bits_top, 2)
        r[h][:, ~ch] = Q(kc[h][:, ~ch], bits_rest, 3)
    return r


P = 16
res = {k: [] for k in ["u3", "u4", "split_prefix", "split_oracle", "split_w3", "u3_nocenter"]}
half = d // 2
for i in range(cfg.num_hidden_layers):
    q_pre, k_pre = cap[(i, "q")], cap[(i, "k")]
    cos, sin = cap[(i, "rope")]
    q = apply_rope(q_pre, cos, sin)
    k = apply_rope(k_pre, cos, sin)
    mu = k_pre[:, 1:P].mean(1, keepdim=True)
    kc_pre = k_pre - mu
    kc = apply_rope(kc_pre.expand_as(k_pre).contiguous(), cos, sin)
    shift = k - kc  # RoPE_t(mu)
    e_pref = (kc_pre[:, 1:P] ** 2).mean(1)
    e_all = (kc_pre[:, P:] ** 2).mean(1)
    pe_pref = e_pref[:, :half] + e_pref[:, half:]
    pe_all = e_all[:, :half] + e_all[:, half:]
    recon = {}
    recon["u3"] = Q(kc, 3, 1) + shift
    recon["u4"] = Q(kc, 4, 1) + shift
    recon["u3_nocenter"] = Q(k, 3, 1)

    recon["split_prefix"] = split(kc, pe_pref, 4, 2) + shift
    recon["split_oracle"] = split(kc, pe_all, 4, 2) + shift
    recon["split_w3"] = split(kc, pe_pref, 3, 3) + shift  # two halves of 32 with own norms: the cost of the extra norm
    g = nq // nkv
    mask = torch.ones(T, T).tril().bool()
    mask[:, :P] = False  # keys past the first page
    for name, kh in recon.items():
        kl_tot = 0.0
        err_tot = 0.0
        for hq in range(nq):
            h = hq // g
            lg = q[hq] @ k[h].T / math.sqrt(d)
            lh = q[hq] @ kh[h].T / math.sqrt(d)
            full = torch.ones(T, T).tril().bool()
            p = torch.softmax(lg.masked_fill(~full, -1e30), -1)
            ph = torch.log_softmax(lh.masked_fill(~full, -1e30), -1)
            rows = slice(P * 4, T)
            kl = (p * (torch.log(p.clamp_min(1e-30)) - ph)).masked_fill(~full, 0).sum(-1)[rows].mean()
            err_tot += float(((lg - lh)[mask] ** 2).mean())
            kl_tot += float(kl)
        res[name].append((err_tot / nq, kl_tot / nq))
print(f"T={T}")
for name, v in res.items():
    e = sum(a for a, _ in v) / len(v)
    kl = sum(b for _, b in v) / len(v)
    print(f"{name:14s} logit err^2 {e:.5f}  attn KL {kl:.5f}")
for name in ["u3", "u4", "split_prefix", "split_oracle"]:
    print(name, " ".join(f"{b:.4f}" for _, b in res[name][:30]))

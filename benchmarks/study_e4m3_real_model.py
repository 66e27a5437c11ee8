# SPDX-License-Identifier: Apache-2.0
"""Study: would e4m3 tensor-core operands in decode attention keep a real model's quality?

SmolLM2-135M-Instruct (the bundled GGUF), WikiText-2 sample, 8 windows of 512 tokens, the strict regime of
``tq eval-ppl`` (every position attends to the quantized K/V of itself and all earlier positions: what a decode step
sees), keys not centred (so that every rounded operand is exactly the one the kernel would round). Attention is
computed here in float32 with the kernel's operands rounded as an e4m3 kernel would round them:

- ``fp16``: no e4m3 rounding (the shipped kernel's fp16 operands are within 0.1 % of this, per the synthetic study);
- ``k``: the key codebook in e4m3, the query exact (as a query split into two e4m3 terms, hi + lo, would be to
  about 2^-8: two score products instead of one);
- ``qk``: the rotated query (R_K q, one scale per row) and the key codebook in e4m3, as an e4m3 score product;
- ``all``: also the value codebook and the probabilities times the value scale (one power-of-two scale per row).

Against a full-precision cache: perplexity change, KL(baseline || variant) per token and top-1 agreement.

    python benchmarks/study_e4m3_real_model.py --presets turboquant_k3v4_nc turboquant_4bit_nc --out e4m3.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turboquant_core import quantizer  # noqa: E402
from turboquant_core.codebooks import codebook_tensors  # noqa: E402
from turboquant_core.formats import get_format  # noqa: E402
from turboquant_core.rotation import rotate, unrotate  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
STATE = {"mode": "none", "key_seed": 0}


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(E4M3).float()


def e4m3_rows(x: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row (last dim) that maps the row's largest magnitude to at most 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    scale = E4M3_MAX / amax
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return e4m3(x * scale) / scale


_rotated_values = quantizer.MSEQuantizer.rotated_values


def rotated_values(self, q):
    """scale * c[idx] with the codebook rounded to e4m3 where the mode rounds it (keys: qk, all; values: all)."""
    mode = STATE["mode"]
    is_key = self.seed == STATE["key_seed"]
    if mode == "none" or mode == "fp16" or (mode in ("k", "qk") and not is_key):
        return _rotated_values(self, q)
    parts, start = [], 0
    for n, b in self.segments:
        cent, _ = codebook_tensors(b, self.dim, q.idx.device)
        parts.append(e4m3(cent)[q.idx[..., start : start + n].long()])
        start += n
    return torch.cat(parts, dim=-1) * q.scale.unsqueeze(-1)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention in float32, GQA by repetition, with the mode's e4m3 roundings of the query and the
    probabilities (the codebooks are rounded where the cache decodes them)."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    g = hq // hkv
    q = query.float()
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    mode = STATE["mode"]
    if mode in ("qk", "all"):
        q = unrotate(e4m3_rows(rotate(q, STATE["key_seed"])), STATE["key_seed"])
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * (scaling if scaling is not None else d ** -0.5)
    pos = tk - tq + torch.arange(tq, device=q.device)
    s = s.masked_fill(torch.arange(tk, device=q.device)[None, :] > pos[:, None], float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if mode == "all":
        # The kernel multiplies p by each token's value scale before the product; the value rows' norms stand in
        # for those scales (a value row is its scale times a codebook vector of norm about sqrt(d)).
        vs = (v.norm(dim=-1) / math.sqrt(d)).clamp_min(1e-30)[:, :, None, :]
        p = e4m3_rows(p * vs, pow2=True) / vs
    out = torch.einsum("bhqk,bhkd->bhqd", p, v) / denom
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["turboquant_k3v4_nc", "turboquant_4bit_nc"])
    ap.add_argument("--modes", nargs="+", default=["fp16", "k", "qk", "all"])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from transformers import AttentionInterface, DynamicCache

    from turboquant_core.integrations.models import load_model
    from turboquant_core.integrations.perplexity import read_text, token_windows
    from turboquant_core.integrations.transformers_cache import TurboQuantCache, cache_kwargs

    torch.manual_seed(0)
    quantizer.MSEQuantizer.rotated_values = rotated_values
    AttentionInterface.register("tq_e4m3_study", attention)
    loaded = load_model(dtype=torch.float32)
    model = loaded.model
    model.set_attn_implementation("tq_e4m3_study")
    text, label = read_text(None)
    windows = token_windows(loaded.tokenizer, text, args.window, args.windows)
    cells = [(p, m) for p in args.presets for m in args.modes]
    acc = {c: dict(nll=0.0, kl=0.0, agree=0, tokens=0) for c in [("bf16", "none")] + cells}
    t0 = time.perf_counter()
    with torch.no_grad():
        for w, row in enumerate(windows):
            ids = row.unsqueeze(0)
            targets = ids[0, 1:]
            STATE["mode"] = "none"
            base = model(input_ids=ids, **cache_kwargs(model, DynamicCache(config=model.config)),
                         use_cache=True).logits[0, :-1].float()
            blp = torch.log_softmax(base, dim=-1)
            for cell in [("bf16", "none")] + cells:
                preset, mode = cell
                if preset == "bf16":
                    lp = blp
                else:
                    STATE["mode"], STATE["key_seed"] = mode, get_format(preset).key_seed
                    cache = TurboQuantCache(model.config, preset=preset, key_centering=None, fresh_full_precision=False)
                    lp = torch.log_softmax(model(input_ids=ids, **cache_kwargs(model, cache),
                                                 use_cache=True).logits[0, :-1].float(), dim=-1)
                a = acc[cell]
                a["nll"] += float(-lp.gather(-1, targets[:, None]).double().sum())
                a["kl"] += float((blp.exp() * (blp - lp)).sum(-1).double().sum())
                a["agree"] += int((lp.argmax(-1) == blp.argmax(-1)).sum())
                a["tokens"] += targets.numel()
            print(f"window {w + 1}/{len(windows)} {time.perf_counter() - t0:.0f} s", flush=True)
    base_ppl = math.exp(acc[("bf16", "none")]["nll"] / acc[("bf16", "none")]["tokens"])
    rows = []
    for (preset, mode), a in acc.items():
        ppl = math.exp(a["nll"] / a["tokens"])
        rows.append(dict(preset=preset, mode=mode, ppl=ppl, ppl_change_pct=100 * (ppl / base_ppl - 1),
                         kl=a["kl"] / a["tokens"], top1=a["agree"] / a["tokens"], tokens=a["tokens"]))
        print(f"{preset:22s} {mode:5s} ppl {ppl:8.3f} ({rows[-1]['ppl_change_pct']:+6.2f} %) "
              f"KL {rows[-1]['kl']:.4f} top1 {rows[-1]['top1']:.3f}")
    args.out.write_text(json.dumps(dict(command=" ".join(sys.argv), model=loaded.source, text=label,
                                        window=args.window, windows=len(windows), rows=rows), indent=1))


if __name__ == "__main__":
    main()

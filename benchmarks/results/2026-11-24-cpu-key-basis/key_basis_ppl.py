# SPDX-License-Identifier: Apache-2.0
"""Perplexity and KL of SmolLM2 with 3-bit keys in a calibrated pre-RoPE basis, next to the served encodings (CPU).

Same scoring as ``tq eval-ppl`` (``turboquant_core.integrations.perplexity``): non-overlapping windows of the
text, a full-precision baseline per window, KL(baseline || cache) per scored token, top-1 agreement; two
regimes, chunked prefill of 256 tokens (the tokens of a chunk attend to each other exactly, as served) and
decode (every position attends to the encoded K/V: the strict bound). Caches:

- ``turboquant_k3v4_nc`` / ``turboquant_k4v3_nc`` / ``turboquant_4bit_nc``: the library's ``TurboQuantCache``,
  the bytes and key centring the patched vLLM serves;
- ``k3v4, exact centre``: the control, the served quantizer on keys centred per token as the key basis
  code centres them (``key_basis.ExactCentreCoder``);
- ``k3v4, key basis (tile T, 4/2)``: the same cache (values, first page), with the keys past the first page
  read back from the key-basis code (``key_basis.py``) at the bytes of a 3-bit key (26 B at d = 64).

The basis is calibrated on windows of the same text that are not scored (the text's last ``--calib-windows``
windows of 1024 tokens); scored windows are the first ``--windows`` of ``--window`` tokens.

Usage: python key_basis_ppl.py --text PATH [--windows 16] [--window 512]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from key_basis import ExactCentreCoder, KeyBasis, KeyBasisCache, capture
from tqdm import tqdm
from transformers import DynamicCache

from turboquant_core.integrations.models import load_model
from turboquant_core.integrations.perplexity import read_text, token_windows
from turboquant_core.integrations.transformers_cache import TurboQuantCache, key_centering_for_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=None, help="text file (default: the bundled WikiText-2 excerpt)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-windows", type=int, default=4)
    ap.add_argument("--tiles", default="0,16,64")
    ap.add_argument("--prefill-chunks", default="256,0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    inv_freq = model.model.rotary_emb.inv_freq.float()
    text, source = read_text(args.text)
    scored = token_windows(tok, text, args.window, args.windows)
    long = token_windows(tok, text, 1024, None)
    calib = long[-args.calib_windows:]
    if len(long) - args.calib_windows < args.windows * args.window / 1024:
        ap.error("the text is too short to keep calibration and scored windows apart")
    bases = {t: KeyBasis(inv_freq, t, "4/2") for t in (int(x) for x in args.tiles.split(","))}
    for w in tqdm(calib, desc="calibrate"):
        keys = capture(model, w[None], d, cfg.num_attention_heads, cfg.num_key_value_heads)
        for layer, (_, k_pre) in keys.items():
            for b in bases.values():
                b.add(layer, k_pre)
    for b in bases.values():
        b.finish()
    centering = key_centering_for_model(model)
    names = ["turboquant_k3v4_nc", "k3v4, exact centre"] + [f"k3v4, key basis (tile {t}, 4/2)" for t in bases] + [
        "turboquant_k4v3_nc", "turboquant_4bit_nc"]
    results = {}
    for chunk in (int(c) for c in args.prefill_chunks.split(",")):
        first = chunk
        acc = {n: {"nll": 0.0, "kl": 0.0, "agree": 0, "tokens": 0} for n in ["full precision"] + names}
        for row in tqdm(scored, desc=f"prefill chunk {chunk}"):
            ids = row[None]
            targets = ids[0, first + 1:]
            base = torch.log_softmax(model(ids, past_key_values=DynamicCache(config=cfg)).logits[0, first:-1], -1)
            acc["full precision"]["nll"] += float(-base.gather(-1, targets[:, None]).sum())
            acc["full precision"]["tokens"] += targets.numel()
            for n in names:
                preset = n if n.startswith("turboquant") else "turboquant_k3v4_nc"
                kw = dict(preset=preset, key_centering=centering, fresh_full_precision=chunk > 0)
                if n.startswith("turboquant"):
                    cache = TurboQuantCache(cfg, **kw)
                elif n.endswith("exact centre"):
                    cache = KeyBasisCache(cfg, basis=ExactCentreCoder(inv_freq), fresh=chunk > 0, **kw)
                else:
                    cache = KeyBasisCache(cfg, basis=bases[int(n.split("tile ")[1].split(",")[0])],
                                          fresh=chunk > 0, **kw)
                if chunk == 0:
                    logits = model(ids, past_key_values=cache).logits[0, :-1]
                else:
                    logits = torch.cat([model(ids[:, s:s + chunk], past_key_values=cache).logits[0]
                                        for s in range(0, ids.shape[1], chunk)])[first:-1]
                logp = torch.log_softmax(logits, -1)
                a = acc[n]
                a["nll"] += float(-logp.gather(-1, targets[:, None]).sum())
                a["kl"] += float((base.exp() * (base - logp)).sum())
                a["agree"] += int((logp.argmax(-1) == base.argmax(-1)).sum())
                a["tokens"] += targets.numel()
        ppl0 = math.exp(acc["full precision"]["nll"] / acc["full precision"]["tokens"])
        rows = {}
        for n, a in acc.items():
            ppl = math.exp(a["nll"] / a["tokens"])
            rows[n] = {"ppl": ppl, "d_ppl_pct": 100 * (ppl / ppl0 - 1), "kl": a["kl"] / a["tokens"],
                       "top1": a["agree"] / a["tokens"] if n != "full precision" else 1.0, "tokens": a["tokens"]}
        results[f"prefill chunk {chunk}" if chunk else "decode (strict)"] = rows
        print(f"\n{'prefill chunk ' + str(chunk) if chunk else 'decode (strict)'}: {len(scored)} x {args.window}")
        print("| cache | ppl | d ppl | KL | top-1 |\n|---|---:|---:|---:|---:|")
        for n, r in rows.items():
            print(f"| {n} | {r['ppl']:.3f} | {r['d_ppl_pct']:+.2f} % | {r['kl']:.4f} | {100 * r['top1']:.2f} % |")
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv[1:]), "text": source,
                                           "torch": torch.__version__, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
"""NIAH at 2k on SmolLM2: served 3-bit keys against 3-bit keys in a calibrated pre-RoPE basis (CPU).

Regime as served by the patched vLLM with ``--prefill-chunk 0`` (the run where ``turboquant_k3v4_nc`` found
91/100 at 2k against bf16's 99): the prompt is prefilled in one step (it attends to itself exactly), then
greedy decode steps read every earlier token through the cache. Caches: ``served`` is the library's
``TurboQuantCache`` with ``turboquant_k3v4_nc`` (the served bytes and key centring); ``exact centre`` is the
served quantizer on keys centred per token (``key_basis.ExactCentreCoder``, the control); ``key basis`` is the
same cache with the keys past the first page read back from the key-basis code (``key_basis.py``; tile and
bit layout from the options) at the same bytes. The basis is calibrated on the bundled WikiText-2 excerpt
(``--calib-windows`` windows of 1024 tokens); the haystack is the suite's synthetic word list, another text.
Prompts: the suite's generator (``tq_eval``), seed 0, the samples asked for at every depth, or ``--cells``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from key_basis import ExactCentreCoder, KeyBasis, KeyBasisCache, capture
from tqdm import tqdm
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.integrations.models import load_model  # noqa: E402
from turboquant_core.integrations.perplexity import read_text, token_windows  # noqa: E402
from turboquant_core.integrations.transformers_cache import (  # noqa: E402
    TurboQuantCache,
    key_centering_for_model,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20, help="samples per depth")
    ap.add_argument("--cells", default="", help="sample:depth list instead, e.g. 0:25,5:25")
    ap.add_argument("--variants", default="served,key basis",
                    help="from: full precision, served, exact centre, key basis")
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--layout", default="4/3/2")
    ap.add_argument("--calib-windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    basis = KeyBasis(model.model.rotary_emb.inv_freq.float(), args.tile, args.layout)
    text, _ = read_text(None)
    with torch.inference_mode():
        for w in token_windows(tok, text, 1024, args.calib_windows):
            for layer, (_, k_pre) in capture(model, w[None], d, cfg.num_attention_heads,
                                             cfg.num_key_value_heads).items():
                basis.add(layer, k_pre)
    basis.finish()
    centering = key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    cells = {(int(c.split(":")[0]), float(c.split(":")[1])) for c in args.cells.split(",") if c}
    n = max(s for s, _ in cells) + 1 if cells else args.samples
    grid = niah_mod.make_grid(lambda t: len(encode(t)), [args.length], niah_mod.DEFAULT_DEPTHS, n, seed=0,
                              render=render, target_tokens={args.length: args.length})
    samples = [s for s in grid if not cells or (s.sample, float(s.depth_percent)) in cells]
    variants = args.variants.split(",")
    records, t0 = [], time.time()
    with torch.inference_mode():
        for s in tqdm(samples, desc=f"NIAH {args.length}"):
            ids = torch.tensor([encode(s.prompt)])
            for name in variants:
                kw = dict(preset="turboquant_k3v4_nc", key_centering=centering)
                if name == "full precision":
                    cache = DynamicCache(config=cfg)
                elif name == "served":
                    cache = TurboQuantCache(cfg, **kw)
                else:
                    coder = basis if name == "key basis" else ExactCentreCoder(basis.inv_freq)
                    cache = KeyBasisCache(cfg, basis=coder, fresh=True, **kw)
                logits = model(ids, past_key_values=cache).logits[0, -1]
                for layer in getattr(cache, "layers", []):  # decode steps read their own K/V from the cache
                    if hasattr(layer, "fresh_full_precision"):
                        layer.fresh_full_precision = False
                if isinstance(cache, KeyBasisCache):
                    cache.fresh = False
                out = [int(logits.argmax())]
                for _ in range(9):
                    out.append(int(model(torch.tensor([[out[-1]]]), past_key_values=cache).logits[0, -1].argmax()))
                    if out[-1] == tok.eos_token_id:
                        break
                answer = tok.decode(out, skip_special_tokens=True)
                records.append({"variant": name, "sample": s.sample, "depth_percent": s.depth_percent,
                                "needle": s.needle, "answer": answer[:40],
                                "correct": niah_mod.score_answer(answer, s.needle)})
    summary = {v: f"{sum(r['correct'] for r in records if r['variant'] == v)}/{len(samples)}" for v in variants}
    out = {"length": args.length, "tile": args.tile, "layout": args.layout, "calib_windows": args.calib_windows,
           "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "command": " ".join(sys.argv[1:]),
           "summary": summary, "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

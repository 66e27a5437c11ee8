# SPDX-License-Identifier: Apache-2.0
"""NIAH prompts that 3-bit keys miss: would keeping the most recent tokens' K/V exact recover them? (CPU)

vLLM with ``turboquant_k3v4_nc`` on SmolLM2 misses 9 of 100 needles at 2k with the prompt prefilled whole
(``eval/results/smollm2-135m-instruct/2026-11-24-h200-niah-whole-prefill/``), bf16 1. Most misses drop the last
digit while copying the number. Decode steps read every earlier token through the cache, the answer digits
just written included; a KIVI-style window of the last W tokens kept exact would give those steps exact
recent keys. Does it recover the misses?

Regime as served by the patched vLLM with ``--prefill-chunk 0``: the prompt is prefilled in one step (it
attends to itself in full precision), then greedy decode steps read everything through the library's
``TurboQuantCache`` (the served bytes, key centering on). "+ recent W": attention reads the last W positions
(prompt tail and answer so far) exactly. Prompts: the suite's generator (``tq_eval``), seed 0, picked by
(sample, depth) with ``--cells`` or taken from a vLLM run's misses with ``--misses-of RESULT_JSON``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.integrations.models import load_model  # noqa: E402
from turboquant_core.integrations.transformers_cache import (  # noqa: E402
    TurboQuantCache,
    key_centering_for_model,
)


class RecentExactCache(TurboQuantCache):
    """``TurboQuantCache`` whose readers see the last ``window`` positions' K/V exactly."""

    def __init__(self, *args, window: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.window, self.exact = window, {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        keys, values = super().update(key_states, value_states, layer_idx, cache_kwargs)
        k0, v0 = self.exact.get(layer_idx, (key_states[..., :0, :], value_states[..., :0, :]))
        k0 = torch.cat([k0, key_states], dim=-2)[..., -self.window:, :]
        v0 = torch.cat([v0, value_states], dim=-2)[..., -self.window:, :]
        self.exact[layer_idx] = (k0, v0)
        w = k0.shape[-2]
        keys, values = keys.clone(), values.clone()
        keys[..., -w:, :] = k0
        values[..., -w:, :] = v0
        return keys, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--windows", default="0,16", help="recent windows to try (0: the served encoding)")
    ap.add_argument("--cells", default="", help="sample:depth list, e.g. 0:25,5:25")
    ap.add_argument("--misses-of", default=None, help="a vLLM result.json: its missed prompts at --length")
    ap.add_argument("--full-precision", action="store_true", help="also run a full-precision cache")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cells = {(int(c.split(":")[0]), float(c.split(":")[1])) for c in args.cells.split(",") if c}
    if args.misses_of:
        res = json.loads(Path(args.misses_of).read_text())
        cells |= {(r["sample"], float(r["depth_percent"])) for r in res["tasks"]["niah"]["records"]
                  if r["length"] == args.length and not r["correct"]}
    if not cells:
        ap.error("no prompts: give --cells or --misses-of")
    loaded = load_model(args.model, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    grid = niah_mod.make_grid(lambda t: len(encode(t)), [args.length], niah_mod.DEFAULT_DEPTHS,
                              max(s for s, _ in cells) + 1, seed=0, render=render,
                              target_tokens={args.length: args.length})
    samples = [s for s in grid if (s.sample, float(s.depth_percent)) in cells]
    variants = (["full precision"] if args.full_precision else []) + [
        f"{args.preset}" + (f" + recent {w}" if int(w) else "") for w in args.windows.split(",")]
    records, t0 = [], time.time()
    with torch.inference_mode():
        for s in tqdm(samples, desc=f"NIAH {args.length}"):
            ids = torch.tensor([encode(s.prompt)])
            for name in variants:
                if name == "full precision":
                    c = DynamicCache(config=model.config)
                else:
                    w = int(name.split("recent ")[1]) if "recent" in name else 0
                    kw = dict(preset=args.preset, key_centering=centering, fresh_full_precision=True)
                    c = RecentExactCache(model.config, window=w, **kw) if w else TurboQuantCache(model.config, **kw)
                lg = model(ids, past_key_values=c).logits[0, -1]
                for layer in getattr(c, "layers", []):  # decode steps read their own K/V from the cache
                    if hasattr(layer, "fresh_full_precision"):
                        layer.fresh_full_precision = False
                out_ids = [int(lg.argmax())]
                for _ in range(9):
                    out_ids.append(int(model(torch.tensor([[out_ids[-1]]]), past_key_values=c).logits[0, -1].argmax()))
                    if out_ids[-1] == tok.eos_token_id:
                        break
                answer = tok.decode(out_ids, skip_special_tokens=True)
                records.append({"variant": name, "sample": s.sample, "depth_percent": s.depth_percent,
                                "num_tokens": ids.shape[1], "needle": s.needle, "answer": answer[:40],
                                "correct": niah_mod.score_answer(answer, s.needle)})
    summary = {v: f"{sum(r['correct'] for r in records if r['variant'] == v)}/{len(samples)}" for v in variants}
    out = {"model": args.model, "length": args.length, "preset": args.preset, "cells": sorted(cells),
           "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "command": " ".join(sys.argv[1:]),
           "summary": summary, "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
"""NIAH at 2k on the CPU with the served key encoding, with and without the first token's K/V exact.

Question: the served key centering (``turboquant_core.ops.key_centering``: first page plain, page-constant
centre from its decoded keys) brought ``turboquant_k3v4_nc`` to 93/100 at 2k in vLLM against bf16's 99/100.
The CPU study before it (``../2026-11-23-cpu-niah-key-variants/``) had 96/100 for exact per-token centering
*plus the first token's K/V in full precision* (an attention sink), which the served encoding lacks. Is the
sink the missing part? The first token of a chat prompt is the same token at the same position in every
request, so its K/V are the same in every request: an engine could keep one exact copy per layer.

Same regime, prompts and scoring as ``../2026-11-23-cpu-niah-key-variants/niah_key_variants.py``: prefill in
chunks of 256 tokens (a chunk attends to itself in full precision and to the earlier chunks through the
cache), decode steps attend to everything stored, themselves included. The cache is the library's
``TurboQuantCache`` (the served bytes); "+ sink" replaces what attention reads at position 0 by the exact K/V.

    python niah_served_sink.py --samples 10 --json niah-2048-served-sink.json
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

VARIANTS = ("full precision", "k3v4 served", "k3v4 served + sink", "4bit served", "4bit served + sink",
            "k4v3 served")
PRESETS = {"k3v4": "turboquant_k3v4_nc", "4bit": "turboquant_4bit_nc", "k4v3": "turboquant_k4v3_nc"}


class SinkCache(TurboQuantCache):
    """``TurboQuantCache`` whose readers see position 0 exactly (its K/V as the first chunk brought them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink = {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        first = self.layers[layer_idx].get_seq_length() == 0
        keys, values = super().update(key_states, value_states, layer_idx, cache_kwargs)
        if first:
            self.sink[layer_idx] = (key_states[..., :1, :].clone(), value_states[..., :1, :].clone())
        sk, sv = self.sink[layer_idx]
        keys, values = keys.clone(), values.clone()
        keys[..., :1, :] = sk
        values[..., :1, :] = sv
        return keys, values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=10, help="samples per depth")
    ap.add_argument("--first-sample", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [v.strip() for v in args.variants.split(",")]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
    loaded = load_model(args.model, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    samples = niah_mod.make_grid(lambda t: len(encode(t)), [args.length], niah_mod.DEFAULT_DEPTHS, args.samples,
                                 seed=0, render=render, target_tokens={args.length: args.length - 17},
                                 first_sample=args.first_sample)
    records, t0 = [], time.time()
    with torch.inference_mode():
        for s in tqdm(samples, desc=f"NIAH {args.length}"):
            ids = torch.tensor([encode(s.prompt)])
            n = ids.shape[1]
            for name in names:
                if name == "full precision":
                    c = DynamicCache(config=model.config)
                    lg = model(ids, past_key_values=c).logits[0, -1]
                else:
                    preset = PRESETS[name.split()[0]]
                    cls = SinkCache if name.endswith("+ sink") else TurboQuantCache
                    c = cls(model.config, preset=preset, key_centering=centering, fresh_full_precision=True)
                    for c0 in range(0, n, args.chunk):
                        lg = model(ids[:, c0:c0 + args.chunk], past_key_values=c).logits[0, -1]
                    for layer in c.layers:  # decode steps read their own K/V from the cache, as served
                        layer.fresh_full_precision = False
                nxt = int(lg.argmax())
                out_ids = [nxt]
                for _ in range(9):
                    nxt = int(model(torch.tensor([[nxt]]), past_key_values=c).logits[0, -1].argmax())
                    out_ids.append(nxt)
                    if nxt == tok.eos_token_id:
                        break
                answer = tok.decode(out_ids, skip_special_tokens=True)
                records.append({"variant": name, "length": args.length, "depth_percent": s.depth_percent,
                                "sample": s.sample, "num_tokens": n, "needle": s.needle, "answer": answer[:40],
                                "correct": niah_mod.score_answer(answer, s.needle)})
    summary = {name: {"correct": sum(r["correct"] for r in records if r["variant"] == name),
                      "n": sum(1 for r in records if r["variant"] == name)} for name in names}
    out = {"model": args.model, "length": args.length, "prefill_chunk": args.chunk,
           "samples_per_depth": args.samples, "first_sample": args.first_sample,
           "depths": list(niah_mod.DEFAULT_DEPTHS), "seconds": round(time.time() - t0, 1),
           "torch": torch.__version__, "command": " ".join(sys.argv[1:]), "summary": summary, "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for name in names:
        print(f"| {name} | {summary[name]['correct']}/{summary[name]['n']} |")


if __name__ == "__main__":
    main()

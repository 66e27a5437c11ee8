# SPDX-License-Identifier: Apache-2.0
"""NIAH on SmolLM2 with 3-bit keys in a circular trellis code (CPU simulation, served bytes otherwise).

The library's ``TurboQuantCache`` (``turboquant_k3v4_nc``: key centring, norm correction, 4-bit values) with the
3-bit key codebook replaced by the trellis code of ``trellis_sim.py`` (``sim-table.json``). The cache holds the
keys' reconstruction instead of their bytes; the arithmetic is the same. Regime: the prompt is prefilled whole in
full precision, then greedy decode steps read everything through the cache (vLLM with ``--prefill-chunk 0``).
Prompts: the suite's generator, seed 0, ``--samples`` per depth; ``--part/--parts`` take every parts-th prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.integrations import transformers_cache as tc  # noqa: E402
from turboquant_core.integrations.models import load_model  # noqa: E402

VARIANTS = ("trellis",)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trellis_sim import load_table, quantize_dequantize  # noqa: E402

from turboquant_core.rotation import rotate, unrotate  # noqa: E402

_ENC, _DEC = tc.encode_component, tc.decode_component


def patch_store(variant: str) -> None:
    """3-bit key components through the trellis code (same rotation, norm correction, centring and values)."""
    table = load_table()

    def enc(component, x, seed):
        if component.kind == "fp8" or component.bits != 3:
            return _ENC(component, x, seed)
        d = x.shape[-1]
        xf = x.float()
        norm = xf.norm(dim=-1)
        t = rotate(xf, seed)
        s = t * torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))[..., None]
        r = quantize_dequantize(s.reshape(-1, d), table).reshape(s.shape)
        scale = (norm / r.norm(dim=-1).clamp_min(1e-12)).half().float()
        return unrotate(r * scale[..., None], seed), torch.ones(x.shape[:-1])  # the reconstruction itself

    def dec(component, codes, scale, head_dim, seed, dtype):
        if codes.is_floating_point():
            return codes.to(dtype)
        return _DEC(component, codes, scale, head_dim, seed, dtype)

    tc.encode_component, tc.decode_component = enc, dec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20, help="samples per depth")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    ap.add_argument("--part", type=int, default=0)
    ap.add_argument("--parts", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    patch_store(args.variant)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = tc.key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    grid = niah_mod.make_grid(lambda t: len(encode(t)), [args.length], niah_mod.DEFAULT_DEPTHS, args.samples,
                              seed=0, render=render, target_tokens={args.length: args.length})
    grid = grid[args.part::args.parts]
    records, t0 = [], time.time()
    with torch.inference_mode():
        for s in tqdm(grid, desc=f"NIAH {args.length} {args.variant}"):
            ids = torch.tensor([encode(s.prompt)])
            cache = tc.TurboQuantCache(model.config, preset="turboquant_k3v4_nc", key_centering=centering)
            logits = model(ids, past_key_values=cache).logits[0, -1]
            for layer in cache.layers:  # decode steps read their own K/V through the cache
                layer.fresh_full_precision = False
            out = [int(logits.argmax())]
            for _ in range(9):
                out.append(int(model(torch.tensor([[out[-1]]]), past_key_values=cache).logits[0, -1].argmax()))
                if out[-1] == tok.eos_token_id:
                    break
            answer = tok.decode(out, skip_special_tokens=True)
            records.append({"sample": s.sample, "depth_percent": s.depth_percent, "needle": s.needle,
                            "answer": answer[:40], "correct": niah_mod.score_answer(answer, s.needle)})
    found = sum(r["correct"] for r in records)
    out = {"variant": args.variant, "part": args.part, "parts": args.parts, "length": args.length, "found": found,
           "prompts": len(records),
           "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "command": " ".join(sys.argv[1:]),
           "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.variant}: {found}/{len(records)}")


if __name__ == "__main__":
    main()

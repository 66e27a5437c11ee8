# SPDX-License-Identifier: Apache-2.0
"""NIAH at 2k on SmolLM2 with the served 3-bit key quantizer: which part of the exact centre finds needles?

The exact centre (``../2026-11-24-cpu-key-basis/``, 94/100 against the served 91) differs from the served
key centring in two ways: (a) the centre of a key is RoPE_j(mu) for its own position j, not one RoPE_{m_p}
(rho mu) per page of 16; (b) mu is the mean of the exact pre-RoPE keys 1-15, not of the first page's decoded
bytes. This script runs the library's ``TurboQuantCache`` (``turboquant_k3v4_nc``, served bytes) with one of
the two factors changed, so the 2 x 2 table is complete:

- ``token centre``: (a) only. Needs no bytes beyond the format's (mu still comes from the first page).
- ``exact mu``: (b) only. Needs d numbers per sequence, layer and KV head outside the pages.
- ``both``: (a) and (b): the key-basis study's exact-centre control, here through the cache with the
  served quantizer's own rotation (that control drew another random rotation).

Regime: the prompt is prefilled whole in full precision, then greedy decode steps read everything through
the cache (vLLM with ``--prefill-chunk 0``). Prompts: the suite's generator, seed 0, 20 per depth.
"""

from __future__ import annotations

import argparse
import json
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
from turboquant_core.ops.key_centering import (  # noqa: E402
    _pair_index,
    center_sums_from_keys_ref,
    center_vectors_ref,
)

VARIANTS = ("served", "token centre", "exact mu", "both")


_SERVED = (tc.CompressedKVStore._compress, tc.CompressedKVStore._centers)


def _token_centers(self, positions):
    """RoPE_t(mu) for each position t (the served code: one RoPE_{m_p}(rho mu) per page)."""
    mu, mup = self.center
    c = self.centering
    f, _ = _pair_index(c.head_dim, c.rot_half, c.neox)
    rot, fi = f >= 0, f.clamp_min(0)
    ang = positions.double()[:, None] * c.theta.to(positions.device)[None]  # [n, rot_half]
    cos = torch.ones(positions.numel(), c.dim_pad, dtype=torch.float64, device=mu.device)
    sin = torch.zeros_like(cos)
    cos[:, : c.head_dim] = torch.where(rot[None], torch.cos(ang)[:, fi], 1.0)
    sin[:, : c.head_dim] = torch.where(rot[None], torch.sin(ang)[:, fi], 0.0)
    keep = (positions >= c.page).to(cos)[:, None]  # the first page is stored plain: no centre there
    return ((mu[:, :, None, :] * cos + mup[:, :, None, :] * sin) * keep)[..., : c.head_dim]


def _exact_mu_compress(self, keys, values):
    """mu from the exact keys 1..15 of the first page (the served code: from their decoded bytes)."""
    if self.center is None and self.compressed_tokens == 0 and keys.shape[2] >= self.centering.page:
        sums = center_sums_from_keys_ref(keys[:, :, : self.centering.page].float(), self.centering)
        self.center = center_vectors_ref(sums, self.centering)
    _SERVED[0](self, keys, values)


def patch_store(variant: str) -> None:
    """Set ``CompressedKVStore``'s centre for ``variant`` (``served``: the library's own)."""
    store = tc.CompressedKVStore
    store._compress = _exact_mu_compress if variant in ("exact mu", "both") else _SERVED[0]
    store._centers = _token_centers if variant in ("token centre", "both") else _SERVED[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=20, help="samples per depth")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    patch_store(args.variant)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = tc.key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    grid = niah_mod.make_grid(lambda t: len(encode(t)), [args.length], niah_mod.DEFAULT_DEPTHS, args.samples,
                              seed=0, render=render, target_tokens={args.length: args.length})
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
    out = {"variant": args.variant, "length": args.length, "found": found, "prompts": len(records),
           "seconds": round(time.time() - t0, 1), "torch": torch.__version__, "command": " ".join(sys.argv[1:]),
           "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{args.variant}: {found}/{len(records)}")


if __name__ == "__main__":
    main()

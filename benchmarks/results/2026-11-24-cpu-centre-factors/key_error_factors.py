# SPDX-License-Identifier: Apache-2.0
"""Why the centre's two factors move NIAH: the stored keys' error and the estimated mean's error (CPU).

For NIAH prompts at 2k (the suite's generator, seed 0), each variant of ``niah_centre_factors.py`` stores the
prompt through ``TurboQuantCache`` (``turboquant_k3v4_nc``); per layer and KV head the keys past the first page
are read back and compared with the exact keys (relative L2 error, and the error in the slow and the fast
half of the RoPE pairs), and the first page's decoded estimate of the pre-RoPE mean mu is compared with the
exact keys' one (per half).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from niah_centre_factors import ROOT, VARIANTS, patch_store
from transformers import DynamicCache

sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.integrations import transformers_cache as tc  # noqa: E402
from turboquant_core.integrations.models import load_model  # noqa: E402
from turboquant_core.ops.key_centering import center_sums_from_keys_ref, center_vectors_ref  # noqa: E402


def halves(x, d):
    """[..., d] -> norms of the fast half (pairs 0..d/4-1, both coordinates) and the slow half (rotate-half)."""
    h = d // 2
    fast = torch.cat([x[..., : h // 2], x[..., h: h + h // 2]], -1)
    slow = torch.cat([x[..., h // 2: h], x[..., h + h // 2:]], -1)
    return fast.norm(dim=-1), slow.norm(dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=5, help="prompts (one per depth, sample 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = tc.key_centering_for_model(model)
    d, P = centering.head_dim, centering.page
    render, encode, _ = niah_renderer(tok)
    grid = niah_mod.make_grid(lambda t: len(encode(t)), [2048], niah_mod.DEFAULT_DEPTHS, 1, seed=0, render=render,
                              target_tokens={2048: 2048})[: args.prompts]
    stats = {v: {"key_err": [], "key_err_fast": [], "key_err_slow": [], "mu_err_fast": [], "mu_err_slow": []}
             for v in VARIANTS}
    with torch.inference_mode():
        for s in grid:
            ids = torch.tensor([encode(s.prompt)])
            exact = DynamicCache(config=model.config)
            model(ids, past_key_values=exact)
            for v in VARIANTS:
                patch_store(v)
                cache = tc.TurboQuantCache(model.config, preset="turboquant_k3v4_nc", key_centering=centering)
                model(ids, past_key_values=cache)
                for li, layer in enumerate(cache.layers):
                    k = exact.layers[li].keys.double()[0]  # [H, T, d]
                    k_hat, _ = layer.store.states(torch.float64)
                    err = (k_hat[0] - k)[:, P:]
                    rel = err.norm(dim=-1) / k[:, P:].norm(dim=-1)
                    ef, es = halves(err, d)
                    kf, ks = halves(k[:, P:], d)
                    st = stats[v]
                    st["key_err"].append(rel.mean().item())
                    st["key_err_fast"].append((ef / kf).mean().item())
                    st["key_err_slow"].append((es / ks).mean().item())
                    mu_exact, _ = center_vectors_ref(center_sums_from_keys_ref(k[None, :, :P], centering), centering)
                    mu_used = layer.store.center[0]
                    mf, ms = halves((mu_used - mu_exact)[0, :, :d], d)
                    tf, ts = halves(mu_exact[0, :, :d], d)
                    st["mu_err_fast"].append((mf / tf).mean().item())
                    st["mu_err_slow"].append((ms / ts).mean().item())
    patch_store("served")
    table = {v: {k: round(sum(x) / len(x), 4) for k, x in st.items()} for v, st in stats.items()}
    out = {"prompts": len(grid), "length": 2048, "torch": torch.__version__, "command": " ".join(sys.argv[1:]),
           "mean over prompts, layers and KV heads": table}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

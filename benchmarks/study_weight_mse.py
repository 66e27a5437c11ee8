# SPDX-License-Identifier: Apache-2.0
"""Study: does a model's perplexity follow its weights' mean squared error, whatever made the error?

The decoder projections of a Hugging Face model are replaced, all at once, by their tq4 / tq3 reconstruction
(``ops.weight_codec``, the served format), by the round-to-nearest control at the same group size (``eval``'s
``rtn``), or by the weight plus Gaussian noise of a chosen relative variance per group of 128. Perplexity over
WikiText-2 windows (transformers, float32, CPU) next to each variant's relative weight MSE
(sum |W_hat - W|^2 / sum |W|^2) tells how many bits a scalar quantizer needs for a perplexity budget.

    python benchmarks/study_weight_mse.py MODEL_DIR WIKI_TEST_RAW --windows 8 --out study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "eval"))

from tq_eval.rtn import rtn_fake_quant  # noqa: E402

from turboquant_core.ops.weight_codec import dequantize_weight, quantize_weight  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NOISE_VARIANCES = (0.0095, 0.0025, 0.00066, 0.00017)  # about Lloyd-Max's Gaussian distortion at 4, 5, 6, 7 bits


def gaussian_noise(w: torch.Tensor, variance: float, group: int = 128, seed: int = 1) -> torch.Tensor:
    """w plus N(0, variance * mean square of its group) per weight, groups of ``group`` along the input."""
    out_f, in_f = w.shape
    pad = -in_f % group
    x = torch.nn.functional.pad(w.float(), (0, pad)).reshape(out_f, -1, group)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return (x + math.sqrt(variance) * rms * noise).reshape(out_f, -1)[:, :in_f].to(w.dtype)


def variants() -> dict:
    out = {"base": lambda w: w,
           "tq4": lambda w: dequantize_weight(quantize_weight(w, "tq4"), w.dtype),
           "rtn4": lambda w: rtn_fake_quant(w, 4),
           "tq3": lambda w: dequantize_weight(quantize_weight(w, "tq3"), w.dtype),
           "rtn3": lambda w: rtn_fake_quant(w, 3)}
    for v in NOISE_VARIANCES:
        out[f"noise {v}"] = lambda w, v=v: gaussian_noise(w, v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face model folder")
    ap.add_argument("text", help="WikiText-2 raw test file")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--out", default="study-weight-mse.json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tok(Path(args.text).read_text()[:1_000_000], return_tensors="pt").input_ids[0]
    n = args.window_tokens
    windows = [ids[i * n:(i + 1) * n] for i in range(args.windows)]
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS}
    original = {name: m.weight.detach().clone() for name, m in linears.items()}

    def perplexity() -> float:
        nll = count = 0.0
        with torch.no_grad():
            for w in windows:
                nll += model(w[None], labels=w[None]).loss.item() * (len(w) - 1)
                count += len(w) - 1
        return math.exp(nll / count)

    rows = []
    for name, fn in variants().items():
        t = time.perf_counter()
        err = total = 0.0
        for layer, m in linears.items():
            w = original[layer]
            w_hat = fn(w)
            err += (w_hat - w).pow(2).sum().item()
            total += w.pow(2).sum().item()
            m.weight.data.copy_(w_hat)
        ppl = perplexity()
        base = rows[0]["ppl"] if rows else ppl
        rows.append(dict(variant=name, ppl=ppl, dppl_pct=100 * (ppl / base - 1), rel_mse=err / total))
        print(f"{name:14s} PPL {ppl:9.3f} {rows[-1]['dppl_pct']:+8.2f} %  rel. MSE {err / total:.5f}"
              f"  ({time.perf_counter() - t:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(dict(model=Path(args.model).name, windows=args.windows,
                                              window_tokens=n, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""WikiText-2 perplexity of a model whose decoder linears run one of the weight products' references on the CPU:
bf16 (the checkpoint), tq4 / tq3 as the fp16 kernels compute them (``tq_linear_reference``: exact rotated-domain
product) and as the int8 product computes them (``tq_linear_int8_reference``: int8 activation, codebook bytes).

    python benchmarks/study_int8_quality.py MODEL_DIR wiki.test.raw --windows 16 --out int8-quality.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from turboquant_core.ops.weight_codec import (_code, int8_activation, int8_codebook, pad_to_groups, quantize_weight,
                                               rotated_weight)
from turboquant_core.rotation import fwht, hadamard_signs, rotate


class RefLinear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, fmt: str, int8: bool):
        super().__init__()
        w = quantize_weight(lin.weight.detach().float(), fmt)
        self.fmt, self.int8, self.bias = w.fmt, int8, lin.bias
        self.in_features = lin.in_features
        code = _code(w)
        if int8:
            table, unit = int8_codebook(w.fmt)
            self.b = table[code.idx.long()].float()
            self.coef = code.scale.float() * (unit / 2) / math.sqrt(w.fmt.group_size)
        else:
            self.rw = rotated_weight(w)

    def forward(self, x):
        f = self.fmt
        xg = pad_to_groups(x.float(), f).reshape(*x.shape[:-1], f.groups(self.in_features), f.group_size)
        if self.int8:
            xq, step = int8_activation(fwht(xg * hadamard_signs(f.group_size, f.seed)))
            p = torch.einsum("...gd,ogd->...og", xq, self.b)
            y = ((2 * p + xq.sum(-1)[..., None, :]) * self.coef * step[..., None, :]).sum(-1)
        else:
            y = torch.einsum("...gd,ogd->...o", rotate(xg, f.seed), self.rw)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def swap(model, fmt, int8):
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, RefLinear(mod, fmt, int8))


def ppl(model, ids, window):
    nll, n = 0.0, 0
    with torch.no_grad():
        for chunk in tqdm(ids.split(window), leave=False):
            if chunk.numel() < window:
                break
            out = model(chunk[None], labels=chunk[None])
            nll += out.loss.item() * (window - 1)
            n += window - 1
    return math.exp(nll / n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--configs", default="bf16,tq4,tq4-int8,tq3,tq3-int8")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(Path(args.text).read_text()[:400_000], return_tensors="pt").input_ids[0]
    ids = ids[: args.windows * args.window]
    res = {}
    for cfg in args.configs.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        if cfg != "bf16":
            swap(model, cfg.split("-")[0], cfg.endswith("int8"))
        res[cfg] = ppl(model, ids, args.window)
        print(cfg, f"{res[cfg]:.3f}", f"{(res[cfg] / res['bf16'] - 1) * 100:+.2f} %" if "bf16" in res else "",
              flush=True)
    args.out.write_text(json.dumps(dict(model=Path(args.model).name, tokens=int(ids.numel()), window=args.window,
                                        ppl=res), indent=1))


if __name__ == "__main__":
    main()

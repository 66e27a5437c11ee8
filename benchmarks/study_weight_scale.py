#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study (CPU, fake-quantized in fp32 with transformers): SmolLM2 WikiText-2 perplexity (8 windows of 512 tokens)
with its decoder projections rounded by the tq rotation + Lloyd-Max codebook at 4 / 3 bits, groups of 128 or 64,
with the norm-correcting scale or a least-squares scale.

    python benchmarks/study_weight_scale.py MODEL_DIR (tq convert-gguf of SmolLM2) WIKI_TEST_RAW
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from turboquant_core.codebooks import codebook_tensors  # noqa: E402
from turboquant_core.rotation import rotate, unrotate  # noqa: E402

tok = AutoTokenizer.from_pretrained(sys.argv[1])
text = open(sys.argv[2]).read()[:200000]
ids = tok(text, return_tensors="pt").input_ids[0]
W, N = 512, 8
def ppl(model):
    nll, cnt = 0.0, 0
    with torch.no_grad():
        for i in range(N):
            x = ids[i*W:(i+1)*W][None]
            nll += model(x, labels=x).loss.item() * (W - 1)
            cnt += W - 1
    return math.exp(nll / cnt)
def fake(w, bits, gs, scale_mode, seed=0):
    out_f, in_f = w.shape
    G = -(-in_f // gs)
    wp = torch.nn.functional.pad(w.float(), (0, G * gs - in_f)).reshape(out_f, G, gs)
    xr = rotate(wp, seed)
    n = xr.norm(dim=-1, keepdim=True)
    u = torch.where(n > 0, xr * math.sqrt(gs) / n, torch.zeros_like(xr))
    cent = codebook_tensors(bits, gs, "cpu")[0].float()
    idx = (u[..., None] - cent).abs().argmin(-1)
    c = cent[idx]
    if scale_mode == "norm":
        s = n / c.norm(dim=-1, keepdim=True)
    else:  # least squares
        s = (xr * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
    s = s.half().float()
    return unrotate(s * c, seed).reshape(out_f, -1)[:, :in_f]
def run(bits, gs, mode):
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    for k, v in m.state_dict().items():
        if k.endswith("_proj.weight") and ".layers." in k:
            v.copy_(fake(v, bits, gs, mode))
    return ppl(m)
for bits, gs, mode in [(4, 128, "norm"), (4, 128, "ls"), (4, 64, "ls"), (3, 128, "ls"), (3, 64, "ls")]:
    print(bits, gs, mode, round(run(bits, gs, mode), 3), flush=True)

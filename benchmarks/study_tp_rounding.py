#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study (CPU): does a compressed KV cache by itself turn tensor-parallel rounding into different greedy tokens on
tiny-qwen3 random weights? TP=2 emulated on the CPU: o_proj and down_proj (vLLM's row-parallel layers) as two
half-width bf16 products summed in bf16, as vLLM's all-reduce adds the ranks' bf16 partials. The checkpoint is
test_tq_tp_gpu.py's (seed 0, transformers' initialisation), the prompts its 8 (seed 11); bf16 with transformers'
DynamicCache, ours with TurboQuantCache (key smoothing and key centering as the patched vLLM applies them on Qwen3).
Prints, per head layout and cache, how many prompts keep their first 16 greedy tokens between TP=1 and TP=2, and
against bf16 at each size.

    PYTHONPATH=. python benchmarks/study_tp_rounding.py
"""

import json
import random
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from turboquant_core.integrations.key_smoothing import apply_key_smoothing
from turboquant_core.integrations.transformers_cache import TurboQuantCache, key_centering_for_model

LENS = (12, 40, 100, 300, 700, 1500, 5, 33)
rng = random.Random(11)
prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in LENS]
torch.set_num_threads(2)


def model_for(nh, nkv):
    cfg = AutoConfig.from_pretrained(
        str(Path(__file__).resolve().parent / "configs" / "tiny-qwen3"), num_attention_heads=nh, num_key_value_heads=nkv
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()


def row_parallel(lin, parts):
    w = lin.weight

    def fwd(x):
        k = x.shape[-1] // parts
        out = None
        for i in range(parts):
            p = torch.nn.functional.linear(x[..., i * k : (i + 1) * k], w[:, i * k : (i + 1) * k])
            out = p if out is None else out + p
        return out

    lin.forward = fwd


def set_tp(model, parts):
    for layer in model.model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if parts == 1:
                lin.forward = torch.nn.Linear.forward.__get__(lin)
            else:
                row_parallel(lin, parts)


@torch.no_grad()
def greedy(model, prompt, cache):
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    toks = []
    for _ in range(16):
        t = int(out.logits[0, -1].float().argmax())
        toks.append(t)
        out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
    return toks


def run(nh, nkv, preset):
    model = model_for(nh, nkv)
    res = {}
    if preset != "bf16":
        apply_key_smoothing(model)
        kc = key_centering_for_model(model)
    for tp in (1, 2):
        set_tp(model, tp)
        res[tp] = [
            greedy(
                model,
                p,
                DynamicCache() if preset == "bf16" else TurboQuantCache(model.config, preset=preset, key_centering=kc),
            )
            for p in prompts
        ]
    return res


def agree(a, b):
    return sum(x == y for x, y in zip(a, b))


out = {}
for nh, nkv in ((16, 4), (16, 1)):
    r = {p: run(nh, nkv, p) for p in ("bf16", "turboquant_k3v4_nc", "turboquant_4bit_nc")}
    row = {
        p: {
            "tp2_vs_tp1": agree(r[p][2], r[p][1]),
            "vs_bf16_tp1": agree(r[p][1], r["bf16"][1]),
            "vs_bf16_tp2": agree(r[p][2], r["bf16"][2]),
        }
        for p in r
    }
    out[f"{nh}h/{nkv}kv"] = row
    print(nh, nkv, json.dumps(row), flush=True)
print(json.dumps(out, indent=1))

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study (CPU, fp32 fake quantization): SmolLM2 WikiText-2 perplexity with tq4 on parts of the model only (attention,
MLP, down_proj, all but the first and last layers), to see where the loss comes from.

    python benchmarks/study_weight_parts.py MODEL_DIR WIKI_TEST_RAW
"""
import math
import sys

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from transformers import AutoModelForCausalLM, AutoTokenizer

from turboquant_core.ops.weight_codec import dequantize_weight, quantize_weight

tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok(open(sys.argv[2]).read()[:200000], return_tensors="pt").input_ids[0]
W, N = 512, 8
def ppl(m):
    nll = 0.0
    with torch.no_grad():
        for i in range(N):
            x = ids[i*W:(i+1)*W][None]
            nll += m(x, labels=x).loss.item()
    return math.exp(nll / N)
def run(select):
    m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    for k, v in m.state_dict().items():
        if k.endswith("_proj.weight") and ".layers." in k and select(k):
            v.copy_(dequantize_weight(quantize_weight(v, "tq4")))
    return ppl(m)
L = AutoModelForCausalLM.from_pretrained(sys.argv[1]).config.num_hidden_layers
for name, sel in [("attn only", lambda k: "self_attn" in k), ("mlp only", lambda k: ".mlp." in k),
                  ("down_proj only", lambda k: "down_proj" in k),
                  ("all but first+last layer", lambda k: not (".layers.0." in k or f".layers.{L-1}." in k))]:
    print(name, round(run(sel), 3), flush=True)

"""SmolLM2-135M: WikiText-2 perplexity with fake-quantized weights (quantize -> dequantize in float32), CPU.
Which error does tq4 reach against Lloyd-Max theory, and which layers carry the perplexity cost."""
import math
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turboquant_core.ops.weight_codec import dequantize_weight, quantize_weight

MODEL, TEXT = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(MODEL)
ids = tok(open(TEXT).read(), return_tensors="pt").input_ids[0]
WIN, N = 512, 16
windows = [ids[i * WIN:(i + 1) * WIN] for i in range(N)]
base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
orig = {k: v.clone() for k, v in base.state_dict().items()}

def ppl(model):
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            out = model(w[None], labels=w[None])
            nll += out.loss.item() * (len(w) - 1)
            n += len(w) - 1
    return math.exp(nll / n)

def rtn(w, bits, group=128):
    cols = w.shape[1]
    pad = (-cols) % group
    g = torch.nn.functional.pad(w, (0, pad)).view(w.shape[0], -1, group)
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (mx - mn).clamp_min(1e-12) / (2 ** bits - 1)
    r = ((g - mn) / s).round().clamp(0, 2 ** bits - 1) * s + mn
    return r.view(w.shape[0], -1)[:, :cols]

def tq(w, fmt):
    return dequantize_weight(quantize_weight(w, fmt))[: w.shape[0], : w.shape[1]]

def run(label, fn, select=lambda k: True):
    sd = dict(orig)
    err, tot = 0.0, 0.0
    for k, v in orig.items():
        if k.endswith("proj.weight") and select(k):
            q = fn(v)
            err += (q - v).pow(2).sum().item()
            tot += v.pow(2).sum().item()
            sd[k] = q
    base.load_state_dict(sd)
    p = ppl(base)
    print(f"{label:32s} rel MSE {err / max(tot, 1e-30):.4f}  PPL {p:.3f}", flush=True)
    return p

run("bf16 (the GGUF's weights)", lambda w: w, lambda k: False)
run("tq4", lambda w: tq(w, "tq4"))
run("rtn4 g128", lambda w: rtn(w, 4))
run("tq4 attention only", lambda w: tq(w, "tq4"), lambda k: "self_attn" in k)
run("tq4 MLP only", lambda w: tq(w, "tq4"), lambda k: "mlp" in k)
run("tq4 not layer 0", lambda w: tq(w, "tq4"), lambda k: ".layers.0." not in k)
run("tq4 not down_proj", lambda w: tq(w, "tq4"), lambda k: "down_proj" not in k)
run("rtn5 g128 (5 bits)", lambda w: rtn(w, 5))
run("rtn6 g128 (6 bits)", lambda w: rtn(w, 6))
run("tq3", lambda w: tq(w, "tq3"))

# Output (CPU, 16 windows of 512 tokens of wiki.test.raw, the GGUF-converted SmolLM2-135M-Instruct):
# bf16 (the GGUF's weights)        rel MSE 0.0000  PPL 36.005
# tq4                              rel MSE 0.0091  PPL 56.247
# rtn4 g128                        rel MSE 0.0099  PPL 61.747
# tq4 attention only               rel MSE 0.0091  PPL 43.936
# tq4 MLP only                     rel MSE 0.0091  PPL 44.942
# tq4 not layer 0                  rel MSE 0.0091  PPL 54.863
# tq4 not down_proj                rel MSE 0.0091  PPL 48.836
# rtn5 g128 (5 bits)               rel MSE 0.0026  PPL 40.086
# rtn6 g128 (6 bits)               rel MSE 0.0006  PPL 36.830
# tq3                              rel MSE 0.0337  PPL 244.641

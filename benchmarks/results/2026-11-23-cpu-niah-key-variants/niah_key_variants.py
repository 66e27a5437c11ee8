# SPDX-License-Identifier: Apache-2.0
"""NIAH with TurboQuant keys encoded in other ways, on the CPU through transformers (serving regime).

The regime is the one the vLLM NIAH runs of eval/ served in (``prefill_chunk`` 256 =
``long_prefill_token_threshold``): the prompt is prefilled in chunks of 256 tokens; a chunk attends to the
earlier chunks' encoded K/V and to its own K/V in full precision, then stores its K/V encoded; every
generated token writes its own K/V encoded and attends to the encoded cache, itself included. The quantizer
is ``MSEQuantizer`` with the format table's seeds (norm correction, fp32 scale), K 3 or 4 bits, V 4 bits:
``turboquant_k3v4_nc`` / ``turboquant_4bit_nc``.

Key variants (what is fed to the quantizer; bytes per token unchanged):
- ``plain``: the post-RoPE key, as the serving kernels do today.
- ``center``: k - mu, mu = mean of the post-RoPE keys of tokens 1-64 per layer and KV head (softmax ignores
  q . mu, so a kernel could drop it; here it is added back, which is the same attention).
- ``prerope``: k_j - RoPE_j(mu_pre), mu_pre = mean of the pre-RoPE keys of tokens 1-64; added back after
  decoding (a kernel would add q . RoPE_j(mu_pre) to the logit).
- ``+sink``: token 0's key and value kept in full precision.

Prompts: ``eval/tq_eval/niah.py`` with the chat template, as ``eval/tq_eval/worker.py`` builds them
(seed 0, depths 0/25/50/75/100, samples per depth, target = length - 17 tokens). Greedy, up to 10 new tokens.

Usage: python niah_key_variants.py --lengths 2048 --samples 20 --json out.json
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
from transformers.cache_utils import Cache, DynamicLayer

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.integrations.models import load_model  # noqa: E402
from turboquant_core.quantizer import MSEQuantizer  # noqa: E402

KEY_SEED, VALUE_SEED = 0x7C01, 0x7C02  # the format table's rotation seeds
PREFIX = slice(1, 65)  # tokens 1..64: token 0 is an attention sink and is left out of the means
VARIANTS = {
    "full precision": None,
    "k3v4 plain": (3, "plain", 0),
    "k3v4 center + sink": (3, "center", 1),
    "k3v4 prerope + sink": (3, "prerope", 1),
    "4bit plain": (4, "plain", 0),
    "4bit prerope + sink": (4, "prerope", 1),
}


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class EncodedLayer(DynamicLayer):
    """Stores the dequantized encodings of K/V. A chunk of several tokens attends to the stored past and to
    its own K/V in full precision (as a prefill chunk in the serving backend); a single token (decode)
    attends to everything encoded, itself included."""

    def __init__(self, kq, vq, mode: str, sink: int, pre_keys: dict, layer: int, rope_at):
        super().__init__()
        self.kq, self.vq, self.mode, self.sink = kq, vq, mode, sink
        self.pre_keys, self.layer, self.rope_at = pre_keys, layer, rope_at
        self.mu = self.mu_pre = None

    def _mean_at(self, p0: int, t: int):
        if self.mode == "center":
            return self.mu
        if self.mode == "prerope":
            cos, sin = self.rope_at(p0, t)
            return apply_rope(self.mu_pre, cos, sin)  # [Hkv, t, d]
        return 0.0

    def update(self, key_states, value_states, *args, **kwargs):
        p0 = self.get_seq_length()
        k, v = key_states.float(), value_states.float()
        if p0 == 0:  # the first chunk holds tokens 1..64 (prompts are longer than 65 tokens)
            self.mu = k[0][:, PREFIX].mean(1, keepdim=True)
            self.mu_pre = self.pre_keys[self.layer][:, PREFIX].mean(1, keepdim=True)
        m = self._mean_at(p0, k.shape[-2])
        ek = self.kq.dequantize(self.kq.quantize(k - m)) + m
        ev = self.vq.dequantize(self.vq.quantize(v))
        if self.sink and p0 == 0:
            ek[..., : self.sink, :] = k[..., : self.sink, :]
            ev[..., : self.sink, :] = v[..., : self.sink, :]
        past_k, past_v = (self.keys, self.values) if p0 else (None, None)
        keys, values = super().update(ek.to(key_states.dtype), ev.to(value_states.dtype))
        if key_states.shape[-2] == 1:
            return keys, values
        if past_k is None:
            return key_states, value_states
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--samples", type=int, default=20, help="samples per (length, depth)")
    ap.add_argument("--first-sample", type=int, default=0, help="index of the first sample (a later slice)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [v.strip() for v in args.variants.split(",")]
    loaded = load_model(args.model, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    cfg = model.config.get_text_config(decoder=True)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv = cfg.num_key_value_heads
    layers = model.model.layers
    quant = {("k", b): MSEQuantizer(d, b, True, KEY_SEED) for b in (3, 4)}
    vq = MSEQuantizer(d, 4, True, VALUE_SEED)

    pre_keys: dict[int, torch.Tensor] = {}

    def k_hook(i):
        def hook(_m, _inp, out):
            pre_keys[i] = out[0].float().view(out.shape[1], n_kv, d).transpose(0, 1)  # [Hkv, T, d] before RoPE
        return hook

    for i, layer in enumerate(layers):
        layer.self_attn.k_proj.register_forward_hook(k_hook(i))

    def rope_at(p0, t):
        cos, sin = model.model.rotary_emb(torch.zeros(1, t, d), torch.arange(p0, p0 + t)[None])
        return cos[0], sin[0]  # [t, d]

    render, encode, _ = niah_renderer(tok)
    lengths = [int(x) for x in args.lengths.split(",")]
    records = []
    t0 = time.time()
    with torch.inference_mode():
        for length in lengths:
            samples = niah_mod.make_grid(lambda t: len(encode(t)), [length], niah_mod.DEFAULT_DEPTHS, args.samples,
                                         seed=0, render=render, target_tokens={length: length - 17},
                                         first_sample=args.first_sample)
            for s in tqdm(samples, desc=f"NIAH {length}"):
                ids = torch.tensor([encode(s.prompt)])
                n = ids.shape[1]
                cache = DynamicCache(config=model.config)
                first_fp = int(model(ids, past_key_values=cache).logits[0, -1].argmax())
                cos, sin = rope_at(0, n)
                err = float((apply_rope(pre_keys[0], cos, sin) - cache.layers[0].keys[0].float()).abs().max())
                if err > 1e-3:
                    raise RuntimeError(f"pre-RoPE key capture does not match the cache (error {err:.3g})")
                for name in names:
                    spec = VARIANTS[name]
                    if spec is None:
                        c, first = cache, first_fp
                    else:
                        bits, mode, sink = spec
                        c = Cache(layers=[EncodedLayer(quant[("k", bits)], vq, mode, sink, pre_keys, i, rope_at)
                                          for i in range(len(layers))])
                        for c0 in range(0, n, args.chunk):
                            lg = model(ids[:, c0:c0 + args.chunk], past_key_values=c).logits[0, -1]
                        first = int(lg.argmax())
                    out_ids, nxt = [first], first
                    for _ in range(9):
                        lg = model(torch.tensor([[nxt]]), past_key_values=c).logits[0, -1]
                        nxt = int(lg.argmax())
                        out_ids.append(nxt)
                        if nxt == tok.eos_token_id:
                            break
                    answer = tok.decode(out_ids, skip_special_tokens=True)
                    records.append({"variant": name, "length": length, "depth_percent": s.depth_percent,
                                    "sample": s.sample, "num_tokens": n, "needle": s.needle, "answer": answer[:40],
                                    "correct": niah_mod.score_answer(answer, s.needle)})
    summary = {}
    for name in names:
        for length in lengths:
            rs = [r for r in records if r["variant"] == name and r["length"] == length]
            summary.setdefault(name, {})[str(length)] = {"correct": sum(r["correct"] for r in rs), "n": len(rs)}
    out = {"model": args.model, "lengths": lengths, "prefill_chunk": args.chunk, "samples_per_depth": args.samples,
           "first_sample": args.first_sample,
           "depths": list(niah_mod.DEFAULT_DEPTHS), "seconds": round(time.time() - t0, 1),
           "torch": torch.__version__, "summary": summary, "records": records}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("| variant | " + " | ".join(str(x) for x in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name in names:
        cells = [f"{summary[name][str(x)]['correct']}/{summary[name][str(x)]['n']}" for x in lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

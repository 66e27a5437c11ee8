#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study (CPU): which random-weight checkpoint lets test_tq_tp_gpu.py's greedy criterion (TP=2 keeps TP=1's first
16 greedy tokens in at least as many prompts with our KV cache as with bf16) tell a fault in our cache from rounding?

TP=2 emulated on the CPU: o_proj and down_proj (vLLM's row-parallel layers) as two half-width products, each rounded
to bf16, summed in bf16, as vLLM's all-reduce adds the ranks' bf16 partials; every linear layer as a GPU GEMM does it
(fp32 products and sums of the bf16 weights, one rounding to bf16). Prompts are prefilled in chunks of at most 1024
tokens (the test's scheduler step), so the 1500-token prompt's second chunk reads the compressed first. bf16 with
transformers' DynamicCache, ours with TurboQuantCache (key smoothing and key centering as the patched vLLM applies
them on Qwen3).

Checkpoint variants (``--variants``, parts joined by ``+``, see ``parse_variant``): tiny-qwen3 with 16 query heads
and 4 KV heads (``--kv-heads 1``: one, which vLLM replicates on both ranks), seed 0, transformers' initialisation,
then
- ``init=R``: ``initializer_range`` R instead of 0.02;
- ``lm_head*C`` / ``embed*C`` / ``residual_out/C``: the output head, the embedding, or o_proj and down_proj scaled;
- ``tied``: ``tie_word_embeddings`` on;
- ``plant``: every token's planted successor (``plant_successors``), usually with ``embed*C``;
  ``plant+embed*7`` is test_tq_tp_gpu.py's checkpoint.
Faults (``--faults``, on the TP=2 run of ``--fault-cache``): what a cache that mixes up a rank's two KV heads would
do, on the history it reads back (tokens of earlier steps; the current step's own tokens are never stored first):
- ``swap``: rank 1's KV heads 2 and 3 exchanged (keys and values);
- ``centre``: keys after the first page read back with the other head's centre (a per-head table indexed by the
  wrong head; our cache only);
- ``vnorm``: each value read back at the norm of the other head's value of the same token (a per-vector scale
  taken from the wrong head);
- ``knoise``: rank 1's keys with an extra error of 10 % of their norm, about a 4-bit code's own error (a codebook or
  rotation that is slightly wrong).
A fault shows when ours-with-fault keeps TP=1's tokens in fewer prompts than bf16 does.

Per variant and cache: prompts whose first 16 greedy tokens agree between TP=2 and TP=1 (the test's 8, and all
``--prompts``), against bf16 at TP=1, the top-1 minus top-2 logit margin of the greedy steps at TP=1 (median, and
over the logits' standard deviation: argmax does not change when logits are scaled, so the raw margin alone does not
say how near a tie is), prompts with a non-finite logit and prompts whose 16 tokens are one token repeated or fewer
than 4 distinct ones. Per comparison (TP=2 against TP=1, with or without a fault; ours against bf16 at TP=1), over the
steps both runs take from the same tokens: how far the reference's top-1 minus top-2 margin moves (in standard
deviations) and how far the greedy token's logprob moves (nats, what the test records per token); and, per prompt
that parts, the reference's margin at the first step that differs (a rounding parts only near-ties; a fault can part
wider margins).

    PYTHONPATH=. python benchmarks/study_tp_rounding.py --prompts 32 --variants default init=0.1 embed*16 plant+embed*7
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from turboquant_core.integrations import transformers_cache as tc
from turboquant_core.integrations.key_smoothing import apply_key_smoothing
from turboquant_core.integrations.transformers_cache import TurboQuantCache, cache_kwargs, key_centering_for_model

TINY_QWEN3 = Path(__file__).resolve().parent / "configs" / "tiny-qwen3"
LENS = (12, 40, 100, 300, 700, 1500, 5, 33)  # test_tq_tp_gpu.PROMPT_LENS
TEST_SEED = 11  # test_tq_tp_gpu's _random_prompts(11, PROMPT_LENS); later sets take seeds 12, 13, ...
MAX_TOKENS = 16
CHUNK = 1024  # the test's max_num_batched_tokens
CACHES = ("bf16", "turboquant_k3v4_nc", "turboquant_4bit_nc")
RANK1_HEADS = (2, 3)  # 4 KV heads at TP=2: rank 1 holds heads 2 and 3


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """test_stock_failures_gpu._random_prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(n)] for n in lengths]


def prompts_for(n: int) -> list[list[int]]:
    """The test's 8 prompts first, then sets of 8 at the same lengths from the next seeds."""
    out = []
    seed = TEST_SEED
    while len(out) < n:
        out += random_prompts(seed, LENS)
        seed += 1
    return out[:n]


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints


def parse_variant(name: str) -> dict:
    """``default``, ``init=R``, ``tied``, ``lm_head*C``, ``embed*C``, ``residual_out/C``, joined by ``+``."""
    spec = dict(init=0.02, tied=False, lm_head=1.0, embed=1.0, residual_out=1.0, plant=False)
    for part in name.split("+"):
        if part == "default":
            continue
        if part in ("tied", "plant"):
            spec[part] = True
        elif part.startswith("init="):
            spec["init"] = float(part[5:])
        elif "*" in part:
            key, c = part.split("*")
            spec[key] *= float(c)
        elif part.startswith("residual_out/"):
            spec["residual_out"] /= float(part.split("/")[1])
        else:
            raise ValueError(f"unknown variant part {part!r}")
    return spec


@torch.no_grad()
def plant_successors(model) -> None:
    """Every token x gets a successor succ(x) (a random permutation from the global generator): the output head's
    row of succ(x) becomes x's embedding direction, at the head's mean row norm. Where the embedding's share of the
    last hidden state is large enough, the greedy token is the last token's successor by a margin of some logit
    standard deviations, and only a change to the rest of the hidden state as large as that margin changes it."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    succ = torch.randperm(emb.shape[0])
    head[succ] = emb / emb.norm(dim=1, keepdim=True) * head.norm(dim=1).mean()


@torch.no_grad()
def build_model(spec: dict, num_kv_heads: int = 4):
    """The checkpoint as test_tq_tp_gpu.py would write it (bf16), with the variant's changes."""
    cfg = AutoConfig.from_pretrained(str(TINY_QWEN3), num_attention_heads=16, num_key_value_heads=num_kv_heads,
                                     initializer_range=spec["init"], tie_word_embeddings=spec["tied"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.model.embed_tokens.weight.mul_(spec["embed"])
    if not spec["tied"]:
        model.lm_head.weight.mul_(spec["lm_head"])
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(spec["residual_out"])
        layer.mlp.down_proj.weight.mul_(spec["residual_out"])
    if spec["plant"]:
        plant_successors(model)
    return model.to(torch.bfloat16).eval()


# ----------------------------------------------------------------------------------------------------------------------
# Emulated GEMMs and tensor parallelism


def gemm_like_gpu(lin: torch.nn.Linear, parts: int = 1) -> None:
    """``lin`` computes in fp32 from its bf16 weight and rounds once to bf16 (a GPU bf16 GEMM); with ``parts`` > 1,
    as a row-parallel layer: each part's product rounded to bf16, the parts summed in bf16."""
    w = lin.weight.detach().float()
    k = w.shape[1] // parts

    def fwd(x):
        out = None
        for i in range(parts):
            p = F.linear(x[..., i * k:(i + 1) * k].float(), w[:, i * k:(i + 1) * k]).to(torch.bfloat16)
            out = p if out is None else out + p
        return out

    lin.forward = fwd


def set_tp(model, parts: int) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            gemm_like_gpu(module)
    for layer in model.model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            gemm_like_gpu(lin, parts)


# ----------------------------------------------------------------------------------------------------------------------
# Decoded history kept between steps (the store decodes every stored token each call; tokens never change once stored)


def _states_incremental(self, dtype):
    memo = getattr(self, "_memo", None)
    if self.recent_tokens or (memo is not None and (memo[0] != dtype or memo[1].shape[2] > self.compressed_tokens)):
        memo = None
    done = 0 if memo is None else memo[1].shape[2]
    total = self.compressed_tokens
    if total > done:
        f, d = self.kv_format, self.head_dim
        codes, scales = self.key_codes[:, :, done:], self.key_scales[:, :, done:]
        if self.center is not None:
            k = tc.decode_component(f.key, codes, scales, d, f.key_seed, torch.float32)
            k = (k.double() + self._centers(torch.arange(done, total))).to(dtype)
        else:
            k = tc.decode_component(f.key, codes, scales, d, f.key_seed, dtype)
        v = tc.decode_component(f.value, self.value_codes[:, :, done:], self.value_scales[:, :, done:], d,
                                f.value_seed, dtype)
        if memo is not None:
            k, v = torch.cat([memo[1], k], dim=2), torch.cat([memo[2], v], dim=2)
        memo = (dtype, k, v)
        self._memo = memo
    return memo[1], memo[2]


tc.CompressedKVStore.states = _states_incremental


# ----------------------------------------------------------------------------------------------------------------------
# Faults on what rank 1 reads back


def _other(t: torch.Tensor) -> torch.Tensor:
    """Heads 2 and 3 exchanged."""
    i = list(range(t.shape[1]))
    i[RANK1_HEADS[0]], i[RANK1_HEADS[1]] = RANK1_HEADS[1], RANK1_HEADS[0]
    return t[:, i]


def faulty(cache, fault: str, seed: int = 0):
    """``cache`` whose update returns the history (not the tokens just given) with ``fault`` on rank 1's heads."""
    update = cache.update
    gen = torch.Generator().manual_seed(seed)
    r = list(RANK1_HEADS)

    def wrapped(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = update(key_states, value_states, layer_idx, *args, **kwargs)
        past = k.shape[2] - key_states.shape[2]
        if past <= 0:
            return k, v
        k, v = k.clone(), v.clone()
        kp, vp = k[:, :, :past], v[:, :, :past]
        if fault == "swap":
            kp[:, r], vp[:, r] = _other(kp)[:, r], _other(vp)[:, r]
        elif fault == "vnorm":
            n = vp.float().norm(dim=-1, keepdim=True)
            vp[:, r] = (vp[:, r].float() * (_other(n)[:, r] / n[:, r].clamp_min(1e-30))).to(vp.dtype)
        elif fault == "knoise":
            n = kp[:, r].float().norm(dim=-1, keepdim=True) / kp.shape[-1] ** 0.5
            noise = torch.randn(kp[:, r].shape, generator=gen) * 0.1 * n
            kp[:, r] = (kp[:, r].float() + noise).to(kp.dtype)
        elif fault == "centre":
            store = cache.layers[layer_idx].store
            if store.center is not None:
                c = store._centers(torch.arange(past))  # [B, H, past, D], zero on the first page
                kp[:, r] = (kp[:, r].double() - c[:, r] + _other(c)[:, r]).to(kp.dtype)
        else:
            raise ValueError(fault)
        return k, v

    cache.update = wrapped
    return cache


# ----------------------------------------------------------------------------------------------------------------------
# Greedy decoding


@torch.no_grad()
def greedy(model, prompt: list[int], cache) -> dict:
    kw = cache_kwargs(model, cache)
    for start in range(0, len(prompt), CHUNK):
        out = model(input_ids=torch.tensor([prompt[start:start + CHUNK]]), use_cache=True, logits_to_keep=1, **kw)
    toks, margins, rel, finite, steps = [], [], [], True, []
    for _ in range(MAX_TOKENS):
        steps.append(out.logits[0, -1])
        logits = out.logits[0, -1].float()
        finite &= bool(torch.isfinite(logits).all())
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        rel.append(float((top[0] - top[1]) / logits.std()))
        t = int(logits.argmax())
        toks.append(t)
        out = model(input_ids=torch.tensor([[t]]), use_cache=True, logits_to_keep=1, **kw)
    return dict(tokens=toks, margins=margins, rel_margins=rel, finite=finite, logits=torch.stack(steps))


def run(model, preset: str, prompts, tp: int, fault: str | None = None, centering=None) -> list[dict]:
    set_tp(model, tp)
    out = []
    for i, p in enumerate(prompts):
        cache = DynamicCache() if preset == "bf16" else TurboQuantCache(model.config, preset=preset,
                                                                          key_centering=centering)
        if fault:
            cache = faulty(cache, fault, seed=i)
        out.append(greedy(model, p, cache))
    return out


def n_agree(a: list[dict], b: list[dict], n: int | None = None) -> int:
    return sum(x["tokens"] == y["tokens"] for x, y in list(zip(a, b))[:n])


def shifts(a: list[dict], b: list[dict]) -> list[float]:
    """How far ``a`` moves ``b``'s top-1 minus top-2 logit margin, over ``b``'s logit standard deviation, at every
    step both runs take from the same tokens (up to and with the first step whose greedy tokens differ)."""
    out = []
    for x, y in zip(a, b):
        for k in range(MAX_TOKENS):
            za, zb = x["logits"][k].float(), y["logits"][k].float()
            i, j = zb.topk(2).indices
            out.append(float(((za[i] - za[j]) - (zb[i] - zb[j])).abs() / zb.std()))
            if x["tokens"][k] != y["tokens"][k]:
                break
    return out


def logprob_shifts(a: list[dict], b: list[dict]) -> list[float]:
    """|difference| of the greedy token's logprob (what the test records per token) at every step where both runs
    have had the same tokens so far and take the same one."""
    out = []
    for x, y in zip(a, b):
        for k in range(MAX_TOKENS):
            t = y["tokens"][k]
            if x["tokens"][k] != t:
                break
            la, lb = (r["logits"][k].float().log_softmax(-1)[t] for r in (x, y))
            out.append(float((la - lb).abs()))
    return out


def parting_margins(a: list[dict], b: list[dict]) -> list[float]:
    """For every prompt where ``a``'s tokens part from ``b``'s: ``b``'s top-1 minus top-2 margin (over its logit
    standard deviation) at the first step that differs."""
    out = []
    for x, y in zip(a, b):
        k = next((k for k in range(MAX_TOKENS) if x["tokens"][k] != y["tokens"][k]), None)
        if k is not None:
            out.append(round(y["rel_margins"][k], 3))
    return out


def quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {q: xs[min(int(len(xs) * float(q)), len(xs) - 1)] for q in ("0.5", "0.95", "0.99")} | {"max": xs[-1]}


def degenerate(r: dict) -> bool:
    return len(set(r["tokens"])) < 4


def study(variant: str, prompts, faults: list[str], fault_cache: str, num_kv_heads: int = 4) -> dict:
    spec = parse_variant(variant)
    t0 = time.time()
    runs: dict[str, dict] = {}
    for preset in CACHES:
        model = build_model(spec, num_kv_heads)
        centering = None
        if preset != "bf16":
            apply_key_smoothing(model)
            centering = key_centering_for_model(model)
        runs[preset] = {tp: run(model, preset, prompts, tp, centering=centering) for tp in (1, 2)}
        if preset == fault_cache:
            for fault in faults:
                runs[f"{preset}+{fault}"] = {2: run(model, preset, prompts, 2, fault, centering)}
    bf = runs["bf16"]
    rows = {}
    for name, r in runs.items():
        base = runs[name.split("+")[0]][1]
        row = dict(agree8=n_agree(r[2], base, 8), agree=n_agree(r[2], base), shift=quantiles(shifts(r[2], base)),
                   logprob_shift=quantiles(logprob_shifts(r[2], base)), parting_margins=parting_margins(r[2], base))
        if 1 in r:
            m = [x for g in r[1] for x in g["margins"]]
            rel = sorted(x for g in r[1] for x in g["rel_margins"])
            row.update(vs_bf16_tp1=n_agree(r[1], bf[1]), shift_vs_bf16_tp1=quantiles(shifts(r[1], bf[1])),
                       logprob_shift_vs_bf16_tp1=quantiles(logprob_shifts(r[1], bf[1])),
                       margin_median=statistics.median(m),
                       rel_margin_median=statistics.median(rel), rel_margin_p05=rel[len(rel) // 20],
                       nonfinite=sum(not g["finite"] for tp in r for g in r[tp]),
                       degenerate=sum(degenerate(g) for g in r[1]),
                       distinct_mean=statistics.mean(len(set(g["tokens"])) for g in r[1]))
        rows[name] = row
    return dict(variant=variant, spec=spec, kv_heads=num_kv_heads, prompts=len(prompts),
                seconds=round(time.time() - t0), rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--faults", nargs="*", default=["swap", "centre", "vnorm", "knoise"])
    ap.add_argument("--fault-cache", default="turboquant_k3v4_nc")
    ap.add_argument("--kv-heads", type=int, default=4, help="1: vLLM replicates the head on both ranks (no faults)")
    # The decode steps are small ops that a second thread slows down; run variants as separate processes instead.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="append one JSON line per variant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = prompts_for(args.prompts)
    for variant in args.variants:
        faults = args.faults if args.kv_heads == 4 else []
        res = study(variant, prompts, faults, args.fault_cache, args.kv_heads)
        print(json.dumps(res), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()

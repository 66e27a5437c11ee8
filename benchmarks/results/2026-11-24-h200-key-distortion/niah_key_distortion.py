# SPDX-License-Identifier: Apache-2.0
"""NIAH on SmolLM2 against the key error itself: served codes next to an ideal code at a given distortion.

Question: can any 3-bit key code that keeps the served design (random rotation, one fp16 norm, key centring)
match bf16 NIAH on this model? After the rotation the centred keys' coordinates are close to i.i.d. Gaussian, and
no code at R bits per coordinate gets the mean squared error of a Gaussian source below 2^(-2R) (rate-distortion
bound: 1/64 = 0.0156 at 3 bits; Lloyd-Max 0.0345, the trellis code of ``../2026-11-24-h200-trellis-keys/``
0.0253, Lloyd-Max at 4 bits 0.0095). A code that reaches the bound leaves an error that is Gaussian and
independent of its reconstruction (the bound's backward channel): s = r + z, r ~ N(0, 1 - D), z ~ N(0, D). This
script puts exactly that error on the keys, r = (1 - D) s + sqrt(D (1 - D)) n, so a row at D = 1/64 is what the
best possible 3-bit code of this design could do. Rows at the Lloyd-Max distortions check that the Gaussian
error stands in for the real codes' error (same distortion, same needles found).

Regime as vLLM with ``--prefill-chunk 0``: each prompt is prefilled once in full precision; its K/V are then
stored in one ``TurboQuantCache`` (served centring and first page), batch row r as variant r stores them, and
greedy decode steps of all rows at once read everything, their own K/V included, through that cache.
Prompts: the suite's generator, seed 0, ``--samples`` per depth and length. Variants (``--variants``, comma-separated):

- ``exact``: no compression (its row stores the keys and values as given).
- ``served:PRESET``: the served key and value codes of PRESET (e.g. ``served:turboquant_k3v4_nc``).
- ``channel:PRESET:D``: PRESET with its key code replaced by the Gaussian error at distortion D per coordinate.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

from turboquant_core.formats import get_format  # noqa: E402
from turboquant_core.integrations import transformers_cache as tc  # noqa: E402
from turboquant_core.integrations.models import load_model  # noqa: E402
from turboquant_core.rotation import rotate, unrotate  # noqa: E402

ANSWER_TOKENS = 10
CACHE_PRESET = "turboquant_k3v4_nc"


@dataclass
class Variant:
    """One row of the study: how keys and values are stored (all rows share one batched cache)."""

    label: str
    preset: str | None = None  # None: exact (nothing compressed)
    distortion: float | None = None  # None: the preset's own key code
    err_sum: float = 0.0  # sum over stored keys of |k - k_hat|^2 / |k|^2 (the per-coordinate distortion)
    err_count: int = 0

    @classmethod
    def parse(cls, spec: str) -> Variant:
        kind, _, rest = spec.partition(":")
        if kind == "exact" and not rest:
            return cls(spec)
        if kind == "served" and rest:
            preset, dist = rest, None
        elif kind == "channel" and rest.count(":") == 1:
            preset, d = rest.split(":")
            dist = float(d)
            if not 0.0 < dist < 1.0:
                raise SystemExit(f"distortion must be in (0, 1), got {d}")
        else:
            raise SystemExit(f"unknown variant {spec!r}: exact | served:PRESET | channel:PRESET:D")
        if get_format(preset).key.kind != "mse":  # also a clear error for an unknown preset
            raise SystemExit(f"{preset}: this study covers presets with MSE keys")
        return cls(spec, preset, dist)


class BatchedVariantCodec:
    """Stores batch row r of the cache as variant r does, as its reconstruction (the arithmetic of the bytes).

    The cache itself is a ``TurboQuantCache`` of ``turboquant_k3v4_nc`` (for its key centring and first-page
    handling, which every MSE-key preset shares); its encode/decode entry points are routed here. Each variant's
    keys and values go through the served codec of its preset (the fused kernels on CUDA), or for a channel
    variant the keys get the Gaussian error at distortion D. Its own distortion is measured on every stored key.
    """

    def __init__(self, cache_preset: str):
        self.cache_format = get_format(cache_preset)
        self.variants: list[Variant] = []
        self.generators: list[torch.Generator | None] = []
        self._enc, self._dec = tc.encode_component, tc.decode_component
        tc.encode_component, tc.decode_component = self.encode, self.decode

    def activate(self, variants: list[Variant], seeds: list[int], device: torch.device) -> None:
        self.variants = variants
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def encode(self, component, x, seed):
        is_key = seed == self.cache_format.key_seed
        rows = []
        for r, v in enumerate(self.variants):
            xr = x[r : r + 1].float()
            if v.preset is None:
                rows.append(xr)
                continue
            fmt = get_format(v.preset)
            comp, comp_seed = (fmt.key, fmt.key_seed) if is_key else (fmt.value, fmt.value_seed)
            if is_key and v.distortion is not None:
                x_hat = self._channel(xr, v.distortion, comp.norm_correction, comp_seed, self.generators[r])
            else:
                codes, scale = self._enc(comp, xr, comp_seed)
                x_hat = self._dec(comp, codes, scale, x.shape[-1], comp_seed, torch.float32)
            if is_key:
                self._account(v, xr, x_hat)
            rows.append(x_hat)
        return torch.cat(rows), torch.ones(x.shape[:-1], device=x.device)  # reconstructions stand in for bytes

    def decode(self, component, codes, scale, head_dim, seed, dtype):
        return codes.to(dtype)  # always a reconstruction from ``encode``

    @staticmethod
    def _channel(x: torch.Tensor, dist: float, norm_correction: bool, seed: int,
                 generator: torch.Generator) -> torch.Tensor:
        """The error a code at the rate-distortion bound leaves: r = (1 - D) s + sqrt(D (1 - D)) n on the
        rotated key scaled to unit variance per coordinate, then the served norm handling."""
        d = x.shape[-1]
        norm = x.norm(dim=-1)
        s = rotate(x, seed) * torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))[..., None]
        noise = torch.randn(s.shape, generator=generator, device=s.device)
        r = (1.0 - dist) * s + math.sqrt(dist * (1.0 - dist)) * noise
        if norm_correction:  # as served: the reconstruction keeps the key's norm (an fp16 scale)
            scale = (norm / r.norm(dim=-1).clamp_min(1e-12)).half().float()
        else:
            scale = norm / math.sqrt(d)
        return unrotate(r * scale[..., None], seed)

    @staticmethod
    def _account(v: Variant, x: torch.Tensor, x_hat: torch.Tensor) -> None:
        n2 = x.pow(2).sum(-1)
        ok = n2 > 0
        rel = (x - x_hat).pow(2).sum(-1)[ok] / n2[ok]
        v.err_sum += float(rel.sum())
        v.err_count += int(rel.numel())


_NUMBER_DONE = re.compile(r"\d[^\d,\s]")  # a digit followed by something that is not part of a number


def greedy_rows(model, cache, first: int, tok, rows: int, device) -> list[str]:
    """Greedy answers of every batch row (one per variant), until each has finished its number or ANSWER_TOKENS."""
    out = [[first] for _ in range(rows)]
    done = [False] * rows
    for _ in range(ANSWER_TOKENS - 1):
        ids = torch.tensor([[o[-1]] for o in out], device=device)
        nxt = model(ids, past_key_values=cache).logits[:, -1].argmax(-1).tolist()
        for r in range(rows):
            if not done[r]:
                out[r].append(nxt[r])
                done[r] = nxt[r] == tok.eos_token_id or bool(_NUMBER_DONE.search(tok.decode(out[r])))
        if all(done):
            break
    return [tok.decode(o, skip_special_tokens=True) for o in out]


def write_report(path: str, args, variants: list[Variant], lengths: list[int], records: list[dict], t0: float,
                 device: torch.device) -> dict:
    """Summary per variant plus every record; rewritten after each prompt so a cut-off run keeps what it did."""
    summary = {}
    for v in variants:
        by_length = {str(n): sum(r["correct"][v.label] for r in records if r["length"] == n) for n in lengths}
        summary[v.label] = {"found": sum(r["correct"][v.label] for r in records), "by_length": by_length,
                            "key_distortion": (v.err_sum / v.err_count) if v.err_count else None}
    out = {"model": args.model, "lengths": lengths, "samples_per_cell": args.samples,
           "first_sample": args.first_sample, "prompts": len(records), "seconds": round(time.time() - t0, 1),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "command": " ".join(sys.argv[1:]), "summary": summary, "records": records}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias or Hugging Face folder")
    ap.add_argument("--variants", required=True, help="comma-separated: exact | served:PRESET | channel:PRESET:D")
    ap.add_argument("--lengths", default="2048", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--samples", type=int, default=20, help="samples per (length, depth)")
    ap.add_argument("--first-sample", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    variants = [Variant.parse(s) for s in args.variants.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    device = torch.device(args.device)

    codec = BatchedVariantCodec(CACHE_PRESET)
    loaded = load_model(args.model, device=device, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    centering = tc.key_centering_for_model(model)
    render, encode, _ = niah_renderer(tok)
    grid = niah_mod.make_grid(lambda t: len(encode(t)), lengths, niah_mod.DEFAULT_DEPTHS, args.samples, seed=0,
                              render=render, target_tokens={n: n for n in lengths}, first_sample=args.first_sample)
    records, t0, summary = [], time.time(), {}
    with torch.inference_mode():
        for s in tqdm(grid, desc="NIAH prompts"):
            ids = torch.tensor([encode(s.prompt)], device=device)
            exact = DynamicCache(config=model.config)
            first = int(model(ids, past_key_values=exact).logits[0, -1].argmax())
            codec.activate(variants, [zlib.crc32(f"{v.label}|{s.length}|{s.depth_percent}|{s.sample}".encode())
                                      for v in variants], device)
            cache = tc.TurboQuantCache(model.config, preset=CACHE_PRESET, key_centering=centering)
            n = len(variants)
            for i, layer in enumerate(exact.layers):  # the prompt's exact K/V, stored as each variant stores them
                cache.update(layer.keys.expand(n, -1, -1, -1).contiguous(),
                             layer.values.expand(n, -1, -1, -1).contiguous(), i)
            for layer in cache.layers:  # decode steps read their own K/V through the cache
                layer.fresh_full_precision = False
            answers = dict(zip([v.label for v in variants], greedy_rows(model, cache, first, tok, n, device)))
            records.append({"length": s.length, "depth_percent": s.depth_percent, "sample": s.sample,
                            "needle": s.needle, "num_tokens": s.num_tokens,
                            "answers": {k: a[:40] for k, a in answers.items()},
                            "correct": {k: niah_mod.score_answer(a, s.needle) for k, a in answers.items()}})
            summary = write_report(args.json, args, variants, lengths, records, t0, device)
    for label, row in summary.items():
        kd = row["key_distortion"]
        print(f"{label:45s} {row['found']:4d}/{len(records)}  by length {row['by_length']}  "
              f"key D {'-' if kd is None else f'{kd:.4f}'}")


if __name__ == "__main__":
    main()

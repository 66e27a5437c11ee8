#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TurboQuant linear layers (``ops.linear.tq_linear``) against bf16 ``F.linear`` (cuBLAS) at the Qwen3-8B layer
shapes, CUDA-graph replay: time per decoder layer (qkv, o, gate_up, down), per shape, and the bandwidth the
weights are read at against the GPU's copy bandwidth.

    python benchmarks/bench_linear.py --out linear.json
    python benchmarks/bench_linear.py --rows 1,8 --variants "mma_block_o=16;mma_programs_per_sm=16" --out v.json
    python benchmarks/bench_linear.py --rows 1,8 --breakdown --out b.json

Every graph runs ``--layers`` layers with distinct weights (more bytes than L2 holds), as a decode step does. A
variant sets launcher constants of ``ops.linear`` (``KNOBS``) for the study of its choices, e.g. ``--variants
"wgmma_min_rows=65;wgmma_min_rows=1"`` the register-tile kernel alone against the warpgroup kernel at every row
count; the default variant is the shipped one.

``--breakdown`` adds, per config, row count and shape, the device time of each kernel per layer (torch.profiler over
eager runs of the same products) next to the graph's time: what the activation's rotation launch costs, and how much
of the graph's time no kernel runs (launch gaps and tails).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import time_ms  # noqa: E402
from turboquant_core.ops import linear as linear_ops  # noqa: E402
from turboquant_core.ops.weight_codec import TQWeight, served_layout  # noqa: E402

HIDDEN, INTERMEDIATE, Q, KV = 4096, 12288, 4096, 1024  # Qwen3-8B
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE)}
KNOBS = {"mma_max_rows": "MMA_MAX_ROWS", "mma_programs_per_sm": "MMA_PROGRAMS_PER_SM", "mma_block_o": "MMA_BLOCK_O",
         "mma_min_groups_per_split": "MMA_MIN_GROUPS_PER_SPLIT", "mma_int8": "MMA_INT8", "mma_pdl": "MMA_PDL",
         "mma_scales_ahead_min_bits": "MMA_SCALES_AHEAD_MIN_BITS",
         "wgmma_int8_max_rows": "WGMMA_INT8_MAX_ROWS",
         "wgmma_scaled_from_rows": "WGMMA_SCALED_FROM_ROWS", "wgmma_min_rows": "WGMMA_MIN_ROWS",
         "wgmma_programs_per_sm": "WGMMA_PROGRAMS_PER_SM", "wgmma_wide_programs_per_sm": "WGMMA_WIDE_PROGRAMS_PER_SM"}


def parse_variant(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in KNOBS:
            raise SystemExit(f"unknown knob {key!r}; valid: {', '.join(KNOBS)}")
        out[key] = int(value)
    return out


def random_weight(fmt: str, out_features: int, in_features: int, device: str) -> TQWeight:
    """Random indices and scales of the right shapes (the speed does not depend on the values)."""
    from turboquant_core.formats import get_weight_format

    f = get_weight_format(fmt)
    groups = f.groups(in_features)
    packed = torch.randint(0, 256, (out_features, groups, 16 * f.bits), dtype=torch.uint8, device=device)
    scales = (torch.rand(out_features, groups, device=device) * 0.02 + 0.01).to(torch.float16)
    return served_layout(TQWeight(fmt, packed, scales, in_features))  # as vLLM serves it


def copy_gbps(device: str) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def layer_weights(fmt: str, layers: int, device: str) -> dict[str, list]:
    """SHAPES -> ``layers`` distinct weights each: bf16 tensors, or random TurboQuant weights of ``fmt``."""
    weights = {}
    for name, (o, i) in SHAPES.items():
        if fmt == "bf16":
            weights[name] = [torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        else:
            weights[name] = [random_weight(fmt, o, i, device) for _ in range(layers)]
    return weights


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes()


def product(x: torch.Tensor, w) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w)
    return linear_ops.tq_linear(x, w)


def kernel_times_us(fn, reps: int, per: int) -> dict[str, float]:
    """Kernel name -> device microseconds per call of ``fn`` / ``per`` (``fn`` run ``reps`` times eagerly under
    torch.profiler, after one run outside it)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] = out.get(e.name, 0.0) + e.device_time / (reps * per)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def bench(fmt: str, rows_list: list[int], layers: int, device: str, breakdown: bool = False) -> list[dict]:
    """One row per (rows, shape) plus rows 'layer' (the four shapes of a decoder layer in sequence); with
    ``breakdown`` each row also holds ``kernels_us`` (``kernel_times_us`` per layer) and ``kernel_sum_us``."""
    weights = layer_weights(fmt, layers, device)
    out = []
    for rows in rows_list:
        xs = {n: torch.randn(rows, i, device=device, dtype=torch.bfloat16) for n, (o, i) in SHAPES.items()}
        for name in list(SHAPES) + ["layer"]:
            names = list(SHAPES) if name == "layer" else [name]

            def run(names=names, xs=xs):
                for k in range(layers):
                    for n in names:
                        product(xs[n], weights[n][k])

            ms = time_ms(run, graph=True)
            b = sum(nbytes(weights[n][k]) for n in names for k in range(layers))
            row = dict(config=fmt, rows=rows, shape=name, us_per_layer=ms * 1e3 / layers, weight_gbps=b / ms / 1e6)
            if breakdown:
                row["kernels_us"] = kernel_times_us(run, reps=10, per=layers)
                row["kernel_sum_us"] = sum(row["kernels_us"].values())
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="tq4,tq3")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default="", help="';'-separated knob sets, e.g. 'block_o=32;num_warps=8'")
    ap.add_argument("--breakdown", action="store_true",
                    help="also each kernel's device time per layer (torch.profiler), next to the graph's time")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = "cuda"
    rows = [int(r) for r in args.rows.split(",")]
    variants = [parse_variant(v) for v in args.variants.split(";")] if args.variants else [{}]
    shipped = {k: getattr(linear_ops, v) for k, v in KNOBS.items()}
    res = dict(device=torch.cuda.get_device_name(), date=dt.date.today().isoformat(), command=" ".join(sys.argv),
               copy_gbps=copy_gbps(device), shipped=shipped, rows=[])
    res["rows"] += bench("bf16", rows, args.layers, device, args.breakdown)
    for variant in variants:
        for k, v in {**shipped, **variant}.items():
            setattr(linear_ops, KNOBS[k], v)
        for fmt in args.formats.split(","):
            try:
                for r in bench(fmt, rows, args.layers, device, args.breakdown):
                    res["rows"].append(dict(r, variant=variant))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run (e.g. out of shared memory) is recorded
                res.setdefault("failed", []).append(dict(config=fmt, variant=variant, error=repr(exc)[:500]))
            print(f"done {fmt} {variant}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


def variant_label(row: dict) -> str:
    """The table's variant column: the knobs a TurboQuant row ran with ("shipped": none), empty for bf16."""
    if row["config"] == "bf16":
        return ""
    return ",".join(f"{k}={x}" for k, x in row.get("variant", {}).items()) or "shipped"


def markdown(res: dict) -> str:
    """Per-layer time (us) and speed-up over bf16 at each row count, per config and variant."""
    base = {(r["rows"], r["shape"]): r["us_per_layer"] for r in res["rows"] if r["config"] == "bf16"}
    lines = [f"{res['device']}, {res['date']}; copy bandwidth {res['copy_gbps']:.0f} GB/s; `{res['command']}`", "",
             "| config | variant | rows | shape | us/layer | x bf16 | weight GB/s | % copy |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['config']} | {variant_label(r)} | {r['rows']} | {r['shape']} | "
                     f"{r['us_per_layer']:.1f} | {base[(r['rows'], r['shape'])] / r['us_per_layer']:.2f} | "
                     f"{r['weight_gbps']:.0f} | {100 * r['weight_gbps'] / res['copy_gbps']:.0f} |")
    split = [r for r in res["rows"] if "kernels_us" in r]
    if split:
        lines += ["", "Kernel time per layer (torch.profiler, eager) against the graph's: the rest is time no kernel "
                  "runs.", "", "| config | variant | rows | shape | graph us | kernels us | not in a kernel | "
                  "kernels (us) |", "|---|---|---:|---|---:|---:|---:|---|"]
        for r in split:
            ks = "; ".join(f"{name[:48]} {us:.1f}" for name, us in r["kernels_us"].items())
            lines.append(f"| {r['config']} | {variant_label(r)} | {r['rows']} | {r['shape']} | "
                         f"{r['us_per_layer']:.1f} | {r['kernel_sum_us']:.1f} | "
                         f"{r['us_per_layer'] - r['kernel_sum_us']:.1f} | {ks} |")
    lines += [f"\nfailed: {f['config']} {f['variant']}: {f['error']}" for f in res.get("failed", [])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Launch-configuration sweep of the dense encode / decode kernels (rows per program x warps).

The bytes written do not depend on the launch configuration (each row is encoded alone); the
sweep checks that on every variant and times each one against the device's copy bandwidth, so the
defaults in ``turboquant_core.ops.codec`` can be chosen from measurements.

    python benchmarks/sweep_codec_launch.py --vectors 1000000 --dim 128 --bits 3,4 --out sweep.json

Each format runs the encoder the codec picks for bf16 rows (``ops.codec.choose_encoder``); its bytes are
compared with the default launch's. ``--searches polynomial,paired,fp32`` times the packing-order encoder's
codebook search as the default (the 4-bit index polynomial, ``ops.codec.PACKING_ORDER_POLYNOMIAL_BITS``,
elsewhere packed fp16 compares), as packed fp16 compares only (``ops.codec.PACKING_ORDER_PAIRED_BITS``) and as
fp32 compares; ``--stages`` and ``--programs-per-sm`` vary its tiles in flight and persistent programs
(``ops.codec.PACKING_ORDER_STAGES``, ``PACKING_ORDER_PROGRAMS_PER_SM``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton.testing

from turboquant_core.bench import BF16_BYTES, SCALE_BYTES, copy_bandwidth_gbs, device_name, index_bytes, parse_bits
from turboquant_core.ops import codec as codec_ops
from turboquant_core.ops.codec import choose_encoder, decode, encode
from turboquant_core.ops.rotation_tables import codec_tables


def _ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


# search name -> (widths as packed fp16 compares, widths as the index polynomial)
SEARCHES = {"polynomial": (codec_ops.PACKING_ORDER_PAIRED_BITS, codec_ops.PACKING_ORDER_POLYNOMIAL_BITS),
            "paired": (codec_ops.PACKING_ORDER_PAIRED_BITS, ()), "fp32": ((), ())}
DEFAULT_PIPELINE = (codec_ops.PACKING_ORDER_STAGES, codec_ops.PACKING_ORDER_PROGRAMS_PER_SM)


def sweep(n: int, dim: int, bits: list[float], rows: list[int], warps: list[int],
          searches: tuple[str, ...] = ("polynomial",), stages: tuple[int, ...] = (codec_ops.PACKING_ORDER_STAGES,),
          programs: tuple[int, ...] = (codec_ops.PACKING_ORDER_PROGRAMS_PER_SM,)) -> dict:
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    x = torch.randn(n, dim, generator=torch.Generator(device=dev).manual_seed(0), device=dev).to(torch.bfloat16)
    out = []
    for b in bits:
        ref_packed, ref_scale = encode(x, b, 0)
        ref_dec = decode(ref_packed, ref_scale, dim, b, 0, torch.bfloat16)
        moved = n * dim * BF16_BYTES + n * (index_bytes(dim, b) + SCALE_BYTES)
        kind = choose_encoder(codec_tables(dim, b, 0, str(dev)), x.dtype)
        for bn, nw, search, st, per_sm in itertools.product(rows, warps, searches, stages, programs):
            if kind != "packing_order" and (search, st, per_sm) != (searches[0], stages[0], programs[0]):
                continue  # the search and pipeline variants are the packing-order encoder's
            row = {"bits": b, "dim": dim, "vectors": n, "encoder": kind, "block_rows": bn, "num_warps": nw}
            if kind == "packing_order":
                row.update(search=search, stages=st, programs_per_sm=per_sm)
            codec_ops.PACKING_ORDER_PAIRED_BITS, codec_ops.PACKING_ORDER_POLYNOMIAL_BITS = SEARCHES[search]
            codec_ops.PACKING_ORDER_STAGES, codec_ops.PACKING_ORDER_PROGRAMS_PER_SM = st, per_sm
            try:
                p, s = encode(x, b, 0, block_rows=bn, num_warps=nw)
                d = decode(ref_packed, ref_scale, dim, b, 0, torch.bfloat16, block_rows=bn, num_warps=nw)
                row["same_bytes"] = bool(torch.equal(p, ref_packed) and torch.equal(s, ref_scale))
                # searches sum in other orders: coordinates at a decision boundary may differ
                row["differing_index_bytes"] = int((p != ref_packed).sum())
                row["max_scale_rel_diff"] = float(((s.float() - ref_scale.float()).abs() /
                                                   ref_scale.float().clamp_min(1e-30)).max())
                row["same_decode"] = bool(torch.equal(d, ref_dec))
                launch = {"block_rows": bn, "num_warps": nw}
                enc = _ms(lambda b=b, launch=launch: encode(x, b, 0, **launch))
                dec = _ms(lambda b=b, p=ref_packed, s=ref_scale, launch=launch: decode(p, s, dim, b, 0, torch.bfloat16,
                                                                                      **launch))
                for op, ms in (("encode", enc), ("decode", dec)):
                    gbs = moved / (ms * 1e-3) / 1e9
                    row[op] = {"ms": ms, "vectors_per_s": n / (ms * 1e-3), "gbs": gbs,
                               "fraction_of_copy": gbs / copy["gbs"]}
            except Exception as e:  # a variant that does not compile (shared memory, registers) is a result too
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            codec_ops.PACKING_ORDER_PAIRED_BITS, codec_ops.PACKING_ORDER_POLYNOMIAL_BITS = SEARCHES["polynomial"]
            codec_ops.PACKING_ORDER_STAGES, codec_ops.PACKING_ORDER_PROGRAMS_PER_SM = DEFAULT_PIPELINE
            print(json.dumps(row), flush=True)
            out.append(row)
    return {"device": device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv), "copy": copy, "results": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--searches", default="polynomial",
                    help="the packing-order encoder's codebook search: comma-separated of " + ", ".join(SEARCHES))
    ap.add_argument("--stages", default=str(codec_ops.PACKING_ORDER_STAGES),
                    help="the packing-order encoder's row tiles in flight, comma-separated")
    ap.add_argument("--programs-per-sm", default=str(codec_ops.PACKING_ORDER_PROGRAMS_PER_SM),
                    help="the packing-order encoder's persistent programs per SM, comma-separated")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    searches = tuple(v.strip() for v in a.searches.split(","))
    if bad := [v for v in searches if v not in SEARCHES]:
        ap.error(f"unknown search {bad[0]!r}; choose from {', '.join(SEARCHES)}")
    if not torch.cuda.is_available():
        sys.exit("sweep_codec_launch.py times the Triton kernels and needs a CUDA device")
    res = sweep(a.vectors, a.dim, parse_bits(a.bits), [int(v) for v in a.rows.split(",")],
                [int(v) for v in a.warps.split(",")], searches,
                tuple(int(v) for v in a.stages.split(",")), tuple(int(v) for v in a.programs_per_sm.split(",")))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'bits':>4} {'encoder':>13} {'search':>6} {'st/sm':>5} {'rows':>4} {'warps':>5} {'enc % copy':>10} "
          f"{'dec % copy':>10} same")
    for r in res["results"]:
        pipe = f"{r['stages']}/{r['programs_per_sm']}" if "stages" in r else ""
        head = (f"{r['bits']:>4g} {r['encoder']:>13} {r.get('search', ''):>6} {pipe:>5} {r['block_rows']:>4} "
                f"{r['num_warps']:>5}")
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        print(f"{head} "
              f"{100 * r['encode']['fraction_of_copy']:>9.1f}%"
              f" {100 * r['decode']['fraction_of_copy']:>9.1f}% {r['same_bytes'] and r['same_decode']}")


if __name__ == "__main__":
    main()

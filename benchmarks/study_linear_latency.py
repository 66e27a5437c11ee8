#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study: is the weight product (``tq_linear_mma_kernel``) bound by memory latency and occupancy, or by its
instructions? Three probes, each on a GPU:

    python benchmarks/study_linear_latency.py ncu-driver tq4 gate_up 1      # the launches Nsight Compute profiles
    python benchmarks/study_linear_latency.py maxnreg --out maxnreg.json    # register caps 64-168 (spills or not)
    python benchmarks/study_linear_latency.py chunked-check                 # chunked variants equal the shipped one

The chunked variants (``ops.linear.MMA_CHUNKED``, ``MMA_AHEAD``) decode and multiply each group in four chunks of
32 inputs, so one chunk's decoded tile is live at a time (96 registers instead of 128 at up to 8 rows), with the
activation chunks and scales loaded a group ahead and the planes one or two groups ahead; timed with
``bench_linear.py --variants "mma_chunked=0;mma_chunked=1;mma_chunked=1,mma_ahead=2"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_linear as B  # noqa: E402
from turboquant_core.ops import linear as L  # noqa: E402


def ncu_driver(fmt: str, shape: str, rows: int) -> None:
    o, i = B.SHAPES[shape]
    w = B.random_weight(fmt, o, i, "cuda")
    x = torch.randn(rows, i, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(o, i, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        L.tq_linear(x, w)
        torch.nn.functional.linear(x, wb)
    torch.cuda.synchronize()


def maxnreg(out: Path) -> None:
    import turboquant_core.kernels.linear_mma_jit as K

    orig = K.tq_linear_mma_kernel

    class Capped:
        def __init__(self, n):
            self.n = n

        def __getitem__(self, grid):
            f = orig[grid]
            return lambda *a, **kw: f(*a, **kw, maxnreg=self.n)

    rows = []
    for n in [0, 64, 80, 96, 168]:
        K.tq_linear_mma_kernel = Capped(n) if n else orig
        for r in B.bench("tq4", [1, 8], 8, "cuda"):
            rows.append(dict(r, maxnreg=n))
    K.tq_linear_mma_kernel = orig
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


def chunked_check() -> None:
    torch.manual_seed(0)
    bad = n = 0
    for fmt in ("tq4", "tq3"):
        for o, i in [(24576, 4096), (4096, 12288), (1000, 4200), (6144, 4096), (48, 256)]:
            w = B.random_weight(fmt, o, i, "cuda")
            bias = torch.randn(o, device="cuda", dtype=torch.bfloat16)
            for rows in (1, 3, 8, 16, 32, 64):
                x = torch.randn(rows, i, device="cuda", dtype=torch.bfloat16)
                for b in (None, bias):
                    L.MMA_CHUNKED, L.MMA_AHEAD = 0, 1
                    ref = L.tq_linear(x, w, b)
                    for ahead in (1, 2):
                        L.MMA_CHUNKED, L.MMA_AHEAD = 1, ahead
                        n += 1
                        bad += not torch.equal(L.tq_linear(x, w, b), ref)
    L.MMA_CHUNKED, L.MMA_AHEAD = 0, 1
    print(f"chunked vs shipped: {n - bad} of {n} bit-identical")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("ncu-driver")
    d.add_argument("fmt")
    d.add_argument("shape")
    d.add_argument("rows", type=int)
    m = sub.add_parser("maxnreg")
    m.add_argument("--out", type=Path, required=True)
    sub.add_parser("chunked-check")
    args = ap.parse_args()
    if args.cmd == "ncu-driver":
        ncu_driver(args.fmt, args.shape, args.rows)
    elif args.cmd == "maxnreg":
        maxnreg(args.out)
    else:
        chunked_check()
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""The start-up warm-up's kernel variants for one serving configuration compiled for sm_90 on this machine's CPUs:
one after another in one process (as the engine compiled them before ``ops.compile_ahead``), then by
``compile_ahead`` with N worker processes into a fresh Triton cache, then again over that cache.

A stand-in driver (``tests/ops/sm90_probe.Sm90Driver``) reports an sm_90 device, so the launches go through
Triton's own launch path and binder (no GPU).

    python compile_ahead_cpu.py --workers 2 --out compile-ahead.json
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r'''
import json, sys, time
import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver

driver.set_active(Sm90Driver())
from turboquant_core.ops import paged_decode
from turboquant_core.ops.compile_ahead import compile_ahead, compile_variant, recording_variants
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, warmup_kernels

paged_decode._gluon_runs = lambda device: True
mode, workers = sys.argv[1], int(sys.argv[2])
d, bs = 128, 16  # Qwen3-8B heads: 32 query / 8 KV, k3v4, keys centred, no window (as served by default)
layout = paged_layout("turboquant_k3v4_nc", head_dim=d, block_size=bs)
cache = allocate_kv_cache(64, 8, layout)
cent = key_centering_tables(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), d, bs, 8192)


def warm():
    warmup_kernels(cache, layout, 32, 8, dtype=torch.bfloat16, centering=cent, paths=("decode", "context", "gather"))


t0 = time.perf_counter()
if mode == "serial":
    with recording_variants() as found:
        warm()
    per = []
    for v in found.values():
        t = time.perf_counter()
        compile_variant(v)
        per.append(dict(kernel=v.name, seconds=time.perf_counter() - t))
    print(json.dumps(dict(mode=mode, seconds=time.perf_counter() - t0, variants=len(per), per_variant=per)))
else:
    r = compile_ahead(warm, workers)
    print(json.dumps(dict(mode=mode, seconds=time.perf_counter() - t0, **r.__dict__)))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="compile-ahead.json")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[3]
    rows = []
    for mode, cache in (("serial", "a"), ("ahead", "b"), ("ahead-warm", "b")):
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root),
                   TRITON_CACHE_DIR=str(Path(tmp) / cache) if (tmp := os.environ.get("SCRATCH")) else "")
        p = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.workers)], env=env, capture_output=True,
                           text=True, cwd=root)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_variant"}), flush=True)
    Path(args.out).write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d"), machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        command=" ".join(sys.argv), workers=args.workers, rows=rows), indent=1))


if __name__ == "__main__":
    if "SCRATCH" not in os.environ:
        os.environ["SCRATCH"] = tempfile.mkdtemp(prefix="compile-ahead-")
    main()

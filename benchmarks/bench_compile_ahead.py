#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Start-up kernel compilation of one serving configuration on this machine's CPUs, no GPU needed: the warm-up's
kernel variants (``ops.kernel_warmup``, as the vLLM backend warms up by default: decode, chunked-prefill context and
the dense-row gather on layers without a window; keys centred where the preset's keys take it) compiled for an sm_90
target three ways, each in a fresh process:

1. ``serial``: one after another in one process (what ``--tq-compile-workers 1`` does in the engine);
2. ``ahead``: ``ops.compile_ahead`` with ``--workers`` processes into a fresh Triton cache;
3. ``ahead-warm``: the same over the cache run 2 filled (a warm machine).

A stand-in driver (``tests/ops/sm90_probe.Sm90Driver``) reports an sm_90 device, so the launches go through Triton's
own launch path and binder.

    python benchmarks/bench_compile_ahead.py --workers 16 --out compile-ahead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver

driver.set_active(Sm90Driver())
from turboquant_core.formats import get_format
from turboquant_core.ops import paged_decode
from turboquant_core.ops.compile_ahead import compile_ahead, compile_variant, recording_variants
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, warmup_kernels

paged_decode._gluon_runs = lambda device: True
mode, workers, preset, d, hq, hkv = sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:7])
bs = 16
layout = paged_layout(preset, head_dim=d, block_size=bs)
cache = allocate_kv_cache(64, hkv, layout)
cent = None
if not get_format(preset).key.is_fp8:
    cent = key_centering_tables(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), d, bs, 8192)


def warm():
    warmup_kernels(cache, layout, hq, hkv, dtype=torch.bfloat16, centering=cent, paths=("decode", "context", "gather"))


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
    print(json.dumps(dict(mode=mode, seconds=time.perf_counter() - t0, **r.summary())))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=32, help="query heads (Qwen3-8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (Qwen3-8B: 8)")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="compile-ahead-"))
    rows = []
    for mode, cache in (("serial", "a"), ("ahead", "b"), ("ahead-warm", "b")):
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(scratch / cache))
        p = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.workers), args.preset, str(args.head_dim),
                            str(args.q_heads), str(args.kv_heads)], env=env, capture_output=True, text=True, cwd=ROOT)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_variant"}), flush=True)
    args.out.write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d"), machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        preset=args.preset, head_dim=args.head_dim, q_heads=args.q_heads, kv_heads=args.kv_heads,
        workers=args.workers, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

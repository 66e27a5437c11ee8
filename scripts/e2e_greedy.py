#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Greedy generations of a real model through vLLM, per KV-cache dtype and install, against bf16.

    python scripts/e2e_greedy.py --model DIR --configs bf16=patched:auto,ours-k3v4=patched:turboquant_k3v4_nc,\
stock-k3v4=stock:turboquant_k3v4_nc --pythonpath-stock DIR --pythonpath-patched DIR --out e2e.json

Each configuration runs in its own process (tests/vllm_patches/test_tq_serving_gpu.py is the entry point,
the same prompts the GPU tests use: three short factual prompts and a pass-key retrieval). The report gives,
per configuration, the generated texts, the number of leading tokens equal to the baseline's per prompt,
and whether the pass key was retrieved.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "vllm_patches" / "test_tq_serving_gpu.py"
PASSKEY = "73918"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", required=True, help="NAME=stock|patched:KV_CACHE_DTYPE,...; the first is the baseline")
    ap.add_argument("--pythonpath-stock", default="")
    ap.add_argument("--pythonpath-patched", default="")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-filler", type=int, default=60)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="e2e.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = []
    for item in args.configs.split(","):
        name, _, rest = item.partition("=")
        install, _, dtype = rest.partition(":")
        env = dict(os.environ)
        pp = args.pythonpath_stock if install == "stock" else args.pythonpath_patched
        if pp:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pp, str(ROOT), env.get("PYTHONPATH", "")) if p)
        cfg = dict(model=args.model, kv_cache_dtype=dtype, max_tokens=args.max_tokens, num_filler=args.num_filler,
                   enforce_eager=args.enforce_eager, max_model_len=4096)
        res_file = out.with_name(f"{out.stem}-{name}.json")
        t = time.perf_counter()
        print(f"[e2e] {name}: {install} {dtype}", flush=True)
        try:
            p = subprocess.run([sys.executable, str(ENTRY), json.dumps(cfg), str(res_file)], env=env,
                               capture_output=True, text=True, timeout=args.timeout)
            ok, err = p.returncode == 0, "\n".join(p.stderr.splitlines()[-8:])
        except subprocess.TimeoutExpired:
            ok, err = False, "timeout"
        row = dict(name=name, install=install, kv_cache_dtype=dtype, wall_s=round(time.perf_counter() - t, 1))
        if ok and res_file.exists():
            row.update(json.loads(res_file.read_text()))
        else:
            row["error"] = err[-2000:]
        rows.append(row)
        print(f"[e2e] {name}: {'ok' if 'tokens' in row else 'FAILED ' + row['error'][-400:]}", flush=True)
    base = rows[0] if "tokens" in rows[0] else None
    lines = ["| config | install | kv_cache_dtype | leading tokens equal to baseline (per prompt) | pass key | "
             "first prompt's text |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "tokens" not in r:
            lines.append(f"| {r['name']} | {r['install']} | {r['kv_cache_dtype']} | failed: "
                         f"{r['error'].splitlines()[-1][:120] if r['error'] else ''} | - | - |")
            continue
        agree = [common_prefix(a, b) for a, b in zip(r["tokens"], base["tokens"])] if base else []
        r["agreement_with_baseline"] = agree
        r["passkey_found"] = PASSKEY in r["texts"][3]
        text = r["texts"][0].replace("\n", " ").replace("|", "/")[:60]
        lines.append(f"| {r['name']} | {r['install']} | {r['kv_cache_dtype']} | {agree} of {args.max_tokens} | "
                     f"{'yes' if r['passkey_found'] else 'no'} | {text} |")
    doc = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv),
               model=args.model, results=rows)
    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

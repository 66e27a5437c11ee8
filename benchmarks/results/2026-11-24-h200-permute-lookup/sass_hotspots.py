#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Aggregate an Nsight Compute source page (``ncu --import R --page source --csv --print-source sass``)
by SASS opcode: warp-stall samples, executed instructions, L1 global tag requests, L2 sectors, shared
wavefronts, and the top stall reasons.   python sass_hotspots.py attention-before-sass.csv.gz"""

import collections
import csv
import gzip
import io
import re
import sys

KEYS = ["Warp Stall Sampling (All Samples)", "Instructions Executed", "L1 Tag Requests Global",
        "L2 Theoretical Sectors Global", "L1 Wavefronts Shared"]


def main(path: str) -> None:
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    rows = list(csv.reader(io.StringIO(raw.read())))
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, k):
        try:
            return float(r[col[k]].replace(",", ""))
        except ValueError:
            return 0.0

    agg, total = collections.defaultdict(collections.Counter), collections.Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[col["Source"]].strip()).split(" ")[0]
        agg[op]["n"] += 1
        for k in KEYS + stalls:
            agg[op][k] += num(r, k)
            total[k] += num(r, k)
    print(f"{'opcode':24s} {'sites':>5s} {'samples %':>9s} {'executed':>10s} {'L1 tag gl':>10s} {'L2 sect gl':>10s} "
          f"{'shared wf':>10s}  top stalls")
    for op, a in sorted(agg.items(), key=lambda kv: -kv[1][KEYS[0]])[:24]:
        top = sorted(((a[s], s) for s in stalls), reverse=True)[:3]
        print(f"{op:24s} {a['n']:5d} {100 * a[KEYS[0]] / total[KEYS[0]]:9.1f} {a[KEYS[1]]:10.0f} {a[KEYS[2]]:10.0f} "
              f"{a[KEYS[3]]:10.0f} {a[KEYS[4]]:10.0f}  "
              + ", ".join(f"{s[6:]} {100 * v / max(1, a[KEYS[0]]):.0f}%" for v, s in top))
    print("total", {k: int(total[k]) for k in KEYS[1:]})


if __name__ == "__main__":
    main(sys.argv[1])

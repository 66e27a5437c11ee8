# SPDX-License-Identifier: Apache-2.0
"""The CPU NIAH variants next to the vLLM H100 runs on the same prompts (same seed, length, depths, samples).

Prints a markdown table: correct / prompts per variant, the one-sided Fisher p that a variant retrieves less
often than full precision, and per-prompt agreement of the CPU simulation with vLLM for the matching dtype.

Usage: python compare_vllm.py niah-2048-smollm2.json [more result files: records are pooled]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "eval"))

from tq_eval.report import niah_shortfall_p  # noqa: E402

VLLM_RUN = ROOT / "eval/results/smollm2-135m-instruct/2026-11-23-h100-niah100/configs"
VLLM_MATCH = {  # CPU variant -> vLLM config file of the same encoding
    "full precision": "patched__auto.json",
    "k3v4 plain": "patched__turboquant_k3v4_nc.json",
    "4bit plain": "patched__turboquant_4bit_nc.json",
}


def key(r: dict) -> tuple:
    return r["length"], r["depth_percent"], r["sample"]


def compare(paths, vllm_run: Path = VLLM_RUN, vllm_match: dict = VLLM_MATCH) -> None:
    """Print the table for the CPU result files ``paths`` against the vLLM configs in ``vllm_run``."""
    by_variant: dict[str, dict] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["records"]:
            by_variant.setdefault(r["variant"], {})[key(r)] = r["correct"]
    ref = by_variant["full precision"]
    ref_stats = {"acc": sum(ref.values()) / len(ref), "n": len(ref)}
    print("| variant (CPU, chunked prefill 256) | correct | p (fewer than full precision) | vLLM H100, same prompts | "
          "per-prompt agreement with vLLM |")
    print("|---|---:|---:|---:|---:|")
    for name, rec in by_variant.items():
        got = {"acc": sum(rec.values()) / len(rec), "n": len(rec)}
        p = niah_shortfall_p(ref_stats, got)
        vllm_cell = agree_cell = "-"
        if name in vllm_match:
            vr = json.loads((vllm_run / vllm_match[name]).read_text())["tasks"]["niah"]["records"]
            vmap = {key(r): r["correct"] for r in vr if key(r) in rec}
            vllm_cell = f"{sum(vmap.values())}/{len(vmap)}"
            agree_cell = f"{sum(vmap[k] == rec[k] for k in vmap)}/{len(vmap)}"
        print(f"| {name} | {sum(rec.values())}/{len(rec)} | {p:.2g} | {vllm_cell} | {agree_cell} |")


def main() -> None:
    compare(sys.argv[1:])


if __name__ == "__main__":
    main()

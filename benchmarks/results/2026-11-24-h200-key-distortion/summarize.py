# SPDX-License-Identifier: Apache-2.0
"""Merge the per-process JSONs of ``niah_key_distortion.py`` (raw/) into summary.json, a table and a plot.

Each (length, depth, sample) prompt is counted once (the first file that holds it; the runs of samples 0-19 and
20-39 were cut at their time limit and samples 12-19 and 32-39 were run again whole). Per length and variant:
needles found, the one-sided Fisher exact p of the reports' ``niah_shortfall_beyond_noise`` check against
``exact``, and the paired one-sided exact McNemar p (same prompts: discordant pairs only).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "eval"))

from tq_eval.report import niah_shortfall_p  # noqa: E402


def mcnemar_p(lost: int, gained: int) -> float:
    """P(X >= lost), X ~ Binomial(lost + gained, 1/2): one-sided exact McNemar on the discordant prompts."""
    n = lost + gained
    return sum(math.comb(n, x) for x in range(lost, n + 1)) / 2**n if n else 1.0


def main() -> None:
    records, seen, meta = [], set(), []
    distortion: dict[str, list[float]] = {}  # label -> [sum of per-file means weighted by prompts, prompts]
    for f in sorted((HERE / "raw").glob("niah-*.json")):
        d = json.loads(f.read_text())
        for label, row in d["summary"].items():
            if row["key_distortion"] is not None:
                acc = distortion.setdefault(label, [0.0, 0])
                acc[0] += row["key_distortion"] * d["prompts"]
                acc[1] += d["prompts"]
        meta.append({"file": f"raw/{f.name}", "prompts": d["prompts"], "seconds": d["seconds"],
                     "device": d["device"], "torch": d["torch"], "command": d["command"]})
        for r in d["records"]:
            key = (r["length"], r["depth_percent"], r["sample"])
            if key not in seen:
                seen.add(key)
                records.append(r)
    labels = list(records[0]["correct"])
    lengths = sorted({r["length"] for r in records})
    rows = []
    for label in labels:
        total, prompts = distortion.get(label, (0.0, 0))
        row = {"variant": label, "key_distortion": total / prompts if prompts else None, "by_length": {}}
        for n in lengths:
            rs = [r for r in records if r["length"] == n]
            ref = sum(r["correct"]["exact"] for r in rs)
            got = sum(r["correct"][label] for r in rs)
            lost = sum(r["correct"]["exact"] and not r["correct"][label] for r in rs)
            gained = sum(r["correct"][label] and not r["correct"]["exact"] for r in rs)
            fisher = niah_shortfall_p({"acc": ref / len(rs), "n": len(rs)}, {"acc": got / len(rs), "n": len(rs)})
            row["by_length"][str(n)] = {"found": got, "prompts": len(rs), "lost_vs_exact": lost,
                                        "gained_vs_exact": gained, "fisher_p": fisher,
                                        "mcnemar_p": mcnemar_p(lost, gained)}
        row["found"] = sum(v["found"] for v in row["by_length"].values())
        row["prompts"] = len(records)
        lost = sum(v["lost_vs_exact"] for v in row["by_length"].values())
        gained = sum(v["gained_vs_exact"] for v in row["by_length"].values())
        row["all_lengths"] = {"lost_vs_exact": lost, "gained_vs_exact": gained,
                              "mcnemar_p": mcnemar_p(lost, gained)}
        rows.append(row)
    summary = {"lengths": lengths, "prompts_per_length": len(records) // len(lengths), "runs": meta, "rows": rows}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("| variant | key D | " + " | ".join(f"{n}" for n in lengths) + " | all | lost / gained | McNemar p (all) |")
    print("|---|---:|" + "---:|" * len(lengths) + "---:|---:|---:|")
    for row in rows:
        kd = "-" if row["key_distortion"] is None else f"{row['key_distortion']:.4f}"
        cells = []
        for n in lengths:
            c = row["by_length"][str(n)]
            p = "" if row["variant"] == "exact" else f" (F {c['fisher_p']:.2f}, M {c['mcnemar_p']:.3f})"
            cells.append(f"{c['found']}{p}")
        a = row["all_lengths"]
        print(f"| `{row['variant']}` | {kd} | " + " | ".join(cells) + f" | {row['found']}/{row['prompts']} | "
              f"{a['lost_vs_exact']} / {a['gained_vs_exact']} | {a['mcnemar_p']:.4f} |")
    plot(rows, lengths)


def plot(rows: list[dict], lengths: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    exact = next(r for r in rows if r["variant"] == "exact")
    channel = sorted((r for r in rows if r["variant"].startswith("channel")), key=lambda r: r["key_distortion"])
    served = [r for r in rows if r["variant"].startswith("served")]
    total = exact["prompts"]
    ax.axhline(exact["found"] / total * 100, color="k", lw=1, ls="--", label="exact (no compression)")
    ax.plot([r["key_distortion"] for r in channel], [r["found"] / total * 100 for r in channel], "o-",
            label="Gaussian key error at distortion D (ideal code)")
    for r in served:
        ax.plot(r["key_distortion"], r["found"] / total * 100, "s", ms=8,
                label=f"served {r['variant'].split(':')[1]}")
    ax.axvline(1 / 64, color="C3", lw=1, ls=":", label="3-bit rate-distortion bound (1/64)")
    ax.set_xlabel("key distortion D (mean |k - k_hat|^2 / |k|^2)")
    ax.set_ylabel(f"needles found, % of {total}")
    ax.set_title(f"SmolLM2-135M NIAH, {'/'.join(str(n // 1024) + 'k' for n in lengths)}, whole prefill")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / "niah-vs-key-distortion.png", dpi=120)


if __name__ == "__main__":
    main()

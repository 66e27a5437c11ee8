# SPDX-License-Identifier: Apache-2.0
"""PNG plots from a report dict (matplotlib, Agg backend): a NIAH heatmap per config, dPPL/KL bars,
NIAH accuracy by length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tq_eval.configs import safe_name  # noqa: E402

INSTALL_LABEL = {"patched": "ours", "stock": "stock"}
INSTALL_COLOR = {"patched": "#1f77b4", "stock": "#d62728"}
# Weight rows (KV dtype auto, the weights quantized): TurboQuant green, the RTN control and fp8 grey.
WEIGHTS_COLOR = {"tq": "#2ca02c", "other": "#7f7f7f"}


def _weights(row: dict) -> str:
    return row.get("weights") or "none"  # reports written before the weight axis have none


def _label(row: dict) -> str:
    if _weights(row) != "none":
        return f"weights {_weights(row)}, KV {row['dtype']} ({INSTALL_LABEL.get(row['install'], row['install'])})"
    return f"{row['dtype']} ({INSTALL_LABEL.get(row['install'], row['install'])})"


def _color(row: dict) -> str:
    w = _weights(row)
    if w != "none":
        return WEIGHTS_COLOR["tq" if w.startswith("tq") else "other"]
    return INSTALL_COLOR.get(row["install"], "gray")


def _is_reference(row: dict) -> bool:
    return row["dtype"] == "auto" and _weights(row) == "none"


def heatmap_name(row: dict) -> str:
    w = _weights(row)
    return f"niah_{safe_name(row['dtype'])}_{row['install']}" + (f"_weights-{safe_name(w)}" if w != "none" else "")


def niah_heatmap(row: dict, model_name: str, path: Path) -> Path:
    cells = row["niah"]["cells"]
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth_percent"] for c in cells})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for c in cells:
        if c["acc"] is not None:
            grid[depths.index(c["depth_percent"]), lengths.index(c["length"])] = c["acc"]
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 2.5, 0.45 * len(depths) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"NIAH exact retrieval: {model_name}\n{_label(row)}", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def dppl_kl_bars(rows: list[dict], model_name: str, path: Path) -> Path | None:
    missing = [r for r in rows if r.get("dppl_pct") is None and not _is_reference(r)]
    rows = [r for r in rows if r.get("dppl_pct") is not None and not _is_reference(r)]
    if not rows:
        return None
    labels = [_label(r) for r in rows]
    colors = [_color(r) for r in rows]
    y = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.38 * len(rows) + 1.6), sharey=True)
    for ax, key, title in ((axes[0], "dppl_pct", "perplexity increase vs bf16 (%)"),
                           (axes[1], "kl_mean", "KL(bf16 || dtype), top-K estimate")):
        vals = [r[key] for r in rows]
        ax.barh(y, vals, color=colors)
        ax.set_title(title, fontsize=10)
        ax.axvline(0, color="black", lw=0.6)
        ax.grid(axis="x", alpha=0.3)
        for yi, v in zip(y, vals):
            ax.text(v, yi, f" {v:.3g}", va="center", fontsize=7)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    what = "KV-cache and weight" if any(_weights(r) != "none" for r in rows) else "KV-cache"
    fig.suptitle(f"{model_name}: {what} quality vs bf16 (lower is better)", fontsize=11)
    fig.tight_layout()
    if missing:
        fig.subplots_adjust(bottom=max(0.12, 0.5 / (len(rows) + 2)))
        fig.text(0.01, 0.01, "no result (see report): " + ", ".join(_label(r) for r in missing), fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def niah_by_length(rows: list[dict], model_name: str, path: Path) -> Path | None:
    rows = [r for r in rows if r.get("niah") and r["niah"]["by_length"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # One colour per dtype (stock and ours of a dtype differ by line style only); tab20 so that a full
    # suite's 15 lines do not repeat tab10's colours.
    dtypes = list(dict.fromkeys((r["dtype"], _weights(r)) for r in rows))
    palette = plt.get_cmap("tab20")
    for r in rows:
        items = sorted((int(k), v["acc"]) for k, v in r["niah"]["by_length"].items() if v["acc"] is not None)
        if not items:
            continue
        xs, ys = zip(*items)
        style = "--" if r["install"] == "stock" else "-"
        lw = 2.5 if _is_reference(r) else 1.2
        ax.plot(xs, ys, style, marker="o", lw=lw, ms=3, color=palette(dtypes.index((r["dtype"], _weights(r))) % 20),
                label=_label(r))
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("NIAH accuracy")
    ax.set_title(f"NIAH accuracy by context length: {model_name}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_all(report: dict, plots_dir: Path) -> list[Path]:
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    name = report["model"]["name"]
    out = []
    for p in (dppl_kl_bars(report["rows"], name, plots_dir / "dppl_kl.png"),
              niah_by_length(report["rows"], name, plots_dir / "niah_by_length.png")):
        if p is not None:
            out.append(p)
    for row in report["rows"]:
        if row.get("niah") and row["niah"]["cells"]:
            out.append(niah_heatmap(row, name, plots_dir / f"{heatmap_name(row)}.png"))
    return out

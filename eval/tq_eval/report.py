# SPDX-License-Identifier: Apache-2.0
"""Turn the per-config results of one model into report.json, report.md and PNG plots.

Two steps, so plots can be redrawn anywhere from report.json alone:
- ``summarize(model, raw_dir, ...)`` reads ``raw/<config>/result.json`` and the perplexity
  logprobs, computes dPPL / KL / top-1 agreement against the bf16 config (KV dtype "auto", weights
  "none"), the acceptance checks, and returns the report dict;
- ``write_report(report, out_dir)`` writes report.json, report.md, configs/<id>.json (each
  config's result without bulky records) and plots/*.png.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from tq_eval import capacity
from tq_eval.configs import (
    ACCEPTANCE_PRESETS,
    BASELINE_DTYPES,
    INSTALLS,
    NO_WEIGHTS,
    REFERENCE_DTYPE,
    WEIGHTS_INSTALL,
    prefill_label,
    rtn_bits,
    rtn_name,
    weights_rank,
)
from tq_eval.logprob_metrics import PromptLogprobs, compare, perplexity
from tq_eval.niah import summarize as summarize_niah

SCHEMA = "tq-eval-report/1"
REPORT_JSON, REPORT_MD, PLOTS_DIR, CONFIGS_DIR = "report.json", "report.md", "plots", "configs"
NIAH_REFERENCE_MIN_ACC = 0.9
NIAH_SIGNIFICANCE = 0.05  # one-sided Fisher exact test level of niah_shortfall_beyond_noise
# Largest perplexity increase vs bf16 (%) each TurboQuant weight format is accepted with.
WEIGHT_DPPL_BUDGET_PCT = {"tq4": 3.0, "tq3": 10.0}

KL_NOTE = (
    "KL(bf16 || dtype) is a top-K estimate: vLLM returns only the top-K prompt logprobs, so the "
    "distributions are compared on the tokens known under both (bf16's top-K found in the other "
    "top-K, plus the actual next token) and one bucket holding all remaining mass. Merging "
    "outcomes never increases KL, so the numbers are lower bounds of the true KL."
)
POSITIONS_NOTE = (
    "Perplexity, KL and top-1 agreement are scored only at positions whose prediction was made "
    "past the first prefill chunk: chunked prefill (vLLM long_prefill_token_threshold) makes every "
    "later chunk attend to the earlier tokens through the KV cache, while first-chunk tokens "
    "attend to fresh full-precision keys and values on the TurboQuant backends."
)


def niah_shortfall_p(ref: dict, got: dict) -> float:
    """One-sided Fisher exact p-value that ``got`` retrieves less often than ``ref`` by chance alone.

    ``ref``/``got``: {"acc": fraction correct, "n": prompts}. Conditioning on the total of correct answers,
    the number correct in ``got`` is hypergeometric under "same accuracy"; p = P(X <= observed)."""
    n1, n2 = int(ref["n"]), int(got["n"])
    k1, k2 = round(ref["acc"] * n1), round(got["acc"] * n2)
    total, k = n1 + n2, k1 + k2
    denom = math.comb(total, n2)
    return sum(math.comb(k, x) * math.comb(total - k, n2 - x) for x in range(max(0, n2 - (total - k)), k2 + 1)) / denom


def weights_of(item: dict) -> str:
    """The weights name of a config or a row; results and reports written before the weight axis have none:
    the model's own weights."""
    return item.get("weights") or NO_WEIGHTS


def _dtype_order(dtype: str) -> tuple[int, int, str]:
    if dtype in BASELINE_DTYPES:
        return (0, BASELINE_DTYPES.index(dtype), dtype)
    try:
        from turboquant_core.formats import format_names

        names = format_names()
        return (1, names.index(dtype), dtype) if dtype in names else (2, 0, dtype)
    except ImportError:
        return (2, 0, dtype)


def load_results(raw_dir: Path) -> list[dict]:
    out = []
    for p in sorted(Path(raw_dir).glob("*/result.json")):
        r = json.loads(p.read_text())
        r["_dir"] = str(p.parent)
        out.append(r)
    return out


def _load_logprobs(result: dict) -> PromptLogprobs | None:
    ppl = (result.get("tasks") or {}).get("ppl") or {}
    if "error" in ppl or not ppl.get("logprobs_file"):
        return None
    path = Path(result["_dir"]) / ppl["logprobs_file"]
    if not path.is_file():
        return None
    from safetensors.numpy import load_file

    return PromptLogprobs.from_tensors(load_file(str(path)))


def _references(results: list[dict]) -> dict[str, dict]:
    """bf16 reference per install: the install's own "auto" run with the model's own weights, else the other
    install's (a weight config runs with KV dtype "auto" too, and is measured against the reference)."""
    refs = {r["config"]["install"]: r for r in results
            if r["config"]["dtype"] == REFERENCE_DTYPE and weights_of(r["config"]) == NO_WEIGHTS
            and _load_logprobs(r) is not None}
    fallback = refs.get("patched") or next(iter(refs.values()), None)
    return {inst: refs.get(inst, fallback) for inst in INSTALLS if refs.get(inst, fallback) is not None}


def _niah_section(result: dict) -> dict | None:
    niah = (result.get("tasks") or {}).get("niah")
    if not niah:
        return None
    summary = summarize_niah(niah.get("records", []))
    return {"overall": summary["overall"], "by_length": summary["by_length"], "cells": summary["cells"],
            "errors": niah.get("errors") or {}, "error": niah.get("error"),
            "chat_template": niah.get("chat_template"), "depths": niah.get("depths"),
            "samples_per_cell": niah.get("samples_per_cell")}


def summarize(model: dict, raw_dir: Path, not_run: list[dict] | None = None, settings: dict | None = None) -> dict:
    """The report dict of one model from ``raw_dir/<config id>/``."""
    results = load_results(raw_dir)
    refs = _references(results)
    ref_lp_cache: dict[str, PromptLogprobs | None] = {}
    rows = []
    for r in results:
        cfg = r["config"]
        tasks = r.get("tasks") or {}
        row = {
            "id": cfg["id"], "dtype": cfg["dtype"], "install": cfg["install"], "weights": weights_of(cfg),
            "status": r.get("status"),
            "error": r.get("error"), "task_errors": {k: v["error"] for k, v in tasks.items()
                                                     if isinstance(v, dict) and v.get("error")},
            "vllm_version": (r.get("engine") or {}).get("vllm_version"),
            "timings": {**(r.get("timings") or {}), "wall_s": r.get("wall_s")},
        }
        # perplexity, KL, top-1 against the bf16 reference
        ref = refs.get(cfg["install"])
        lp = _load_logprobs(r)
        if lp is not None:
            row["ppl"] = perplexity(lp.target_logprobs)
            row["ppl_tokens"] = len(lp)
            if ref is not None:
                if ref["config"]["id"] not in ref_lp_cache:
                    ref_lp_cache[ref["config"]["id"]] = _load_logprobs(ref)
                try:
                    cmp = compare(ref_lp_cache[ref["config"]["id"]], lp)
                    row.update(
                        reference=ref["config"]["id"], ref_ppl=cmp["ppl_ref"], dppl_pct=cmp["dppl_pct"],
                        kl_mean=cmp["kl_mean"],
                        kl_median=cmp["kl_median"], kl_p99=cmp["kl_p99"], top1_agree=cmp["top1_agree"],
                        ref_rest_mass_mean=cmp["ref_rest_mass_mean"], topk=cmp["topk"],
                    )
                except ValueError as e:
                    row["task_errors"]["kl"] = str(e)
        row["niah"] = _niah_section(r)
        if "niah" not in row["task_errors"]:  # a whole-task error already says it all
            for length, err in ((row["niah"] or {}).get("errors") or {}).items():
                row["task_errors"][f"niah {length}"] = err
        g = tasks.get("gsm8k")
        row["gsm8k"] = g if g and "error" not in g else None
        mi = model
        row["capacity"] = {
            "format_bytes_per_token_per_head": None if cfg["install"] == "stock" and cfg["dtype"] not in BASELINE_DTYPES
            else capacity.bytes_per_token_per_head(cfg["dtype"], mi["head_dim"]),
            "format_bytes_per_token": None if cfg["install"] == "stock" and cfg["dtype"] not in BASELINE_DTYPES
            else capacity.bytes_per_token(cfg["dtype"], mi["head_dim"], mi["num_kv_heads"], mi["num_layers"]),
            "kv_cache_tokens": (r.get("engine") or {}).get("kv_cache_tokens"),
        }
        row["model_memory_gib"] = (r.get("engine") or {}).get("model_memory_gib")
        rows.append(row)
    # The reference first, then the KV-cache dtypes, then the weight configs.
    rows.sort(key=lambda x: (not _is_reference(x), weights_rank(x["weights"]),
                             _dtype_order(x["dtype"]), INSTALLS.index(x["install"])))
    lengths = sorted({int(k) for row in rows if row.get("niah") for k in row["niah"]["by_length"]})
    report = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": model,
        "settings": settings or {},
        "references": {inst: r["config"]["id"] for inst, r in refs.items()},
        "niah_lengths": lengths,
        "rows": rows,
        "not_run": not_run or [],
        # The perplexity notes only where some row has perplexity (a NIAH-only run has none).
        "notes": [KL_NOTE, POSITIONS_NOTE] if any(row.get("ppl") is not None for row in rows) else [],
    }
    report["checks"] = acceptance_checks(rows) + weight_checks(rows)
    # Two bf16 runs (one per install): their difference is the floor below which dPPL/KL differences
    # are engine noise, not the KV-cache format.
    if "stock" in refs and "patched" in refs and refs["stock"] is not refs["patched"]:
        a, b = _load_logprobs(refs["patched"]), _load_logprobs(refs["stock"])
        try:
            c = compare(a, b)
            report["bf16_noise_floor"] = {"dppl_pct": c["dppl_pct"], "kl_mean": c["kl_mean"],
                                          "top1_agree": c["top1_agree"]}
        except ValueError as e:
            report["bf16_noise_floor"] = {"error": str(e)}
    return report


def _is_reference(row: dict) -> bool:
    return row["dtype"] == REFERENCE_DTYPE and weights_of(row) == NO_WEIGHTS


def _row(rows: list[dict], dtype: str, install: str, weights: str = NO_WEIGHTS) -> dict | None:
    return next((r for r in rows if r["dtype"] == dtype and r["install"] == install and weights_of(r) == weights),
                None)


def _gsm8k_se(g: dict, key: str) -> float | None:
    se = g.get(f"{key}_stderr")
    if se is None and g.get(key) is not None and g.get("n"):
        p = g[key]
        se = math.sqrt(max(p * (1 - p), 0.0) / g["n"])
    return se


def acceptance_checks(rows: list[dict]) -> list[dict]:
    """The issue's acceptance criteria, evaluated on this model's rows.

    - ppl/KL: ours (patched) at 4bit_nc and k3v4_nc has a smaller dPPL and a smaller KL than
      stock at the same preset, or stock could not run the model;
    - NIAH: every patched TurboQuant config matches the bf16 accuracy at every length where
      bf16 scores >= 90% (matches = at least as many needles found); where it falls short,
      ``niah_shortfall_beyond_noise`` (informational) says whether the shortfall is more than
      sampling noise (one-sided Fisher exact test, p < 0.05);
    - GSM8K (informational): each config within two standard errors of bf16.
    """
    checks = []
    for preset in ACCEPTANCE_PRESETS:
        ours, stock = _row(rows, preset, "patched"), _row(rows, preset, "stock")
        c = {"check": "ppl_kl_vs_stock", "dtype": preset}
        if ours is None or ours.get("kl_mean") is None:
            c.update(result="not tested", detail="no perplexity/KL for ours" + (
                f": {ours.get('error') or ours['task_errors']}" if ours else " (not run)"))
        elif stock is None:
            c.update(result="not tested", detail="stock not run")
        elif stock.get("kl_mean") is None:
            errs = stock["task_errors"]
            why = stock.get("error") or errs.get("ppl") or errs.get("kl") or stock["status"]
            c.update(result="pass", detail=f"stock cannot run this model: {why}")
        else:
            ok = ours["dppl_pct"] < stock["dppl_pct"] and ours["kl_mean"] < stock["kl_mean"]
            c.update(result="pass" if ok else "fail",
                     detail=(f"dPPL ours {ours['dppl_pct']:+.3f}% vs stock {stock['dppl_pct']:+.3f}%; "
                             f"KL ours {ours['kl_mean']:.5f} vs stock {stock['kl_mean']:.5f}"))
        checks.append(c)
    ref = _row(rows, REFERENCE_DTYPE, "patched") or _row(rows, REFERENCE_DTYPE, "stock")
    ref_niah = (ref or {}).get("niah") or {}
    strong = {L: v["acc"] for L, v in (ref_niah.get("by_length") or {}).items()
              if v["acc"] is not None and v["acc"] >= NIAH_REFERENCE_MIN_ACC}
    for row in rows:
        if row["install"] != "patched" or not row["dtype"].startswith("turboquant_") or weights_of(row) != NO_WEIGHTS:
            continue
        c = {"check": "niah_matches_bf16", "dtype": row["dtype"]}
        noise = None
        if not ref_niah:
            c.update(result="not tested", detail="no bf16 NIAH")
        elif not strong:
            c.update(result="not tested", detail="bf16 scores below 90% at every length")
        elif not row.get("niah"):
            c.update(result="fail", detail=f"no NIAH result: {row.get('error') or row['task_errors']}")
        else:
            mine = row["niah"]["by_length"]
            bad = [L for L, acc in strong.items() if (mine.get(L) or {}).get("acc") is None or mine[L]["acc"] < acc]
            c.update(result="fail" if bad else "pass", lengths=sorted(int(x) for x in strong),
                     detail=("below bf16 at " + ", ".join(
                         f"{L}: {(mine.get(L) or {}).get('acc')} < {strong[L]}" for L in bad)) if bad
                     else "equal or better at lengths " + ", ".join(sorted(strong, key=int)))
            # The strict check above counts a single missed needle; this one says whether a shortfall is
            # more than sampling noise (one-sided Fisher exact test per length, informational).
            tests = {L: niah_shortfall_p(ref_niah["by_length"][L], mine[L]) for L in bad
                     if (mine.get(L) or {}).get("acc") is not None}
            if tests:
                sig = [L for L, pv in tests.items() if pv < NIAH_SIGNIFICANCE]
                noise = {"check": "niah_shortfall_beyond_noise", "dtype": row["dtype"], "informational": True,
                         "result": "fail" if sig else "pass",
                         "detail": "one-sided Fisher exact p per length below bf16: " + ", ".join(
                             f"{L}: {pv:.3f}" for L, pv in tests.items())
                         + (f" (below {NIAH_SIGNIFICANCE} at {', '.join(sig)})" if sig else
                            f" (all >= {NIAH_SIGNIFICANCE}: within sampling noise)")}
        checks.append(c)
        if noise:
            checks.append(noise)
    ref_g = (ref or {}).get("gsm8k")
    for row in rows:
        g = row.get("gsm8k")
        if not ref_g or not g or row is ref:
            continue
        for key in ("strict", "flexible"):
            se_r, se = _gsm8k_se(ref_g, key), _gsm8k_se(g, key)
            if g.get(key) is None or ref_g.get(key) is None or se is None or se_r is None:
                continue
            band = 2 * math.sqrt(se_r**2 + se**2)
            diff = g[key] - ref_g[key]
            checks.append({"check": f"gsm8k_{key}_within_noise", "dtype": row["dtype"], "install": row["install"],
                           "weights": weights_of(row), "result": "pass" if abs(diff) <= band else "fail",
                           "informational": True, "detail": f"{diff:+.3f} vs bf16 (2 s.e. band {band:.3f})"})
    return checks


def _why_missing(row: dict | None) -> str:
    if row is None:
        return "not run"
    errs = row.get("task_errors") or {}
    if row.get("ppl") is not None:
        return f"no comparison with bf16: {errs.get('kl') or 'no bf16 reference run'}"
    return f"no perplexity: {row.get('error') or errs.get('ppl') or row['status']}"


def weight_checks(rows: list[dict]) -> list[dict]:
    """The weight axis, where the report has weight rows (KV dtype "auto", patched):

    - ``weights_dppl_within_budget``: each TurboQuant weight format's perplexity at most
      ``WEIGHT_DPPL_BUDGET_PCT`` above bf16 (tq4 +3 %, tq3 +10 %);
    - ``weights_tq_beats_rtn``: each TurboQuant weight format has a lower perplexity than its round-to-nearest
      control at the same bits, group size and bytes (``tq_eval.rtn``).
    """
    if all(weights_of(r) == NO_WEIGHTS for r in rows):
        return []
    checks = []
    for tq, budget in WEIGHT_DPPL_BUDGET_PCT.items():
        row = _row(rows, REFERENCE_DTYPE, WEIGHTS_INSTALL, tq)
        c = {"check": "weights_dppl_within_budget", "dtype": REFERENCE_DTYPE, "install": WEIGHTS_INSTALL,
             "weights": tq}
        if row is None or row.get("dppl_pct") is None:
            c.update(result="not tested", detail=_why_missing(row))
        else:
            c.update(result="pass" if row["dppl_pct"] <= budget else "fail", dppl_pct=row["dppl_pct"],
                     budget_pct=budget,
                     detail=f"ΔPPL {row['dppl_pct']:+.2f}% vs bf16 (PPL {_f(row.get('ref_ppl'), '.3f')} -> "
                            f"{row['ppl']:.3f}); budget +{budget:g}%")
        checks.append(c)
    for tq in WEIGHT_DPPL_BUDGET_PCT:
        rtn = rtn_name(tq)
        mine, control = _row(rows, REFERENCE_DTYPE, WEIGHTS_INSTALL, tq), _row(rows, REFERENCE_DTYPE,
                                                                              WEIGHTS_INSTALL, rtn)
        c = {"check": "weights_tq_beats_rtn", "dtype": REFERENCE_DTYPE, "install": WEIGHTS_INSTALL, "weights": tq}
        if mine is None or mine.get("ppl") is None:
            c.update(result="not tested", detail=f"{tq}: {_why_missing(mine)}")
        elif control is None or control.get("ppl") is None:
            c.update(result="not tested", detail=f"{rtn}: {_why_missing(control)}")
        else:
            c.update(result="pass" if mine["ppl"] < control["ppl"] else "fail",
                     detail=f"PPL {tq} {mine['ppl']:.3f} vs {rtn} {control['ppl']:.3f} (ΔPPL vs bf16 "
                            f"{_f(mine.get('dppl_pct'), '+.2f')}% vs {_f(control.get('dppl_pct'), '+.2f')}%)")
        checks.append(c)
    return checks


# ----------------------------------------------------------------------------- rendering

def _f(x, spec: str, dash: str = "—") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return dash
    return format(x, spec)


def _pct(x) -> str:
    return _f(None if x is None else 100 * x, ".0f") + ("%" if x is not None else "")


def _len_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _config_label(item: dict) -> str:
    """`dtype` (install), with the weights where they are not the model's own."""
    w = weights_of(item)
    return f"`{item['dtype']}`" + (f" weights `{w}`" if w != NO_WEIGHTS else "") + f" ({item['install']})"


def render_markdown(report: dict) -> str:
    m = report["model"]
    s = report.get("settings") or {}
    eng, tk = s.get("engine") or {}, s.get("tasks") or {}
    lengths = report["niah_lengths"]
    weight_axis = any(weights_of(r) != NO_WEIGHTS for r in report["rows"])
    lines = [
        f"# {'KV-cache and weight' if weight_axis else 'KV-cache'} quality: {m['name']}",
        "",
        f"Model `{m['name']}` ({m.get('architecture', '?')}: {m['num_layers']} layers, {m['num_kv_heads']} KV heads, "
        f"head_dim {m['head_dim']}). Report created {report['created']}.",
        "",
    ]
    if tk:
        lines += [
            (f"- Perplexity / KL / top-1: `{Path(str(tk.get('text_path'))).name}`, {tk.get('ppl_windows')} windows of "
             f"{tk.get('ppl_window_tokens')} tokens, top-{tk.get('topk')} prompt logprobs, prefill chunk "
             f"{eng.get('prefill_chunk')} tokens." if tk.get("text_path") and "ppl" in tk.get("tasks", ["ppl"]) else
             "- Perplexity / KL / top-1: not run."),
            f"- NIAH: depths {', '.join(f'{d:g}' for d in tk.get('niah_depths') or [])} %, "
            f"{tk.get('niah_samples')} prompts per (length, depth), exact retrieval, prompts prefilled "
            f"{prefill_label(eng.get('prefill_chunk', 256))}.",
            (f"- GSM8K: lm-eval `gsm8k`, {tk.get('gsm8k_fewshot')}-shot, limit {tk.get('gsm8k_limit')}, data "
             f"`{tk.get('gsm8k_data')}`." if tk.get("gsm8k_data") else "- GSM8K: not run (no data given)."),
            f"- Engine: enforce_eager={eng.get('enforce_eager')}, KV pool {eng.get('kv_cache_gib')} GiB, "
            f"prefix caching off.",
        ]
    if weight_axis:
        names = [w for w in dict.fromkeys(weights_of(r) for r in report["rows"]) if w != NO_WEIGHTS]
        rtn_dir = (s.get("weights") or {}).get("rtn_dir")
        rtn = [w for w in names if rtn_bits(w) is not None]
        lines.append(f"- Weights: {', '.join(f'`{w}`' for w in names)}, each with KV dtype `auto` on patched"
                     + (f"; {', '.join(rtn)} served as fake-quantized copies of the model folder" if rtn else "")
                     + (f" (in `{rtn_dir}`)." if rtn and rtn_dir else "."))
    if tk or weight_axis:
        lines.append("")
    head = (["KV-cache dtype", "weights", "install", "status", "PPL", "ΔPPL %", "KL", "top-1 agree"]
            + [f"NIAH {_len_label(n)}" for n in lengths]
            + ["GSM8K strict", "GSM8K flex", "B/token/head", "KV tokens", "model GiB", "start s"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for row in report["rows"]:
        status = row["status"] or "?"
        if row.get("error") or row.get("task_errors"):
            notes.append(row)
            status += f" [{len(notes)}]"
        niah = (row.get("niah") or {}).get("by_length") or {}
        g = row.get("gsm8k") or {}
        cap = row.get("capacity") or {}
        cells = [
            f"`{row['dtype']}`", f"`{weights_of(row)}`", row["install"], status,
            _f(row.get("ppl"), ".3f"), _f(row.get("dppl_pct"), "+.2f"), _f(row.get("kl_mean"), ".4f"),
            _pct(row.get("top1_agree")),
            *[_pct((niah.get(str(n)) or {}).get("acc")) for n in lengths],
            _f(g.get("strict"), ".3f"), _f(g.get("flexible"), ".3f"),
            _f(cap.get("format_bytes_per_token_per_head"), "d"), _f(cap.get("kv_cache_tokens"), ",d"),
            _f(row.get("model_memory_gib"), ".3f"), _f((row.get("timings") or {}).get("engine_start_s"), ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "install: `patched` is this fork (ours), `stock` unpatched vLLM. "
        "weights: `none` the checkpoint's own (bf16), `fp8` vLLM's online fp8, `tq4`/`tq3` TurboQuant "
        "(`--quantization`), `tq4-fp16-decode`/`tq3-fp16-decode` the same with decode-sized products in fp16 "
        "(`--no-tq-weights-decode-int8`), `rtn4`/`rtn3` the round-to-nearest control at tq's group size and bytes. "
        "ΔPPL % and KL are against the bf16 run (`auto`, weights `none`); KL is a top-K lower-bound estimate (see "
        "notes). B/token/head: K+V bytes per token and KV head in this project's format table (stock rows: stock's "
        "own layout differs, so none is given). KV tokens: vLLM's reported KV-cache capacity for the fixed KV pool. "
        "model GiB: vLLM's reported model memory (the weights as served).",
        "",
    ]
    floor = report.get("bf16_noise_floor") or {}
    if floor.get("kl_mean") is not None:
        lines += [
            f"bf16 noise floor (stock bf16 vs patched bf16): ΔPPL {floor['dppl_pct']:+.3f} %, KL "
            f"{floor['kl_mean']:.2e}, top-1 agree {100 * floor['top1_agree']:.1f} %.",
            "",
        ]
    lines += [
        "## Acceptance checks",
        "",
    ]
    for c in report.get("checks", []):
        tag = " (informational)" if c.get("informational") else ""
        who = f" {c['install']}" if c.get("install") else ""
        w = weights_of(c)
        what = f"`{c['dtype']}`" + (f" weights `{w}`" if w != NO_WEIGHTS else "")
        lines.append(f"- **{c['result']}** {c['check']}{tag} {what}{who}: {c.get('detail', '')}")
    if notes:
        lines += ["", "## Errors", ""]
        for i, row in enumerate(notes, start=1):
            parts = []
            if row.get("error"):
                parts.append(row["error"])
            parts += [f"{k}: {v}" for k, v in (row.get("task_errors") or {}).items()]
            text = " | ".join(p.replace("\n", " ")[:600] for p in parts)
            lines.append(f"{i}. {_config_label(row)}: {text}")
    if report.get("not_run"):
        lines += ["", "Not run: " + "; ".join(
            f"`{x['dtype']}`" + (f" weights `{weights_of(x)}`" if weights_of(x) != NO_WEIGHTS else "")
            + f" on {x['install']} ({x['reason']})" for x in report["not_run"])]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report.get("notes", [])]
    plots = report.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _slim_result(result: dict) -> dict:
    r = {k: v for k, v in result.items() if not k.startswith("_")}
    niah = (r.get("tasks") or {}).get("niah")
    if niah and "records" in niah:
        # keep the per-sample outcomes (small) but not the answers' text beyond a few characters
        niah = dict(niah)
        niah["records"] = [{k: v for k, v in rec.items() if k != "prompt"} for rec in niah["records"]]
        r["tasks"] = {**r["tasks"], "niah": niah}
    return r


def write_report(report: dict, out_dir: Path, raw_dir: Path | None = None, plots: bool = True) -> list[Path]:
    """Write report.json, report.md, configs/*.json and plots/*.png; returns the written paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if raw_dir is not None:
        cdir = out_dir / CONFIGS_DIR
        cdir.mkdir(exist_ok=True)
        for r in load_results(raw_dir):
            p = cdir / f"{r['config']['id']}.json"
            p.write_text(json.dumps(_slim_result(r), indent=1))
            written.append(p)
    report = dict(report)
    report["plots"] = []
    if plots:
        try:
            from tq_eval import plots as plot_mod

            report["plots"] = [str(p.relative_to(out_dir)) for p in plot_mod.render_all(report, out_dir / PLOTS_DIR)]
        except ImportError as e:
            report.setdefault("notes", []).append(f"plots not drawn: {e}")
    jp = out_dir / REPORT_JSON
    jp.write_text(json.dumps(report, indent=1))
    mp = out_dir / REPORT_MD
    mp.write_text(render_markdown(report))
    written += [jp, mp] + [out_dir / p for p in report["plots"]]
    return written

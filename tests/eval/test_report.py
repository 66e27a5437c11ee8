# SPDX-License-Identifier: Apache-2.0
import json

import numpy as np
import pytest
from tq_eval import report as R
from tq_eval.logprob_metrics import PromptLogprobs

MODEL = {"name": "tiny", "path": "/m", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
         "max_position_embeddings": 8192, "architecture": "LlamaForCausalLM"}
N, VOCAB, K = 150, 40, 10


def _dist(noise, seed=0):
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=(N, VOCAB)) * 2.0
    lp += noise * np.random.default_rng(100 + int(noise * 1000)).normal(size=(N, VOCAB))
    return lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))


def _topk(full):
    t = np.random.default_rng(7).integers(0, VOCAB, N)
    order = np.argsort(-full, axis=1)[:, :K]
    return PromptLogprobs(t, full[np.arange(N), t], order, np.take_along_axis(full, order, 1))


def _niah(acc_by_length):
    recs = []
    for length, accs in acc_by_length.items():
        for depth, ok in zip((0.0, 50.0, 100.0, 100.0), accs):
            recs.append({"length": length, "depth_percent": depth, "sample": 0, "needle": "123456",
                         "num_tokens": length - 3, "correct": ok, "answer": " 123456." if ok else " 1."})
    return {"records": recs, "errors": {}, "depths": [0.0, 50.0, 100.0], "samples_per_cell": 1}


def _shifted(shift):
    """The reference distribution with each actual token's logit lowered by ``shift``: perplexity grows with it."""
    full = _dist(0.0)
    t = np.random.default_rng(7).integers(0, VOCAB, N)  # the targets _topk draws
    full[np.arange(N), t] -= shift
    return full - np.log(np.exp(full).sum(axis=1, keepdims=True))


def _write(raw, install, dtype, *, noise=None, niah=None, gsm8k=None, status="ok", error=None, weights=None,
           shift=None):
    """One config's raw/ folder; ``weights=None`` writes a result as the suite did before the weight axis."""
    from safetensors.numpy import save_file

    d = raw / (f"{install}__{dtype}" + (f"__weights-{weights}" if weights not in (None, "none") else ""))
    d.mkdir(parents=True)
    tasks = {}
    if noise is not None or shift is not None:
        full = _shifted(shift) if shift is not None else _dist(noise)
        save_file(_topk(full).to_tensors(), str(d / "ppl_logprobs.safetensors"))
        tasks["ppl"] = {"ppl": 0.0, "logprobs_file": "ppl_logprobs.safetensors"}
    if niah is not None:
        tasks["niah"] = _niah(niah)
    if gsm8k is not None:
        tasks["gsm8k"] = gsm8k
    cfg = {"id": d.name, "dtype": dtype, "install": install, "model": MODEL}
    if weights is not None:
        cfg["weights"] = weights
    res = {"config": cfg, "status": status,
           "error": error, "engine": {"vllm_version": "0.26.0", "kv_cache_tokens": 1000}, "tasks": tasks,
           "timings": {"engine_start_s": 33.0}, "wall_s": 50.0}
    (d / "result.json").write_text(json.dumps(res))


@pytest.fixture
def raw(tmp_path):
    raw = tmp_path / "run" / "raw"
    g = {"strict": 0.05, "strict_stderr": 0.02, "flexible": 0.06, "flexible_stderr": 0.02, "n": 100}
    _write(raw, "patched", "auto", noise=0.0, niah={1024: [1, 1, 1, 1], 2048: [1, 0, 1, 0]}, gsm8k=g)
    _write(raw, "patched", "turboquant_4bit_nc", noise=0.05, niah={1024: [1, 1, 1, 1], 2048: [0, 0, 1, 0]},
           gsm8k={**g, "strict": 0.04})
    _write(raw, "stock", "turboquant_4bit_nc", noise=0.3, niah={1024: [1, 0, 1, 1], 2048: [0, 0, 0, 0]},
           gsm8k={**g, "strict": 0.50})
    _write(raw, "patched", "turboquant_k3v4_nc", noise=0.1, niah={1024: [1, 1, 0, 1], 2048: [1, 1, 1, 1]})
    _write(raw, "stock", "turboquant_k3v4_nc", status="error",
           error="ValueError: Unknown TurboQuant cache dtype: 'auto'")
    return raw


def _check(report, name, dtype, install=None):
    return next(c for c in report["checks"] if c["check"] == name and c["dtype"] == dtype
                and (install is None or c.get("install") == install))


def test_summary_metrics_and_checks(raw):
    rep = R.summarize(MODEL, raw, not_run=[{"model": "tiny", "dtype": "fp8", "install": "stock",
                                            "reason": "baseline runs once"}])
    rows = {r["id"]: r for r in rep["rows"]}
    assert rep["rows"][0]["id"] == "patched__auto"
    assert rows["patched__auto"]["dppl_pct"] == pytest.approx(0.0)
    assert rows["patched__auto"]["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert rows["patched__auto"]["top1_agree"] == 1.0
    ours, stock = rows["patched__turboquant_4bit_nc"], rows["stock__turboquant_4bit_nc"]
    assert 0 < ours["kl_mean"] < stock["kl_mean"]
    assert ours["top1_agree"] > stock["top1_agree"]
    assert rows["stock__turboquant_k3v4_nc"].get("kl_mean") is None
    assert ours["capacity"]["format_bytes_per_token_per_head"] == 68  # 4-bit K and V at d=64: 2 x (32 + 2)
    assert ours["capacity"]["format_bytes_per_token"] == 68 * 3 * 30
    assert stock["capacity"]["format_bytes_per_token_per_head"] is None  # stock's own layout differs
    assert rows["patched__auto"]["capacity"]["format_bytes_per_token_per_head"] == 256
    assert rep["niah_lengths"] == [1024, 2048]
    assert ours["niah"]["by_length"]["2048"]["acc"] == 0.25

    assert _check(rep, "ppl_kl_vs_stock", "turboquant_4bit_nc")["result"] == "pass"
    k3 = _check(rep, "ppl_kl_vs_stock", "turboquant_k3v4_nc")
    assert k3["result"] == "pass" and "Unknown TurboQuant cache dtype" in k3["detail"]
    # bf16 >= 90% only at 1024: 4bit matches there (its 2048 drop does not count), k3v4 misses one needle
    n4 = _check(rep, "niah_matches_bf16", "turboquant_4bit_nc")
    assert n4["result"] == "pass" and n4["lengths"] == [1024]
    assert _check(rep, "niah_matches_bf16", "turboquant_k3v4_nc")["result"] == "fail"
    assert _check(rep, "gsm8k_strict_within_noise", "turboquant_4bit_nc", "patched")["result"] == "pass"
    assert _check(rep, "gsm8k_strict_within_noise", "turboquant_4bit_nc", "stock")["result"] == "fail"


def test_niah_shortfall_p_is_the_fisher_exact_lower_tail():
    # 4/4 vs 3/4: P(X <= 3 | 7 correct of 8, 4 drawn) = C(7,3) C(1,1) / C(8,4) = 35/70.
    assert R.niah_shortfall_p({"acc": 1.0, "n": 4}, {"acc": 0.75, "n": 4}) == pytest.approx(0.5)
    assert R.niah_shortfall_p({"acc": 0.5, "n": 4}, {"acc": 1.0, "n": 4}) == pytest.approx(1.0)
    # scipy.stats.fisher_exact([[92, 8], [99, 1]], alternative="less") -> p = 0.01745
    assert R.niah_shortfall_p({"acc": 0.99, "n": 100}, {"acc": 0.92, "n": 100}) == pytest.approx(0.017450, abs=1e-6)


def test_niah_shortfall_check_separates_noise_from_loss(tmp_path):
    raw = tmp_path / "raw"
    _write(raw, "patched", "auto", niah={1024: [1, 1, 1, 1]})
    _write(raw, "patched", "turboquant_4bit_nc", niah={1024: [1, 1, 1, 0]})  # one needle missed of 4
    _write(raw, "patched", "turboquant_k8v4", niah={1024: [1, 1, 1, 1]})
    rep = R.summarize(MODEL, raw)
    assert _check(rep, "niah_matches_bf16", "turboquant_4bit_nc")["result"] == "fail"
    noise = _check(rep, "niah_shortfall_beyond_noise", "turboquant_4bit_nc")
    assert noise["result"] == "pass" and noise["informational"] and "1024: 0.500" in noise["detail"]
    assert not [c for c in rep["checks"] if c["check"] == "niah_shortfall_beyond_noise" and
                c["dtype"] == "turboquant_k8v4"]  # nothing below bf16, nothing to test


def test_ours_worse_than_stock_fails(tmp_path):
    raw = tmp_path / "raw"
    _write(raw, "patched", "auto", noise=0.0)
    _write(raw, "patched", "turboquant_4bit_nc", noise=0.3)
    _write(raw, "stock", "turboquant_4bit_nc", noise=0.05)
    rep = R.summarize(MODEL, raw)
    assert _check(rep, "ppl_kl_vs_stock", "turboquant_4bit_nc")["result"] == "fail"
    assert _check(rep, "ppl_kl_vs_stock", "turboquant_k3v4_nc")["result"] == "not tested"


def test_write_report_files(raw):
    out = raw.parent
    rep = R.summarize(MODEL, raw)
    written = R.write_report(rep, out, raw)
    names = {p.relative_to(out).as_posix() for p in written}
    assert {"report.json", "report.md", "plots/dppl_kl.png", "plots/niah_by_length.png",
            "plots/niah_auto_patched.png", "plots/niah_turboquant_4bit_nc_stock.png",
            "configs/stock__turboquant_k3v4_nc.json"} <= names
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000
    md = (out / "report.md").read_text()
    assert ("| KV-cache dtype | weights | install | status | PPL | ΔPPL % | KL | top-1 agree | NIAH 1k | NIAH 2k |"
            in md)
    assert "| `turboquant_4bit_nc` | `none` | stock |" in md
    assert "Unknown TurboQuant cache dtype" in md and "error [1]" in md
    assert "lower bound" in md
    back = json.loads((out / "report.json").read_text())
    assert back["schema"] == R.SCHEMA and "plots/dppl_kl.png" in back["plots"]


def test_report_only_rebuilds_from_raw_and_from_json(raw):
    import run_quality

    run_dir = raw.parent
    (run_dir / "run.json").write_text(json.dumps({"model": MODEL, "settings": {}, "not_run": [],
                                                  "notes": ["a note from the run"]}))
    assert run_quality.main(["--report-only", str(run_dir), "--no-plots"]) == 0
    assert "a note from the run" in (run_dir / "report.md").read_text()
    settings = {"engine": {"prefill_chunk": 0}, "tasks": {"tasks": ["niah"], "text_path": "w.raw",
                                                          "niah_depths": [0, 50], "niah_samples": 3}}
    (run_dir / "run.json").write_text(json.dumps({"model": MODEL, "settings": settings, "not_run": []}))
    assert run_quality.main(["--report-only", str(run_dir), "--no-plots"]) == 0
    md = (run_dir / "report.md").read_text()
    assert "prompts prefilled whole (chunked prefill off)" in md and "Perplexity / KL / top-1: not run." in md
    # Without raw/ (e.g. a committed report): redraw from report.json alone.
    import shutil

    shutil.rmtree(raw)
    (run_dir / "run.json").unlink()
    assert run_quality.main(["--report-only", str(run_dir)]) == 0
    assert (run_dir / "plots" / "dppl_kl.png").is_file()


def test_bf16_noise_floor_when_both_installs_ran_bf16(tmp_path):
    raw = tmp_path / "raw"
    _write(raw, "patched", "auto", noise=0.0)
    _write(raw, "stock", "auto", noise=0.01)
    _write(raw, "stock", "turboquant_4bit_nc", noise=0.3)
    rep = R.summarize(MODEL, raw)
    assert 0 < rep["bf16_noise_floor"]["kl_mean"] < 1e-3
    stock = next(r for r in rep["rows"] if r["id"] == "stock__turboquant_4bit_nc")
    assert stock["reference"] == "stock__auto"  # each install against its own bf16 run
    assert "bf16 noise floor" in R.render_markdown(rep)


def test_a_failed_niah_length_is_reported(tmp_path):
    raw = tmp_path / "raw"
    _write(raw, "patched", "auto", noise=0.0, niah={1024: [1, 1, 1, 1]}, status="partial")
    res_path = raw / "patched__auto" / "result.json"
    res = json.loads(res_path.read_text())
    res["tasks"]["niah"]["errors"] = {"32768": "RuntimeError: CUDA error: an illegal memory access"}
    res_path.write_text(json.dumps(res))
    rep = R.summarize(MODEL, raw)
    row = rep["rows"][0]
    assert row["niah"]["by_length"]["1024"]["acc"] == 1.0
    assert row["task_errors"] == {"niah 32768": "RuntimeError: CUDA error: an illegal memory access"}
    md = R.render_markdown(rep)
    assert "partial [1]" in md and "niah 32768: RuntimeError: CUDA error" in md


def test_perplexity_notes_only_with_perplexity(tmp_path, raw):
    niah_only = tmp_path / "niah-only" / "raw"
    _write(niah_only, "patched", "auto", niah={1024: [1, 1]})
    _write(niah_only, "patched", "turboquant_k3v4_nc", niah={1024: [1, 0]})
    assert R.summarize(MODEL, niah_only)["notes"] == []
    assert R.POSITIONS_NOTE in R.summarize(MODEL, raw)["notes"]


def _weights_raw(tmp_path, shifts, **extra):
    raw = tmp_path / "raw"
    _write(raw, "patched", "auto", weights="none", noise=0.0, niah={1024: [1, 1, 1, 1]})
    _write(raw, "patched", "turboquant_4bit_nc", weights="none", noise=0.05)
    for w, shift in shifts.items():
        _write(raw, "patched", "auto", weights=w, shift=shift, niah={1024: [1, 1, 1, 0]}, **extra.get(w, {}))
    return raw


def test_weight_rows_are_measured_against_the_bf16_run_not_used_as_it(tmp_path):
    # Every weight config runs with KV dtype auto, and sorts after patched__auto: keyed by dtype alone, the
    # last of them would become the reference.
    raw = _weights_raw(tmp_path, {"tq4": 0.02, "rtn4": 0.08, "tq3": 0.3, "rtn3": 0.15, "fp8": 0.01})
    rep = R.summarize(MODEL, raw)
    assert rep["references"] == {"stock": "patched__auto", "patched": "patched__auto"}
    rows = {r["id"]: r for r in rep["rows"]}
    assert [r["id"] for r in rep["rows"]] == [
        "patched__auto", "patched__turboquant_4bit_nc", "patched__auto__weights-tq4", "patched__auto__weights-rtn4",
        "patched__auto__weights-tq3", "patched__auto__weights-rtn3", "patched__auto__weights-fp8"]
    assert rows["patched__auto"]["dppl_pct"] == pytest.approx(0.0) and rows["patched__auto"]["weights"] == "none"
    for w in ("fp8", "tq4", "tq3", "rtn4", "rtn3"):
        row = rows[f"patched__auto__weights-{w}"]
        assert row["weights"] == w and row["reference"] == "patched__auto" and row["dppl_pct"] > 0
    # NIAH's check is about the KV-cache presets; weight rows are not in it
    assert {c["dtype"] for c in rep["checks"] if c["check"] == "niah_matches_bf16"} == {"turboquant_4bit_nc"}


def _weights_check(rep, name, weights):
    return next(c for c in rep["checks"] if c["check"] == name and c.get("weights") == weights)


def test_weight_acceptance_checks(tmp_path):
    raw = _weights_raw(tmp_path, {"tq4": 0.02, "rtn4": 0.08, "tq3": 0.15, "rtn3": 0.07})
    rep = R.summarize(MODEL, raw)
    rows = {r["weights"]: r for r in rep["rows"] if r["dtype"] == "auto"}
    # the premise: tq4 within +3 %, tq3 beyond +10 % and worse than rtn3, tq4 better than rtn4
    assert 0 < rows["tq4"]["dppl_pct"] < 3 < rows["rtn4"]["dppl_pct"]
    assert rows["rtn3"]["dppl_pct"] < 10 < rows["tq3"]["dppl_pct"]
    b4 = _weights_check(rep, "weights_dppl_within_budget", "tq4")
    assert b4["result"] == "pass" and b4["budget_pct"] == 3.0 and b4["dppl_pct"] == rows["tq4"]["dppl_pct"]
    assert f"ΔPPL {rows['tq4']['dppl_pct']:+.2f}% vs bf16 (PPL {rows['none']['ppl']:.3f} -> " \
           f"{rows['tq4']['ppl']:.3f}); budget +3%" == b4["detail"]
    assert _weights_check(rep, "weights_dppl_within_budget", "tq3")["result"] == "fail"
    r4 = _weights_check(rep, "weights_tq_beats_rtn", "tq4")
    assert r4["result"] == "pass" and r4["detail"].startswith(
        f"PPL tq4 {rows['tq4']['ppl']:.3f} vs rtn4 {rows['rtn4']['ppl']:.3f}")
    assert _weights_check(rep, "weights_tq_beats_rtn", "tq3")["result"] == "fail"
    md = R.render_markdown(rep)
    assert "| `auto` | `tq4` | patched | ok |" in md
    assert "- **fail** weights_tq_beats_rtn `auto` weights `tq3` patched: PPL tq3 " in md
    assert "KV-cache and weight quality" in md


def test_weight_checks_without_their_rows(tmp_path):
    raw = _weights_raw(tmp_path, {"tq4": 0.02, "rtn3": None},
                       rtn3={"status": "error", "error": "FileNotFoundError: the RTN control folder"})
    rep = R.summarize(MODEL, raw)
    assert _weights_check(rep, "weights_dppl_within_budget", "tq3") == {
        "check": "weights_dppl_within_budget", "dtype": "auto", "install": "patched", "weights": "tq3",
        "result": "not tested", "detail": "not run"}
    assert _weights_check(rep, "weights_tq_beats_rtn", "tq4")["detail"] == "rtn4: not run"
    assert _weights_check(rep, "weights_tq_beats_rtn", "tq3")["detail"] == "tq3: not run"
    rtn3 = next(r for r in rep["rows"] if r["weights"] == "rtn3")
    assert rtn3["status"] == "error" and "the RTN control folder" in R.render_markdown(rep)
    # a report without weight rows has no weight checks
    kv_only = tmp_path / "kv" / "raw"
    _write(kv_only, "patched", "auto", noise=0.0)
    assert not [c for c in R.summarize(MODEL, kv_only)["checks"] if c["check"].startswith("weights_")]


def test_weight_rows_in_files_and_plots(tmp_path):
    from tq_eval import plots

    raw = _weights_raw(tmp_path, {"tq4": 0.02, "rtn4": 0.08})
    out = raw.parent
    names = {p.relative_to(out).as_posix() for p in R.write_report(R.summarize(MODEL, raw), out, raw)}
    assert {"configs/patched__auto.json", "configs/patched__auto__weights-tq4.json", "plots/niah_auto_patched.png",
            "plots/niah_auto_patched_weights-tq4.png", "plots/niah_auto_patched_weights-rtn4.png",
            "plots/dppl_kl.png"} <= names
    row = {"dtype": "auto", "install": "patched", "weights": "rtn4"}
    assert plots._label(row) == "weights rtn4, KV auto (ours)"
    assert plots._label({"dtype": "auto", "install": "patched"}) == "auto (ours)"  # rows of older reports
    assert plots._color(row) != plots._color({**row, "weights": "tq4"}) != plots._color({**row, "weights": "none"})


def test_report_only_reads_a_report_from_before_the_weight_axis(tmp_path):
    import run_quality

    old = R.Path(__file__).resolve().parents[2] / "eval/results/smollm2-135m-instruct/2026-11-24-h200/report.json"
    if not old.is_file():
        pytest.skip("no committed report to read")
    rep = json.loads(old.read_text())
    for item in rep["rows"] + rep["checks"] + rep.get("not_run", []):
        item.pop("weights", None)  # as every report written before the weight axis
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps(rep))
    assert run_quality.main(["--report-only", str(run_dir), "--no-plots"]) == 0
    md = (run_dir / "report.md").read_text()
    assert "| `auto` | `none` | patched |" in md and "# KV-cache quality:" in md
    from tq_eval import plots

    assert plots.dppl_kl_bars(rep["rows"], "old", tmp_path / "dppl_kl.png").is_file()

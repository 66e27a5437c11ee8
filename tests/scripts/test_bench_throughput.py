# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_throughput.py without a GPU: config and scenario names, the report and the concurrency-sweep plot."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from turboquant_core.formats import KV_FORMATS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", REPO / "scripts" / "bench_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_named_scenarios_expand(bench):
    assert bench.parse_scenarios("S1,S3") == [(1024, 256, 64), (32768, 128, 8)]
    assert [b for _, _, b in bench.parse_scenarios("sweep")] == [32, 64, 128, 256, 384, 512]
    assert bench.parse_scenarios("S2,100x10x2") == [(2048, 512, 384), (100, 10, 2)]
    with pytest.raises(SystemExit, match="S1, S2, S3, sweep"):
        bench.parse_scenarios("S9")


def test_named_configs_come_from_the_format_table(bench):
    configs = bench.parse_configs(bench.DEFAULT_CONFIGS)
    assert [c[0] for c in configs] == ["bf16", "fp8", "stock-k3v4", "ours-k3v4", "ours-k4v3", "ours-4bit", "ours-2bit"]
    assert configs[2] == ("stock-k3v4", "stock", "turboquant_k3v4_nc")
    assert configs[5] == ("ours-4bit", "patched", "turboquant_4bit_nc")
    names = bench.config_names()
    assert {v[1] for k, v in names.items() if k.startswith("ours-")} == set(KV_FORMATS)
    assert {v[1] for k, v in names.items() if k.startswith("stock-")} == {
        n for n, f in KV_FORMATS.items() if f.origin == "stock"}
    assert bench.parse_configs("x=patched:fp8,bf16") == [("x", "patched", "fp8"), ("bf16", "patched", "auto")]
    with pytest.raises(SystemExit, match="unknown config 'stock-k4v3'.*ours-k4v3"):
        bench.parse_configs("stock-k4v3")  # a preset stock vLLM does not have


def test_weights_suite_configs_and_engine_arguments(bench):
    configs = bench.parse_weight_configs(bench.DEFAULT_WEIGHT_CONFIGS)
    assert [c[0] for c in configs] == ["bf16", "fp8", "awq-marlin", "tq4", "tq3", "tq4+k3v4"]
    assert configs[-1] == ("tq4+k3v4", "patched", "turboquant_k3v4_nc", "tq4") and configs[0][3] is None
    assert bench.parse_weight_configs("x=patched:auto:tq3") == [("x", "patched", "auto", "tq3")]
    with pytest.raises(SystemExit, match="unknown weights config 'ours-k3v4'.*tq4"):
        bench.parse_weight_configs("ours-k3v4")
    assert bench.parse_scenarios("W") == [(256, 256, 1), (256, 256, 8), (256, 256, 64)]
    args = argparse.Namespace(model="m", kv_cache_dtype="auto", max_num_seqs=0, gpu_memory_utilization=0.9,
                              enforce_eager=False, max_num_batched_tokens=8192, cudagraph_sizes="",
                              quantization="awq_marlin")
    kw = bench.engine_kwargs(args, bench.parse_scenarios("W"))
    assert kw["quantization"] == "awq_marlin" and kw["hf_overrides"]["quantization_config"]["group_size"] == 128
    args.quantization = "tq4"
    kw = bench.engine_kwargs(args, bench.parse_scenarios("W"))
    assert kw["quantization"] == "tq4" and "hf_overrides" not in kw


def test_weights_table_when_rows_carry_model_memory(bench):
    rows = [dict(name=n, install="patched", kv_cache_dtype="auto", quantization=q, weight_gib=g,
                 scenarios=[dict(input_len=256, output_len=256, batch=1, output_tok_per_s=t)])
            for n, q, g, t in (("bf16", None, 15.3, 100.0), ("tq4", "tq4", 4.1, 180.0))]
    table = bench.summarize(rows, "bf16")
    assert "| tq4 | tq4 | 4.10 | 0.268 |" in table and "| bf16 | - | 15.30 | 1.000 |" in table
    assert "| tq4 | patched | auto | 256/256/1 | 180 | 1.80x |" in table


def _rows():
    def row(name, rates):
        return dict(name=name, install="patched", kv_cache_dtype=name, kv_capacity_tokens=1000,
                    scenarios=[dict(input_len=2048, output_len=512, batch=b, output_tok_per_s=t)
                               for b, t in rates])
    return [row("bf16", [(32, 100.0), (128, 300.0), (512, 310.0)]),
            row("ours-k3v4", [(32, 80.0), (128, 290.0), (512, 450.0)])]


def test_sweep_series_and_plot(bench, tmp_path):
    shape, series = bench.sweep_series(_rows())
    assert shape == (2048, 512)
    assert series["ours-k3v4"] == [(32, 80.0), (128, 290.0), (512, 450.0)]
    assert bench.plot_sweep(_rows(), tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Fewer than three batch sizes at one shape: no sweep to draw.
    two = [dict(r, scenarios=r["scenarios"][:2]) for r in _rows()]
    assert not bench.plot_sweep(two, tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_report_only_redraws_table_and_sweep(bench, tmp_path):
    src = tmp_path / "run.json"
    src.write_text(json.dumps(dict(results=_rows())))
    assert bench.main(["--model", "unused", "--report-only", str(src)]) == 0
    table = (tmp_path / "run.md").read_text()
    assert "| ours-k3v4 | patched | ours-k3v4 | 2048/512/512 | 450 | 1.45x |" in table
    assert (tmp_path / "run-sweep.png").is_file()


def test_engine_kwargs_and_env(bench, monkeypatch):
    from argparse import Namespace

    args = Namespace(model="m", kv_cache_dtype="turboquant_k3v4_nc", max_num_seqs=0, gpu_memory_utilization=0.9,
                     enforce_eager=False, max_num_batched_tokens=8192, cudagraph_sizes="")
    kw = bench.engine_kwargs(args, bench.parse_scenarios("S1,S2"))
    assert kw == dict(model="m", load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype="turboquant_k3v4_nc",
                      max_model_len=2048 + 512 + 16, max_num_seqs=384, gpu_memory_utilization=0.9,
                      enable_prefix_caching=False, seed=0, enforce_eager=False, max_num_batched_tokens=8192)
    args.max_num_seqs, args.cudagraph_sizes = 512, "32,64"
    kw = bench.engine_kwargs(args, bench.parse_scenarios("S1"))
    assert kw["max_num_seqs"] == 512 and kw["max_model_len"] == 1024 + 256 + 16
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": [32, 64]}
    import os

    for var in ("HF_HUB_OFFLINE", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/x")
    env = bench.worker_env(Namespace(pythonpath_stock="/s", pythonpath_patched="/p"), "stock")
    assert env["PYTHONPATH"] == os.pathsep.join(["/s", "/x"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert bench.worker_env(Namespace(pythonpath_stock="/s", pythonpath_patched=""), "patched")["PYTHONPATH"] == "/x"


def test_running_peak_wraps_the_engines_stats_hook(bench):
    from types import SimpleNamespace

    seen = []
    proc = SimpleNamespace(update_scheduler_stats=seen.append)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(output_processor=proc))
    peak = bench.RunningPeak.attach(llm)
    for n in (3, 64, 17):
        proc.update_scheduler_stats(SimpleNamespace(num_running_reqs=n, num_waiting_reqs=0))
    proc.update_scheduler_stats(None)  # a step without stats
    assert peak.peak == 64 and peak.steps == 3 and len(seen) == 4  # vLLM's own update still runs
    peak.reset()
    assert peak.peak is None
    proc.update_scheduler_stats(SimpleNamespace(num_running_reqs=5))
    assert peak.peak == 5
    assert bench.RunningPeak.attach(SimpleNamespace(llm_engine=SimpleNamespace())) is None


def test_tpot_apart_from_prefill(bench):
    from types import SimpleNamespace

    # Three requests of 11 tokens: the first two decode while the third still prefills (slow steps), the third
    # after every prefill (first token last).
    timings = [(1.0, 2.0, 11), (1.5, 2.5, 11), (2.0, 2.2, 11), (2.0, 2.3, 11), (3.0, 3.0, 1)]
    t = bench.tpot_stats(timings)
    assert t["tpot_ms"] == pytest.approx(1e3 * (0.1 + 0.1 + 0.02 + 0.03) / 4)
    assert t["tpot_ms_no_prefill"] == pytest.approx(1e3 * (0.02 + 0.03) / 2)
    assert t["tpot_requests"] == 4 and t["tpot_requests_no_prefill"] == 2
    assert bench.tpot_stats([]) == {} and bench.tpot_stats([(0.0, 0.0, 5)]) == {}
    outs = [SimpleNamespace(metrics=SimpleNamespace(first_token_ts=1.0, last_token_ts=2.0, num_generation_tokens=11)),
            SimpleNamespace(metrics=None)]
    assert bench.request_timings(outs) == [(1.0, 2.0, 11)]


def test_summary_shows_peak_running_and_tpot(bench):
    rows = _rows()
    rows[1]["scenarios"][2].update(peak_running_seqs=512, tpot_ms=41.26, tpot_ms_no_prefill=30.04)
    table = bench.summarize(rows, "bf16")
    head = table.splitlines()[0]
    assert head.endswith("| peak running | TPOT ms | TPOT ms, no prefill |")
    assert ("| ours-k3v4 | patched | ours-k3v4 | 2048/512/512 | 450 | 1.45x | 1000 | 1.00x | 512 | 41.3 | 30.0 |"
            in table)
    assert "| bf16 | patched | bf16 | 2048/512/32 | 100 | 1.00x | 1000 | 1.00x | - | - | - |" in table
    failed = bench.summarize([dict(name="x", install="patched", kv_cache_dtype="auto")], "bf16")
    assert failed.splitlines()[2] == "| x | patched | auto | - | failed | - | - | - | - | - | - |"
    assert all(line.count("|") == 12 for line in table.splitlines() + failed.splitlines())

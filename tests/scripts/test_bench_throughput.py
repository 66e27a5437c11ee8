# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_throughput.py without a GPU: config and scenario names, the report and the concurrency-sweep plot."""

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

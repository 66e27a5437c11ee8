# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_startup.py without a GPU: its run names, and the numbers it reads from the engine log's
TurboQuant lines (as turboquant_core.vllm.warmup writes them)."""

import json

import pytest

from benchmarks import bench_startup
from turboquant_core.ops.compile_ahead import CompileAheadReport


def test_runs_parse_and_bad_ones_name_the_valid_forms():
    assert bench_startup.parse_run("ours-k3v4/0:warm") == dict(
        run="ours-k3v4/0:warm", name="ours-k3v4", kv_cache_dtype="turboquant_k3v4_nc", compile_workers=0, warm=True)
    assert bench_startup.parse_run("ours-k8v4")["kv_cache_dtype"] == "turboquant_k8v4"
    assert bench_startup.parse_run("ours-4bit")["compile_workers"] == 0
    assert bench_startup.parse_run("bf16") == dict(run="bf16", name="bf16", kv_cache_dtype="auto",
                                                   compile_workers=None, warm=False)
    for bad, message in (("fp16", "expected bf16 or one of ours-"), ("ours-k9v9", "expected bf16 or one of ours-"),
                         ("ours-k3v4/-1", "WORKERS must be an integer >= 0"), ("bf16/2", "takes no /WORKERS"),
                         ("ours-k3v4:cold", "the only suffix is ':warm'")):
        with pytest.raises(SystemExit, match=message):
            bench_startup.parse_run(bad)
    assert [r["run"] for r in map(bench_startup.parse_run, bench_startup.DEFAULT_RUNS.split(","))] == \
        bench_startup.DEFAULT_RUNS.split(",")


def test_log_numbers_read_the_warmups_own_lines():
    report = CompileAheadReport(variants=19, cached=2, compiled=17, launchers=17, workers=16, compile_s=7.4)
    log = (f"INFO 11-26 [warmup.py:1] TurboQuant attention: {report.describe()}\n"
           "INFO 11-26 [warmup.py:2] TurboQuant attention: 26 kernel launches in 1.4 s (19 variants loaded from the "
           "cache, 0 compiled here)\n")
    assert bench_startup.log_numbers(log) == dict(variants=19, cached=2, compiled_ahead=17, launchers_ahead=17,
                                                  compile_processes=16, compile_ahead_s=7.4, warmup_launches=26,
                                                  warmup_s=1.4, warmup_loaded=19, warmup_compiled=0)
    assert bench_startup.log_numbers("bf16 engine log") == {}


def test_summary_compares_with_the_last_warm_bf16_start():
    rows = [dict(name="bf16", warm=False, compile_workers=None, startup_s=80.0),
            dict(name="ours-k3v4", warm=False, compile_workers=0, startup_s=95.5, variants=19, cached=0,
                 compile_ahead_s=8.0, warmup_s=1.0, compile_processes=16, warmup_compiled=0),
            dict(name="bf16", warm=True, compile_workers=None, startup_s=60.0)]
    table = bench_startup.summarize(rows).splitlines()
    assert table[3] == "| ours-k3v4 | cold | auto (16) | 95.5 | +35.5 | 19 (0) | 8.0 | 1.0 | 0 |"
    assert table[4] == "| bf16 | warm | - | 60.0 | +0.0 | - | - | - | - |"


def test_a_warm_run_needs_an_earlier_run_of_its_config(tmp_path):
    with pytest.raises(SystemExit, match="no earlier ours-k3v4 run to take warm caches from"):
        bench_startup.main(["--model", "m", "--runs", "bf16,ours-k3v4:warm", "--out", str(tmp_path / "s.json")])


def test_results_are_written_after_every_run(tmp_path):
    """A run cut short keeps the rows before it: the JSON and table hold the runs so far and how many were planned,
    and the JSON is replaced whole (written beside it, then renamed)."""
    out = tmp_path / "startup.json"
    rows = [dict(name="bf16", warm=False, compile_workers=None, startup_s=80.0)]
    bench_startup.write_results(out, "m", ["--model", "m"], rows, planned=5)
    rows.append(dict(name="bf16", warm=True, compile_workers=None, startup_s=21.0))
    table = bench_startup.write_results(out, "m", ["--model", "m"], rows, planned=5)
    res = json.loads(out.read_text())
    assert res["runs_planned"] == 5 and [r["startup_s"] for r in res["rows"]] == [80.0, 21.0]
    assert res["command"].endswith("--model m") and res["model"] == "m"
    assert out.with_suffix(".md").read_text() == table + "\n" and table.splitlines()[-1].startswith("| bf16 | warm |")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["startup.json", "startup.md"]

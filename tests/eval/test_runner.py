# SPDX-License-Identifier: Apache-2.0
"""The runner's failure handling, with real processes: a config that cannot start, one that hangs,
one that the time budget skips -- each is recorded and the suite goes on to write its report."""

import importlib.util
import json
import stat

import pytest
from tq_eval import configs as C
from tq_eval import runner

needs_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                   reason="vLLM is installed: the worker would start a real engine")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 2048}))
    return d


def test_log_parsing(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("INFO x\nINFO [kv_cache_utils.py:1] GPU KV cache size: 1,234,567 tokens\n"
                   "Traceback (most recent call last):\n  File \"a.py\", line 1\nValueError: bad dtype\n")
    assert runner.kv_cache_tokens_from_log(log) == 1234567
    assert runner.error_from_log(log) == "ValueError: bad dtype"
    assert runner.kv_cache_tokens_from_log(tmp_path / "none.log") is None
    log.write_text("INFO [gpu_model_runner.py:1] Model loading took 0.1021 GiB memory and 1.5 seconds\n")
    assert runner.model_memory_gib_from_log(log) == pytest.approx(0.1021)
    assert runner.model_memory_gib_from_log(tmp_path / "none.log") is None


@needs_no_vllm
def test_config_that_cannot_start_is_recorded(model_dir, tmp_path):
    cfg = C.RunConfig(C.ModelInfo.from_path(model_dir), "turboquant_k3v4_nc", "patched")
    res = runner.run_config(cfg, C.EngineSettings(), C.TaskSettings(tasks=["niah"]), tmp_path / "raw", None,
                            timeout_s=120)
    assert res["status"] == "error"
    assert "No module named 'vllm'" in res["error"]
    assert res["exit_code"] == 1 and res["log_tail"]
    assert res["engine"]["kv_cache_tokens"] is None and res["engine"]["kv_cache_tokens_from"] is None
    on_disk = json.loads((tmp_path / "raw" / cfg.id / "result.json").read_text())
    assert on_disk["error"] == res["error"]


def test_hung_config_times_out(model_dir, tmp_path):
    fake_python = tmp_path / "hang.sh"
    fake_python.write_text("#!/bin/sh\nsleep 60\n")
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
    cfg = C.RunConfig(C.ModelInfo.from_path(model_dir), "auto", "patched")
    res = runner.run_config(cfg, C.EngineSettings(), C.TaskSettings(), tmp_path / "raw", None,
                            python=str(fake_python), timeout_s=1.5)
    assert res["status"] == "error" and "timed out after 2 s" in res["error"]
    assert res["wall_s"] < 20


def test_time_budget_skips_configs(model_dir, tmp_path):
    m = C.ModelInfo.from_path(model_dir)
    plan = [C.RunConfig(m, "auto", "patched"), C.RunConfig(m, "fp8", "patched")]
    seen = []
    out = runner.execute(plan, C.EngineSettings(), C.TaskSettings(), {m.name: tmp_path / "raw"}, {},
                         time_budget_s=0, on_done=lambda c, r: seen.append(c.id))
    assert sorted(seen) == ["patched__auto", "patched__fp8"]
    assert all(r["status"] == "skipped" for r in out.values())


@needs_no_vllm
def test_suite_writes_a_report_when_every_config_fails(model_dir, tmp_path):
    import run_quality

    rc = run_quality.main(["--model", str(model_dir), "--dtypes", "auto,turboquant_4bit_nc",
                           "--installs", "stock,patched", "--tasks", "niah", "--out", str(tmp_path / "res"),
                           "--run-name", "r1", "--no-plots", "--config-timeout", "120"])
    assert rc == 0
    run_dir = tmp_path / "res" / "tiny-model" / "r1"
    rep = json.loads((run_dir / "report.json").read_text())
    assert {r["id"] for r in rep["rows"]} == {"patched__auto", "patched__turboquant_4bit_nc",
                                             "stock__turboquant_4bit_nc"}
    assert all(r["status"] == "error" and "vllm" in r["error"] for r in rep["rows"])
    md = (run_dir / "report.md").read_text()
    assert "No module named 'vllm'" in md
    assert "same Python path" in md  # stock and patched would run the same vLLM here
    assert (run_dir / "configs" / "stock__turboquant_4bit_nc.json").is_file()


def test_dry_run_and_bad_arguments(model_dir, capsys):
    import run_quality

    assert run_quality.main(["--model", str(model_dir), "--dtypes", "auto,fp8", "--dry-run"]) == 0
    assert "2 configs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown KV-cache dtype 'int3'"):
        run_quality.main(["--model", str(model_dir), "--dtypes", "int3", "--dry-run"])
    with pytest.raises(SystemExit, match="needs --online"):
        run_quality.main(["--model", str(model_dir), "--gsm8k", "hub", "--dry-run"])


def test_whole_prompt_prefill_arguments(model_dir, tmp_path, capsys):
    import run_quality

    text = tmp_path / "t.txt"
    text.write_text("words " * 100)
    with pytest.raises(SystemExit, match="every dtype would score as bf16"):
        run_quality.main(["--model", str(model_dir), "--text", str(text), "--prefill-chunk", "0", "--dry-run"])
    with pytest.raises(SystemExit, match="prefill_chunk must be >= 0"):
        run_quality.main(["--model", str(model_dir), "--tasks", "niah", "--prefill-chunk", "-5", "--dry-run"])
    with pytest.raises(SystemExit, match="must cover the context length"):
        run_quality.main(["--model", str(model_dir), "--tasks", "niah", "--prefill-chunk", "0",
                          "--max-num-batched-tokens", "64", "--dry-run"])
    assert run_quality.main(["--model", str(model_dir), "--text", str(text), "--tasks", "niah,gsm8k",
                             "--prefill-chunk", "0", "--dry-run"]) == 0
    assert "configs" in capsys.readouterr().out


@needs_no_vllm
def test_weights_axis_writes_the_rtn_control_and_records_every_config(model_dir, hub_model, tmp_path, capsys):
    import run_quality

    model = tmp_path / "hub-model"
    hub_model(model, "llama")
    args = ["--model", str(model), "--model", str(model_dir), "--dtypes", "auto", "--weights", "bf16,tq4,rtn4",
            "--tasks", "niah", "--out", str(tmp_path / "res"), "--run-name", "r1", "--no-plots",
            "--config-timeout", "120"]
    assert run_quality.main(args) == 0
    run_dir = tmp_path / "res" / "hub-model" / "r1"
    folder = run_dir / "raw" / "rtn-models" / "hub-model__rtn4"
    assert (folder / "config.json").read_bytes() == (model / "config.json").read_bytes()
    spec = json.loads((run_dir / "raw" / "patched__auto__weights-rtn4" / "spec.json").read_text())
    assert spec["config"]["served_path"] == str(folder) and spec["config"]["weights"] == "rtn4"
    rep = json.loads((run_dir / "report.json").read_text())
    assert [(r["id"], r["weights"]) for r in rep["rows"]] == [
        ("patched__auto", "none"), ("patched__auto__weights-tq4", "tq4"), ("patched__auto__weights-rtn4", "rtn4")]
    assert all("vllm" in r["error"] for r in rep["rows"])  # each config ran its worker (no vLLM here)
    assert {c["check"] for c in rep["checks"]} == {"ppl_kl_vs_stock", "weights_dppl_within_budget",
                                                   "weights_tq_beats_rtn"}
    assert (run_dir / "configs" / "patched__auto__weights-rtn4.json").is_file()
    # A model folder without safetensors weights gets no RTN control: recorded as not run, the rest runs.
    other = json.loads((tmp_path / "res" / "tiny-model" / "r1" / "report.json").read_text())
    assert [r["id"] for r in other["rows"]] == ["patched__auto", "patched__auto__weights-tq4"]
    assert other["not_run"][0]["weights"] == "rtn4" and "no *.safetensors" in other["not_run"][0]["reason"]
    assert "`auto` weights `rtn4` on patched (RTN control not written" in (
        tmp_path / "res" / "tiny-model" / "r1" / "report.md").read_text()
    # A second run reuses the folder.
    capsys.readouterr()
    assert run_quality.main(args + ["--dry-run"]) == 0
    assert str(folder) in capsys.readouterr().out
    assert run_quality.main(args) == 0
    assert f"reusing {folder}" in capsys.readouterr().out


def test_weights_arguments(model_dir, capsys):
    import run_quality

    assert run_quality.main(["--model", str(model_dir), "--dtypes", "auto", "--weights", "none,fp8,tq4,tq3,rtn4,rtn3",
                             "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "6 configs" in out and "weights rtn3" in out
    with pytest.raises(SystemExit, match="unknown weights 'int4'; valid: none, fp8, tq4, tq3, rtn4, rtn3"):
        run_quality.main(["--model", str(model_dir), "--weights", "int4", "--dry-run"])

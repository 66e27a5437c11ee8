# SPDX-License-Identifier: Apache-2.0
"""scripts/bench_throughput.py without a GPU: config and scenario names, the report and the concurrency-sweep plot,
--tensor-parallel-size from the command line to the engine, the results file and the table."""

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
    presets = {v[1] for k, v in names.items() if k.startswith("ours-") and k not in bench.OPTION_CONFIGS}
    assert presets == set(KV_FORMATS)
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
    # tq4-lm-head runs only when named: tq4 with the output head encoded too (--tq-weights-lm-head)
    (head,) = bench.parse_weight_configs("tq4-lm-head")
    args.kv_cache_dtype, args.quantization = head[2], head[3]
    kw = bench.engine_kwargs(args, bench.parse_scenarios("W"))
    assert kw["quantization"] == "tq4" and kw["tq_weights_lm_head"] is True and kw["kv_cache_dtype"] == "auto"
    (fp16,) = bench.parse_weight_configs("tq4-fp16-decode")
    args.kv_cache_dtype, args.quantization = fp16[2], fp16[3]
    kw = bench.engine_kwargs(args, bench.parse_scenarios("W"))
    assert kw["quantization"] == "tq4" and kw["tq_weights_decode_int8"] is False


def test_weights_table_when_rows_carry_model_memory(bench):
    rows = [dict(name=n, install="patched", kv_cache_dtype="auto", quantization=q, weight_gib=g,
                 scenarios=[dict(input_len=256, output_len=256, batch=1, output_tok_per_s=t)])
            for n, q, g, t in (("bf16", None, 15.3, 100.0), ("tq4", "tq4", 4.1, 180.0))]
    table = bench.summarize(rows, "bf16")
    assert "| tq4 | tq4 | 4.10 | 0.268 | - |" in table and "| bf16 | - | 15.30 | 1.000 | - |" in table
    assert "| tq4 | patched | auto | 256/256/1 | 180 | 1.80x |" in table
    # With the embedding and head's share recorded, the linears' ratio leaves it out of both sides.
    for r in rows:
        r["embedding_gib"] = 2.3
    table = bench.summarize(rows, "bf16")
    assert "| tq4 | tq4 | 4.10 | 0.268 | 0.138 |" in table and "| bf16 | - | 15.30 | 1.000 | 1.000 |" in table
    rows[1]["output_head_encoded"] = True  # its head is encoded: not what the ratio takes out
    assert "| tq4 | tq4 | 4.10 | 0.268 | - |" in bench.summarize(rows, "bf16")


def test_embedding_gib_per_rank(bench):
    from types import SimpleNamespace

    qwen3_8b = SimpleNamespace(vocab_size=151936, hidden_size=4096, tie_word_embeddings=False)
    assert bench.embedding_gib_per_rank(qwen3_8b, 2, 1) == pytest.approx(2.318, abs=1e-3)
    assert bench.embedding_gib_per_rank(qwen3_8b, 2, 2) == pytest.approx(1.159, abs=1e-3)
    tied = SimpleNamespace(vocab_size=49152, hidden_size=576, tie_word_embeddings=True)
    assert bench.embedding_gib_per_rank(tied, 2, 1) == pytest.approx(49152 * 576 * 2 / 2**30)


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


def test_report_only_merges_runs_of_disjoint_configs(bench, tmp_path):
    """Configs split over the GPUs of one host: two result files of one model and scenarios become one, with each
    source's command; overlapping configs, other scenarios or another GPU model are refused."""
    rows = _rows()
    a, b = tmp_path / "gpu0.json", tmp_path / "gpu1.json"
    common = dict(model="m", scenarios="sweep", tensor_parallel_size=1)
    a.write_text(json.dumps(dict(common, command="run a", date="2026-01-01T00:00:00", results=rows[:1])))
    b.write_text(json.dumps(dict(common, command="run b", date="2026-01-01T01:00:00", results=rows[1:])))
    out = tmp_path / "all.json"
    assert bench.main(["--model", "unused", "--report-only", str(a), str(b), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["results"]] == [r["name"] for r in rows]
    assert [m["command"] for m in doc["merged_from"]] == ["run a", "run b"]
    assert doc["date"] == "2026-01-01T01:00:00"
    assert "| ours-k3v4 | patched | ours-k3v4 | 2048/512/512 | 450 | 1.45x |" in (tmp_path / "all.md").read_text()
    assert (tmp_path / "all-sweep.png").is_file()
    with pytest.raises(SystemExit, match="configs in more than one file"):
        bench.main(["--model", "unused", "--report-only", str(a), str(a), "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="is one of the files"):
        bench.main(["--model", "unused", "--report-only", str(a), str(b), "--out", str(a)])
    b.write_text(json.dumps(dict(common, scenarios="S1", command="run b", results=rows[1:])))
    with pytest.raises(SystemExit, match="different scenarios"):
        bench.main(["--model", "unused", "--report-only", str(a), str(b), "--out", str(out)])
    other = [dict(r, device="NVIDIA H200") for r in rows[1:]]
    b.write_text(json.dumps(dict(common, command="run b", results=other)))
    with pytest.raises(SystemExit, match="different GPUs"):
        bench.main(["--model", "unused", "--report-only", str(a), str(b), "--out", str(out)])


def test_configs_with_engine_options(bench, tmp_path, monkeypatch):
    """KV_CACHE_DTYPE+option=value: the fork's vllm.LLM arguments, typed, in the engine's keywords; the results keep
    the bare dtype (capacity against the format table) and the options apart."""
    from argparse import Namespace

    assert bench.config_names()["ours-k3v4-wgmma"] == ("patched", "turboquant_k3v4_nc+tq_decode_kernel=wgmma")
    assert bench.config_names()["ours-k3v4-wgmma-plain"] == (
        "patched", "turboquant_k3v4_nc+tq_decode_kernel=wgmma+tq_key_centering=false")
    assert bench.split_engine_options("fp8") == ("fp8", {})
    assert bench.split_engine_options("turboquant_k3v4_nc+tq_decode_kernel=wgmma+tq_key_centering=false"
                                      "+tq_compile_workers=4") == (
        "turboquant_k3v4_nc", dict(tq_decode_kernel="wgmma", tq_key_centering=False, tq_compile_workers=4))
    with pytest.raises(SystemExit, match="bad engine option 'tq_key_centering' .* expected option=value"):
        bench.parse_configs("x=patched:turboquant_k3v4_nc+tq_key_centering")
    args = Namespace(model="m", kv_cache_dtype="turboquant_k3v4_nc+tq_decode_kernel=wgmma", max_num_seqs=0,
                     gpu_memory_utilization=0.9, enforce_eager=False, max_num_batched_tokens=8192, cudagraph_sizes="")
    kw = bench.engine_kwargs(args, bench.parse_scenarios("S1"))
    assert kw["kv_cache_dtype"] == "turboquant_k3v4_nc" and kw["tq_decode_kernel"] == "wgmma"
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    _FakeWorker.commands.clear()
    out = tmp_path / "w.json"
    assert bench.main(["--model", "m", "--configs", "ours-k3v4-wgmma-plain", "--scenarios", "100x10x2",
                       "--out", str(out)]) == 0
    cmd = _FakeWorker.commands[0]
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "turboquant_k3v4_nc+tq_decode_kernel=wgmma+tq_key_centering=false"
    row = json.loads(out.read_text())["results"][0]
    assert row["kv_cache_dtype"] == "turboquant_k3v4_nc"
    assert row["engine_options"] == dict(tq_decode_kernel="wgmma", tq_key_centering=False)


def test_engine_kwargs_and_env(bench, monkeypatch):
    from argparse import Namespace

    args = Namespace(model="m", kv_cache_dtype="turboquant_k3v4_nc", max_num_seqs=0, gpu_memory_utilization=0.9,
                     enforce_eager=False, max_num_batched_tokens=8192, cudagraph_sizes="")
    kw = bench.engine_kwargs(args, bench.parse_scenarios("S1,S2"))
    assert kw == dict(model="m", load_format="dummy", skip_tokenizer_init=True, kv_cache_dtype="turboquant_k3v4_nc",
                      max_model_len=2048 + 512 + 16, max_num_seqs=384, gpu_memory_utilization=0.9,
                      enable_prefix_caching=False, seed=0, enforce_eager=False, max_num_batched_tokens=8192,
                      tensor_parallel_size=1, jit_monitor_verbose=True)  # args without the TP option: one GPU
    args.max_num_seqs, args.cudagraph_sizes, args.tensor_parallel_size = 512, "32,64", 2
    kw = bench.engine_kwargs(args, bench.parse_scenarios("S1"))
    assert kw["max_num_seqs"] == 512 and kw["max_model_len"] == 1024 + 256 + 16 and kw["tensor_parallel_size"] == 2
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": [32, 64]}
    # A step no larger than the batch can hold: batch 8 of 256/256 holds 8 x 528 tokens.
    args.max_num_seqs = 0
    kw = bench.engine_kwargs(args, bench.parse_scenarios("256x256x1,256x256x8"))
    assert kw["max_model_len"] == 528 and kw["max_num_seqs"] == 8 and kw["max_num_batched_tokens"] == 8 * 528
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


def test_ttft_mean_and_largest(bench):
    from types import SimpleNamespace

    outs = [SimpleNamespace(metrics=SimpleNamespace(first_token_latency=v)) for v in (0.5, 1.5, 0.0)]
    outs.append(SimpleNamespace(metrics=None))
    assert bench.ttft_stats(outs) == dict(ttft_ms=pytest.approx(1000.0), ttft_ms_max=pytest.approx(1500.0))
    assert bench.ttft_stats(outs[2:]) == {}


def test_summary_shows_peak_running_and_tpot(bench):
    rows = _rows()
    rows[1]["scenarios"][2].update(peak_running_seqs=512, ttft_ms=2103.0, ttft_ms_max=4180.4, tpot_ms=41.26,
                                   tpot_ms_no_prefill=30.04)
    table = bench.summarize(rows, "bf16")
    head = table.splitlines()[0]
    assert head.endswith("| peak running | TTFT ms, max | TPOT ms | TPOT ms, no prefill |")
    assert ("| ours-k3v4 | patched | ours-k3v4 | 2048/512/512 | 450 | 1.45x | 1000 | 1.00x | 512 | 4180 | 41.3 | 30.0 |"
            in table)
    assert "| bf16 | patched | bf16 | 2048/512/32 | 100 | 1.00x | 1000 | 1.00x | - | - | - | - |" in table
    failed = bench.summarize([dict(name="x", install="patched", kv_cache_dtype="auto")], "bf16")
    assert failed.splitlines()[2] == "| x | patched | auto | - | failed | - | - | - | - | - | - | - |"
    assert all(line.count("|") == 13 for line in table.splitlines() + failed.splitlines())


# ----------------------------------------------------------------------------------------------------------------------
# --tensor-parallel-size


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_tensor_parallel_size_must_be_positive(bench, tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", "unused", "--tensor-parallel-size", bad, "--out", str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert f"--tensor-parallel-size: expected a positive integer, got '{bad}'" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_expected_kv_tokens_from_the_format_table(bench):
    qwen3_8b_tp2 = dict(layers=36, kv_heads=4, head_dim=128, mla=None)  # 8 KV heads over two ranks
    pool = 30 << 30
    assert bench.expected_kv_tokens("auto", qwen3_8b_tp2, pool) == pool // (36 * 4 * 512)
    assert bench.expected_kv_tokens("fp8", qwen3_8b_tp2, pool) == pool // (36 * 4 * 256)
    k3v4 = KV_FORMATS["turboquant_k3v4_nc"].bytes_per_token_per_head(128)
    assert bench.expected_kv_tokens("turboquant_k3v4_nc", qwen3_8b_tp2, pool) == pool // (36 * 4 * k3v4)
    # The same pool on a rank holding all eight heads holds half the tokens.
    one_gpu = dict(qwen3_8b_tp2, kv_heads=8)
    assert bench.expected_kv_tokens("auto", one_gpu, pool) == pool // (36 * 8 * 512)
    mla = dict(layers=27, kv_heads=1, head_dim=576, mla=[512, 64])  # one latent entry per token and layer
    assert bench.expected_kv_tokens("auto", mla, pool) == pool // (27 * 1152)
    assert bench.expected_kv_tokens("nonsense", qwen3_8b_tp2, pool) is None


class _FakeWorker:
    """subprocess.Popen for run_config: records the command, answers as a worker of a two-GPU engine would (vLLM's log
    lines of both ranks, then the result line)."""

    commands: list[list[str]] = []

    def __init__(self, cmd, **kwargs):
        self.commands.append(cmd)
        self.pid, self.returncode = 0, 0
        self.dtype = (cmd[cmd.index("--kv-cache-dtype") + 1]).split("+")[0]  # the worker strips engine options
        self.tp = int(cmd[cmd.index("--tensor-parallel-size") + 1])

    def communicate(self, timeout=None):
        shape = dict(layers=36, kv_heads=8 // self.tp, head_dim=128, mla=None)
        pool_gib = {0: 30.12, 1: 30.05}  # per rank; the engine's pool is the smaller
        per_head = {"auto": 512}.get(self.dtype) or KV_FORMATS[self.dtype].bytes_per_token_per_head(128)
        tokens = int(30.05 * (1 << 30)) // (36 * shape["kv_heads"] * per_head) // 16 * 16
        log = [f"(Worker_TP{r} pid=1{r}) INFO [gpu_worker.py:561] Available KV cache memory: {g} GiB"
               for r, g in pool_gib.items() if r < self.tp]
        log.append(f"(EngineCore pid=9) INFO [kv_cache_utils.py:2177] GPU KV cache size: {tokens:,} tokens")
        result = dict(device="H100", num_devices=2, tensor_parallel_size=self.tp, num_gpu_blocks=tokens // 16,
                      block_size=16, kv_shape=shape, scenarios=[
                          dict(input_len=100, output_len=10, batch=2, output_tok_per_s=50.0 * per_head ** -0.1)])
        return "\n".join(log + ["TQ_BENCH_RESULT " + json.dumps(result)]), ""


def test_tensor_parallel_size_reaches_every_worker_and_the_results(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    _FakeWorker.commands.clear()
    out = tmp_path / "tp2.json"
    assert bench.main(["--model", "m", "--configs", "bf16,ours-k3v4", "--scenarios", "100x10x2",
                       "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    assert len(_FakeWorker.commands) == 2
    for cmd in _FakeWorker.commands:
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "--worker" in cmd
    doc = json.loads(out.read_text())
    assert doc["tensor_parallel_size"] == 2
    bf16, ours = doc["results"]
    for row in (bf16, ours):
        assert row["tensor_parallel_size"] == 2 and row["kv_cache_gib_per_rank"] == 30.05
        # vLLM's number is the engine's (one rank's pool, every rank holding every token), recorded as logged
        assert row["kv_capacity_tokens"] == row["num_gpu_blocks"] * 16
        assert abs(row["kv_capacity_tokens"] / row["kv_capacity_expected_tokens"] - 1) < 0.001
    k3v4 = KV_FORMATS["turboquant_k3v4_nc"].bytes_per_token_per_head(128)
    assert ours["kv_capacity_expected_tokens"] == int(30.05 * (1 << 30)) // (36 * 4 * k3v4)
    table = out.with_suffix(".md").read_text().splitlines()
    assert table[0].startswith("| config | install | TP | kv_cache_dtype | scenario |")
    assert "| KV capacity (tokens) | vs bf16 | vs format table |" in table[0]
    ratio = ours["kv_capacity_tokens"] / bf16["kv_capacity_tokens"]
    assert table[3].startswith("| ours-k3v4 | patched | 2 | turboquant_k3v4_nc | 100/10/2 |")
    assert f"| {ours['kv_capacity_tokens']} | {ratio:.2f}x | 1.00x |" in table[3]


def test_resume_keeps_one_tensor_parallel_size_per_file(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    out = tmp_path / "run.json"
    assert bench.main(["--model", "m", "--configs", "bf16", "--scenarios", "100x10x2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["tensor_parallel_size"] == 1
    with pytest.raises(SystemExit, match="was run with --tensor-parallel-size 1, this run has 2"):
        bench.main(["--model", "m", "--configs", "bf16,ours-k3v4", "--scenarios", "100x10x2", "--resume",
                    "--tensor-parallel-size", "2", "--out", str(out)])


def test_summary_compares_each_tensor_parallel_size_with_its_own_baseline(bench):
    def row(name, tp, cap, rate):
        return dict(name=name, install="patched", kv_cache_dtype=name, tensor_parallel_size=tp, kv_capacity_tokens=cap,
                    scenarios=[dict(input_len=2048, output_len=512, batch=384, output_tok_per_s=rate)])
    rows = [row("bf16", 1, 100_000, 1000.0), row("ours-k3v4", 1, 445_000, 1400.0),
            row("bf16", 2, 440_000, 1800.0), row("ours-k3v4", 2, 1_958_000, 1800.0)]
    table = bench.summarize(rows, "bf16").splitlines()
    assert table[0].startswith("| config | install | TP | kv_cache_dtype |") and "vs format table" not in table[0]
    assert table[3] == ("| ours-k3v4 | patched | 1 | ours-k3v4 | 2048/512/384 | 1400 | 1.40x | 445000 | 4.45x "
                        "| - | - | - | - |")
    assert table[5] == ("| ours-k3v4 | patched | 2 | ours-k3v4 | 2048/512/384 | 1800 | 1.00x | 1958000 | 4.45x "
                        "| - | - | - | - |")
    # One size only, as every run before the option: the table as it was, no TP column.
    assert bench.summarize([dict(r, tensor_parallel_size=1) for r in rows[:2]], "bf16").splitlines()[0] == (
        "| config | install | kv_cache_dtype | scenario | output tok/s | vs bf16 | KV capacity (tokens) | vs bf16 "
        "| peak running | TTFT ms, max | TPOT ms | TPOT ms, no prefill |")


def test_kernels_compiled_while_serving_are_reported(bench):
    log = ("(EngineCore pid=1) WARNING 11-27 17:46:22 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: tq_rotate_kernel (constexprs={BLOCK_B=16}; signature={X='*bf16', num_rows='i32'}; "
           "extra_compile_info={}; key=(1, (2))). This causes a latency spike; consider extending warmup to cover "
           "this shape/config.\n"
           "WARNING 11-27 17:46:23 [jit_monitor.py:135] Triton kernel JIT compilation during inference: "
           "tq_dequant_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.\n")
    events = bench.jit_while_serving(log)
    assert [e["kernel"] for e in events] == ["tq_rotate_kernel", "tq_dequant_kernel"]
    assert events[0]["detail"].startswith("constexprs={BLOCK_B=16}") and events[0]["detail"].endswith("key=(1, (2))")
    assert events[1]["detail"] == "" and bench.jit_while_serving("no warnings") == []
    rows = [dict(name=n, install="patched", kv_cache_dtype="auto",
                 scenarios=[dict(input_len=256, output_len=256, batch=1, output_tok_per_s=100.0)]) for n in ("bf16",
                                                                                                            "tq4")]
    assert "compiled while serving" not in bench.summarize(rows, "bf16")
    rows[1]["jit_while_serving"] = events
    assert "Kernels compiled while serving (vLLM's JIT monitor): tq4: tq_dequant_kernel, tq_rotate_kernel (2)" in \
        bench.summarize(rows, "bf16")



def test_speculative_decoding_reaches_every_engine_and_the_results(bench, tmp_path, monkeypatch):
    """--speculative-config reaches every worker's engine (vLLM's speculative_config) and the results document; the
    table gains the scenario's accepted / proposed draft tokens; --prompt-period repeats one random pattern; a
    speculative config that is not a JSON object is refused."""
    import random
    from argparse import Namespace

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    args = Namespace(model="m", kv_cache_dtype="auto", max_num_seqs=0, gpu_memory_utilization=0.9, enforce_eager=False,
                     max_num_batched_tokens=8192, cudagraph_sizes="", speculative_config=json.dumps(ngram))
    assert bench.engine_kwargs(args, bench.parse_scenarios("S1"))["speculative_config"] == ngram
    p = bench.prompt_ids(random.Random(0), 20, 8)
    assert len(p) == 20 and p[:8] == p[8:16] == p[16:] + p[4:8] and len(set(p)) == 8
    assert len(bench.prompt_ids(random.Random(0), 5, 8)) == 5 and len(bench.prompt_ids(random.Random(0), 7)) == 7
    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    _FakeWorker.commands.clear()
    out = tmp_path / "spec.json"
    assert bench.main(["--model", "m", "--configs", "bf16", "--scenarios", "100x10x2", "--out", str(out),
                       "--speculative-config", json.dumps(ngram), "--prompt-period", "8"]) == 0
    cmd = _FakeWorker.commands[0]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == ngram
    assert cmd[cmd.index("--prompt-period") + 1] == "8"
    doc = json.loads(out.read_text())
    assert doc["speculative_config"] == ngram and doc["prompt_period"] == 8
    row = dict(name="bf16", install="patched", kv_cache_dtype="auto", kv_capacity_tokens=10, scenarios=[
        dict(input_len=100, output_len=10, batch=2, output_tok_per_s=5.0, spec_draft_tokens=30,
             spec_accepted_tokens=12)])
    table = bench.summarize([row], "bf16").splitlines()
    assert table[0].endswith("| drafts accepted / proposed |") and table[2].endswith("| 12 / 30 |")
    with pytest.raises(SystemExit, match="--speculative-config must be a JSON object"):
        bench.main(["--model", "m", "--configs", "bf16", "--scenarios", "100x10x2", "--out", str(out),
                    "--speculative-config", "ngram"])


def test_repeats_give_the_median_run_and_the_range(bench, tmp_path, monkeypatch):
    """--repeat N reaches every worker, which runs its scenarios in N rounds; a scenario's row is its median run by
    output tok/s (the lower middle one of an even count), with the range and every run's timings; the table gains a
    runs column and the results document the count."""
    runs = [dict(input_len=8, output_len=4, batch=2, elapsed_s=e, output_tok_per_s=8 / e, ttft_ms=10 * e,
                 peak_running_seqs=2) for e in (2.0, 1.0, 4.0)]
    row = bench.aggregate_repeats(runs)
    assert row["elapsed_s"] == 2.0 and row["ttft_ms"] == 20.0 and row["peak_running_seqs"] == 2
    assert (row["output_tok_per_s_min"], row["output_tok_per_s_max"]) == (2.0, 8.0)
    assert [r["elapsed_s"] for r in row["repeats"]] == [2.0, 1.0, 4.0] and "peak_running_seqs" not in row["repeats"][0]
    assert bench.aggregate_repeats(runs[:2])["elapsed_s"] == 2.0  # even count: the slower middle run
    assert bench.aggregate_repeats(runs[:1]) == runs[0]  # one run: as it was, no range

    base = dict(name="bf16", install="patched", kv_cache_dtype="auto", kv_capacity_tokens=10, scenarios=[row])
    table = bench.summarize([base], "bf16").splitlines()
    assert "| output tok/s | runs: min-max | vs bf16 |" in table[0] and "| 4 | 3: 2-8 | 1.00x |" in table[2]
    assert "runs" not in bench.summarize([dict(base, scenarios=runs[:1])], "bf16")

    monkeypatch.setattr(bench.subprocess, "Popen", _FakeWorker)
    _FakeWorker.commands.clear()
    out = tmp_path / "rep.json"
    assert bench.main(["--model", "m", "--configs", "bf16", "--scenarios", "100x10x2", "--out", str(out),
                       "--repeat", "3"]) == 0
    cmd = _FakeWorker.commands[0]
    assert cmd[cmd.index("--repeat") + 1] == "3" and json.loads(out.read_text())["repeat"] == 3
    with pytest.raises(SystemExit):
        bench.main(["--model", "m", "--configs", "bf16", "--scenarios", "100x10x2", "--out", str(out), "--repeat", "0"])

# SPDX-License-Identifier: Apache-2.0
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from turboquant_core.cli import EVAL_PPL_MODULE, format_table, main, presets_table
from turboquant_core.formats import KV_FORMATS

LLAMA = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_presets_table_text(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0
    lines = out.splitlines()
    assert "head_dim=128" in lines[0] and "bf16 = 512" in lines[0] and "fp8 = 256" in lines[0]
    end = lines.index("")
    body = {line.split()[0]: line.split() for line in lines[3:end]}
    assert list(body) == list(KV_FORMATS)
    end2 = lines.index("", end + 1)
    weights = {line.split()[0]: line.split() for line in lines[end + 4:end2]}
    assert list(weights) == ["tq4", "tq3"] and "Weight presets" in lines[end + 1]
    assert "MLA latent caches" in lines[end2 + 1] and "bf16 = 1152, fp8 = 576, fp8_ds_mla = 656" in lines[end2 + 1]
    mla = {line.split()[0]: line.split() for line in lines[end2 + 4:]}
    assert list(mla) == list(KV_FORMATS)
    assert mla["turboquant_k3v4_nc"][-7:] == ["192", "2", "128", "322", "3.58", "1.79", "2.04"]
    assert mla["turboquant_k8v4"][-7:] == ["512", "0", "128", "640", "1.80", "0.90", "1.02"]
    assert weights["tq4"][-4:] == ["66", "4.125", "0.258", "planar8"]
    assert weights["tq3"][-4:] == ["50", "3.125", "0.195", "planar8"]
    expected = {"turboquant_k8v4": "194", "turboquant_k3v4_nc": "116", "turboquant_2bit_nc": "68"}
    for name, nbytes in expected.items():
        assert f" {nbytes} " in f" {' '.join(body[name])} "
    assert "stock" in body["turboquant_k3v4_nc"] and "new" in body["turboquant_k3v2_nc"]


def test_presets_json(capsys):
    code, out, _ = run(capsys, "presets", "--head-dim", "64", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["head_dim"] == 64 and data["bf16_bytes"] == 256 and data["fp8_bytes"] == 128
    rows = {r["name"]: r for r in data["presets"]}
    assert rows["turboquant_3bit_nc"]["bytes_per_token_per_head"] == 2 * (24 + 2)
    assert rows["turboquant_3bit_nc"]["vs_fp8"] == pytest.approx(128 / 52)
    assert rows["turboquant_3bit_nc"]["bits_per_coord"] == pytest.approx(52 * 8 / 128)
    assert rows["turboquant_k8v4"]["key"] == "fp8 e4m3 (rotated)"
    weights = {r["name"]: r for r in data["weight_presets"]}
    assert weights["tq3"]["bytes_per_group"] == 50 and weights["tq4"]["bits_per_weight"] == 4.125
    mla = data["mla"]
    assert (mla["kv_lora_rank"], mla["rope_dim"]) == (512, 64)
    assert mla["baseline_bytes"] == {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}
    rows = {r["name"]: r for r in mla["presets"]}
    assert rows["turboquant_2bit_nc"]["bytes_per_token"] == 128 + 2 + 128
    assert rows["turboquant_4bit_nc"]["vs_bf16"] == pytest.approx(1152 / 386)


def test_presets_table_function_matches_formats():
    for row in presets_table(96):
        f = KV_FORMATS[row["name"]]
        assert row["bytes_per_token_per_head"] == f.bytes_per_token_per_head(96)
        assert row["vs_bf16"] == pytest.approx(f.compression_vs_bf16(96))


@pytest.mark.parametrize("argv,needle", [
    (["presets", "--head-dim", "100"], "supported head dims: 64, 80, 96, 112, 128, 192, 256, 512"),
    (["validate", "--dims", "64,65"], "supported head dims: 64, 80"),
    (["validate", "--presets", "turboquant_5bit"], "valid presets: turboquant_k8v4, turboquant_4bit_nc"),
    (["validate", "--vectors", "0"], "positive integer"),
    (["validate", "--backend", "cuda"], "invalid choice: 'cuda'"),
    (["bench", "--bits", "3,5"], "valid bits: 2, 2.5, 3, 3.5, 4"),
    (["bench", "--dim", "48"], "supported head dims"),
    (["memory", "--context", "10"], "--config"),
    (["memory", "--config", "x.json", "--context", "-1"], "positive integer"),
    (["nonsense"], "invalid choice"),
    ([], "required"),
])
def test_bad_arguments_exit_2_naming_choices(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for cmd in ("presets", "validate", "bench", "memory", "eval-ppl"):
        assert cmd in out


def test_validate_json_small(capsys):
    code, out, _ = run(capsys, "validate", "--dims", "64", "--vectors", "3000", "--presets", "turboquant_3bit_nc",
                       "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ok"] and data["backend"] == "reference" and data["vectors"] == 3000
    assert [(r["preset"], r["component"]) for r in data["presets"]] == [("turboquant_3bit_nc", "K"),
                                                                         ("turboquant_3bit_nc", "V")]
    assert [r["bits"] for r in data["qjl"]] == [2, 3, 4]
    assert all(r["unbiased"] for r in data["qjl"])


def test_validate_text_and_failure_exit_code(capsys):
    argv = ["validate", "--dims", "80", "--vectors", "500", "--presets", "turboquant_k3v2_nc", "--no-qjl"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and out.rstrip().endswith("PASS")
    assert "turboquant_k3v2_nc" in out and "2-bit Lloyd-Max +nc" in out and "QJL" not in out
    code, out, _ = run(capsys, *argv, "--tolerance", "1e-9")
    assert code == 1 and out.rstrip().endswith("FAIL")


def test_validate_triton_backend_in_interpreter_or_on_gpu(capsys):
    code, out, _ = run(capsys, "validate", "--dims", "64", "--vectors", "200", "--presets", "turboquant_2bit_nc",
                       "--backend", "triton", "--no-qjl", "--json")
    assert code == 0
    assert json.loads(out)["backend"] == "triton"


def test_bench_json_and_out_file(capsys, tmp_path):
    out_file = tmp_path / "bench.json"
    code, out, err = run(capsys, "bench", "--vectors", "32", "--dim", "64", "--bits", "3", "--json", "--out",
                         str(out_file))
    assert code == 0
    data = json.loads(out)
    assert json.loads(out_file.read_text()) == data
    assert data["command"] == f"tq bench --vectors 32 --dim 64 --bits 3 --json --out {out_file}"
    assert [r["op"] for r in data["results"]] == ["encode", "decode"]
    if data["device_type"] == "cpu":
        assert "warning: no CUDA device" in err


def test_bench_text(capsys):
    code, out, _ = run(capsys, "bench", "--vectors", "16", "--dim", "64", "--bits", "2.5")
    assert code == 0
    assert "copy_ bandwidth" in out and "encode  2.5" in out and "decode  2.5" in out


def test_memory_text_and_json(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    code, out, _ = run(capsys, "memory", "--config", str(cfg), "--context", "32768", "--batch", "4",
                       "--gpu-mem-gb", "20")
    assert code == 0
    assert "32 layers" in out and "head_dim 128" in out and "40960" in out
    code, out, _ = run(capsys, "memory", "--config", str(tmp_path), "--context", "8192", "--json",
                       "--presets", "turboquant_k3v4_nc")
    assert code == 0
    data = json.loads(out)
    assert [r["name"] for r in data["rows"]] == ["bf16", "fp8", "turboquant_k3v4_nc"]
    assert data["rows"][2]["kv_bytes"] == 32 * 8 * 116 * 8192


def test_memory_per_gpu_with_tensor_parallelism(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    code, out, _ = run(capsys, "memory", "--config", str(cfg), "--context", "8192", "--tensor-parallel-size", "2",
                       "--gpu-mem-gb", "20", "--presets", "turboquant_k3v4_nc")
    assert code == 0 and "per GPU of 2 (tensor parallel): 4 KV heads" in out and "KV GiB per GPU" in out
    code, out, _ = run(capsys, "memory", "--config", str(cfg), "--context", "8192", "--tensor-parallel-size", "2",
                       "--json", "--presets", "turboquant_k3v4_nc")
    assert json.loads(out)["rows"][2]["kv_bytes"] == 32 * 4 * 116 * 8192
    code, _, err = run(capsys, "memory", "--config", str(cfg), "--context", "8192", "--tensor-parallel-size", "3")
    assert code == 2 and "valid sizes: 1, 2, 4, 8, 16, 32" in err


def test_memory_of_an_mla_model(capsys):
    """DeepSeek-V2-Lite's config (benchmarks/configs): 27 layers of one 512 + 64 latent entry per token."""
    cfg = str(Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "deepseek-v2-lite")
    code, out, _ = run(capsys, "memory", "--config", cfg, "--context", "32768", "--batch", "8", "--gpu-mem-gb", "20")
    assert code == 0
    assert out.startswith("deepseek_v2: 27 MLA layers, 16 heads sharing one latent entry per token and layer "
                          "(kv_lora_rank 512 + rope 64)")
    body = {line.split()[0]: line.split() for line in out.splitlines()[4:]}
    assert list(body) == ["bf16", "fp8", "fp8_ds_mla", *KV_FORMATS]
    assert body["bf16"][2:4] == ["1152", "7.594"] and body["bf16"][4] == str(2**30 // (27 * 1152))
    assert body["turboquant_k3v4_nc"][2] == "322" and body["turboquant_k3v4_nc"][5:8] == ["3.58", "1.79", "2.04"]
    code, out, _ = run(capsys, "memory", "--config", cfg, "--context", "4096", "--json", "--tensor-parallel-size", "2",
                       "--presets", "turboquant_2bit_nc")
    data = json.loads(out)
    assert code == 0 and data["attention"] == "mla" and data["tensor_parallel_size"] == 2
    assert [r["name"] for r in data["rows"]] == ["bf16", "fp8", "fp8_ds_mla", "turboquant_2bit_nc"]
    assert data["rows"][3]["kv_bytes"] == 27 * 258 * 4096  # replicated: each GPU holds every layer's latents
    code, _, err = run(capsys, "memory", "--config", cfg, "--context", "4096", "--tensor-parallel-size", "3")
    assert code == 2 and "valid sizes: 1, 2, 4, 8, 16" in err


def test_memory_warns_past_max_position_embeddings(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, "max_position_embeddings": 131072}))
    code, out, err = run(capsys, "memory", "--config", str(cfg), "--context", "200000")
    assert code == 0 and "turboquant_k3v4_nc" in out  # the table is printed all the same
    assert err == ("warning: --context 200000 exceeds the model's max_position_embeddings 131072; sizes are "
                   "computed anyway, but the model was not configured for contexts this long\n")
    code, out, err = run(capsys, "memory", "--config", str(cfg), "--context", "200000", "--json")
    assert code == 0 and json.loads(out)["max_position_embeddings"] == 131072 and "131072" in err
    code, _, err = run(capsys, "memory", "--config", str(cfg), "--context", "131072")
    assert code == 0 and err == ""


def test_memory_config_errors_exit_2(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "x", "num_attention_heads": 8, "hidden_size": 1024}))
    code, _, err = run(capsys, "memory", "--config", str(cfg), "--context", "100")
    assert code == 2 and "num_hidden_layers" in err
    code, _, err = run(capsys, "memory", "--config", str(tmp_path / "none.json"), "--context", "100")
    assert code == 2 and "not found" in err


def test_eval_ppl_is_lazy(capsys):
    code, out, err = run(capsys, "eval-ppl", "--help")
    if importlib.util.find_spec(EVAL_PPL_MODULE) is None:
        assert code == 2 and "not part of this installation" in err
    else:
        assert code == 0 and "usage: tq eval-ppl" in out
        # Both regimes by default (serving first), key centering on with a way to turn it off.
        assert "default 256,0" in out and "--no-key-centering" in out


def test_eval_ppl_missing_model_path_says_not_found(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "eval-ppl", "--model", "/no/such/dir", "--presets", "turboquant_4bit_nc",
                         "--window", "16", "--windows", "1", "--prefill-chunk", "0")
    assert code == 2 and out == ""
    assert err.startswith("error: model path '/no/such/dir' not found; expected one of smollm2-135m-instruct, "
                          "gemma-3-270m") and err.count("\n") == 1
    assert "unknown model" not in err


def test_presets_imports_neither_triton_nor_transformers():
    code = ("import sys; from turboquant_core.cli import main; rc = main(['presets']); "
            "assert rc == 0; bad = [m for m in ('triton', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_format_table():
    text = format_table([{"a": 1.23456, "b": None, "c": True}, {"a": 10.0, "b": "x", "c": False}],
                        [("a", "A", ".2f"), ("b", "B", ""), ("c", "C", "")])
    assert text.splitlines() == ["A      B  C", "-----  -  ---", "1.23   -  yes", "10.00  x  NO"]

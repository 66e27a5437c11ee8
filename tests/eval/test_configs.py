# SPDX-License-Identifier: Apache-2.0
import json
import os

import pytest
from tq_eval import configs as C


def _model(tmp_path, name="m", **over):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "max_position_embeddings": 8192, **over}
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return C.ModelInfo.from_path(d)


def test_stock_presets_match_the_format_table():
    from turboquant_core.formats import KV_FORMATS

    assert set(C.STOCK_TURBOQUANT) == {n for n, f in KV_FORMATS.items() if f.origin == "stock"}
    assert set(C.ACCEPTANCE_PRESETS) <= set(C.STOCK_TURBOQUANT)


def test_dtype_and_install_parsing():
    assert C.parse_dtypes("bf16, fp8,turboquant_k3v4_nc,auto") == ["auto", "fp8", "turboquant_k3v4_nc"]
    with pytest.raises(ValueError, match="valid: auto, fp8.*turboquant_2bit_nc"):
        C.parse_dtypes("auto,turboquant_9bit")
    assert C.parse_installs("stock,patched,stock") == ["stock", "patched"]
    with pytest.raises(ValueError, match="valid: stock, patched"):
        C.parse_installs("ours")
    assert C.parse_int_list("1024, 2048", "x") == [1024, 2048]
    with pytest.raises(ValueError, match="--niah-lengths"):
        C.parse_int_list("1k", "--niah-lengths")


def test_model_info(tmp_path):
    m = _model(tmp_path)
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.max_position_embeddings) == (30, 3, 64, 8192)
    g = tmp_path / "g"
    g.mkdir()
    (g / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 18, "num_attention_heads": 4,
                                                               "num_key_value_heads": 1, "head_dim": 256,
                                                               "hidden_size": 640}}))
    gi = C.ModelInfo.from_path(g, name="gemma 3/270m")
    assert (gi.head_dim, gi.num_kv_heads, gi.name) == (256, 1, "gemma-3-270m")
    with pytest.raises(FileNotFoundError, match="config.json"):
        C.ModelInfo.from_path(tmp_path / "nothing")


def test_plan_order_and_skips(tmp_path):
    m = _model(tmp_path)
    dtypes = ["fp8", "turboquant_3bit_nc", "turboquant_2bit_nc", "turboquant_k3v4_nc", "auto", "turboquant_4bit_nc"]
    plan, skipped = C.plan_configs([m], dtypes, ["stock", "patched"])
    ids = [c.id for c in plan]
    assert ids[0] == "patched__auto"
    assert ids[1:5] == ["patched__turboquant_4bit_nc", "stock__turboquant_4bit_nc",
                        "patched__turboquant_k3v4_nc", "stock__turboquant_k3v4_nc"]
    assert ids[5] == "patched__fp8"
    assert "stock__turboquant_2bit_nc" not in ids and "stock__auto" not in ids
    assert {(s["dtype"], s["install"]) for s in skipped} == {
        ("fp8", "stock"), ("auto", "stock"), ("turboquant_2bit_nc", "stock")}
    plan2, _ = C.plan_configs([m], ["auto"], ["stock", "patched"], baseline_installs=["stock", "patched"])
    assert sorted(c.id for c in plan2) == ["patched__auto", "stock__auto"]


def test_engine_kwargs():
    e = C.EngineSettings(kv_cache_gib=1.5, prefill_chunk=300, max_model_len=4096)
    kw = e.engine_kwargs("/m", "turboquant_k3v4_nc", topk=20)
    assert kw["kv_cache_dtype"] == "turboquant_k3v4_nc" and kw["max_logprobs"] == 20
    assert kw["kv_cache_memory_bytes"] == int(1.5 * 2**30)
    assert kw["long_prefill_token_threshold"] == 300 and kw["enable_prefix_caching"] is False
    assert kw["enforce_eager"] is True and kw["max_model_len"] == 4096
    assert kw["enable_chunked_prefill"] is True
    assert "kv_cache_memory_bytes" not in C.EngineSettings(kv_cache_gib=0).engine_kwargs("/m", "auto", 5)


def test_whole_prompt_prefill():
    kw = C.EngineSettings(prefill_chunk=0).engine_kwargs("/m", "turboquant_k3v4_nc", topk=5)
    assert kw["enable_chunked_prefill"] is False and kw["long_prefill_token_threshold"] == 0
    assert C.prefill_label(0) == "whole (chunked prefill off)"
    assert C.prefill_label(256) == "in chunks of 256 tokens"
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        C.EngineSettings(prefill_chunk=-1)


def test_task_settings_validation():
    with pytest.raises(ValueError, match="unknown task"):
        C.TaskSettings(tasks=["ppl", "mmlu"])
    with pytest.raises(ValueError, match="512..8192"):
        C.TaskSettings(ppl_window_tokens=100)


def test_subprocess_env():
    base = {"PYTHONPATH": f"/cur{os.pathsep}/x", "PATH": "/bin"}
    env = C.subprocess_env(base, "/site-stock", ["/eval", "/root", "/eval"], offline=True)
    assert env["PYTHONPATH"] == os.pathsep.join(["/site-stock", "/eval", "/root"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    env2 = C.subprocess_env(base, None, ["/eval"], offline=False)
    assert env2["PYTHONPATH"] == os.pathsep.join(["/cur", "/x", "/eval"])
    assert "HF_HUB_OFFLINE" not in env2
    assert base["PYTHONPATH"] == f"/cur{os.pathsep}/x"  # the caller's env is not modified


def test_weights_parsing():
    assert C.parse_weights("bf16, tq4,rtn4,none,fp8") == ["none", "tq4", "rtn4", "fp8"]
    assert C.valid_weights() == ("none", "fp8", "tq4", "tq3", "rtn4", "rtn3", "tq4-fp16-decode", "tq3-fp16-decode")
    with pytest.raises(ValueError, match=r"unknown weights 'int4'; valid: none, fp8, tq4, tq3, rtn4, rtn3, "
                                         r"tq4-fp16-decode, tq3-fp16-decode \(aliases: bf16, bfloat16\)"):
        C.parse_weights("tq4,int4")
    with pytest.raises(ValueError, match="no weights given"):
        C.parse_weights(" , ")
    assert [C.vllm_quantization(w) for w in C.valid_weights()] == [None, "fp8", "tq4", "tq3", None, None, "tq4",
                                                                    "tq3"]
    assert [C.rtn_bits(w) for w in C.valid_weights()] == [None, None, None, None, 4, 3, None, None]
    assert [C.weights_engine_options(w) for w in ("tq4", "tq4-fp16-decode")] == [
        {}, {"tq_weights_decode_int8": False}]
    kw = C.EngineSettings().engine_kwargs("m", "auto", 20, "tq3", C.weights_engine_options("tq3-fp16-decode"))
    assert kw["quantization"] == "tq3" and kw["tq_weights_decode_int8"] is False
    assert C.weights_rank("tq4") < C.weights_rank("tq4-fp16-decode") < C.weights_rank("rtn4")
    assert "max_num_seqs" not in kw and C.EngineSettings(max_num_seqs=8).engine_kwargs("m", "auto", 20)[
        "max_num_seqs"] == 8
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        C.EngineSettings(max_num_seqs=0)
    assert C.rtn_name("tq3") == "rtn3"


def test_plan_with_the_weights_axis(tmp_path):
    m = _model(tmp_path)
    plan, skipped = C.plan_configs([m], ["auto", "turboquant_4bit_nc", "fp8"], ["stock", "patched"],
                                   weights=["none", "fp8", "tq3", "rtn3", "tq4", "rtn4"])
    ids = [c.id for c in plan]
    assert ids == ["patched__auto", "patched__turboquant_4bit_nc", "stock__turboquant_4bit_nc",
                   "patched__auto__weights-tq4", "patched__auto__weights-rtn4", "patched__auto__weights-tq3",
                   "patched__auto__weights-rtn3", "patched__auto__weights-fp8", "patched__fp8"]
    assert len(set(ids)) == len(ids)
    weight_cfgs = [c for c in plan if c.weights != C.NO_WEIGHTS]
    assert all(c.dtype == "auto" and c.install == "patched" for c in weight_cfgs)
    assert {(s["dtype"], s["install"]) for s in skipped} == {("fp8", "stock"), ("auto", "stock")}
    # weights given without none, or only none: the KV-cache configs are the same
    only_kv, _ = C.plan_configs([m], ["auto"], ["patched"])
    assert [c.id for c in only_kv] == [c.id for c in C.plan_configs([m], ["auto"], ["patched"], weights=["none"])[0]]
    d = plan[4].to_dict()
    assert (d["id"], d["weights"], d["served_path"]) == ("patched__auto__weights-rtn4", "rtn4", None)
    assert C.rtn_folder(tmp_path / "cache", m, "rtn4") == tmp_path / "cache" / "m__rtn4"


def test_engine_kwargs_quantization():
    e = C.EngineSettings()
    assert e.engine_kwargs("/m", "auto", 5, "tq4")["quantization"] == "tq4"
    assert "quantization" not in e.engine_kwargs("/m", "auto", 5)

# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from turboquant_core.formats import KV_FORMATS, get_format
from turboquant_core.memory import (
    GIB,
    ModelConfigError,
    context_warning,
    is_mla_config,
    kv_heads_per_gpu,
    kv_shape_from_config,
    load_config,
    memory_report,
    mla_shape_from_config,
)

LLAMA_8B = {  # Llama 3.1 8B's attention geometry
    "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "head_dim": 128,
}
GEMMA3_LIKE = {  # 5 sliding layers per full one, as Gemma 3 writes it out
    "model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "sliding_window": 1024,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}


def _rows(report):
    return {r["name"]: r for r in report["rows"]}


def test_llama_bytes_by_hand():
    rep = memory_report(LLAMA_8B, context=32768, batch=4)
    rows = _rows(rep)
    # bf16: 32 layers * 8 heads * (128 K + 128 V) * 2 B = 131072 B per token; * 32768 * 4 = 16 GiB.
    assert rows["bf16"]["kv_bytes"] == 16 * GIB
    assert rows["fp8"]["kv_bytes"] == 8 * GIB
    assert rows["turboquant_k3v4_nc"]["kv_bytes"] == 32 * 8 * 116 * 32768 * 4
    assert rows["turboquant_k3v4_nc"]["vs_bf16"] == pytest.approx(512 / 116)
    assert rows["turboquant_k3v4_nc"]["vs_fp8"] == pytest.approx(256 / 116)
    assert rows["turboquant_3bit_nc"]["kv_gib"] == pytest.approx(16 * 100 / 512)
    assert [r["name"] for r in rep["rows"]][:2] == ["bf16", "fp8"] and len(rep["rows"]) == 2 + len(KV_FORMATS)
    assert rep["full_layers"] == 32 and rep["windowed_layers"] == 0 and "fits" not in rows["bf16"]


DEEPSEEK_V2_LITE = {  # the attention geometry of benchmarks/configs/deepseek-v2-lite/config.json
    "model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "hidden_size": 2048, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def test_mla_bytes_by_hand():
    """One entry per token and layer, whatever the heads: bf16 2 * (512 + 64), fp8 576, fp8_ds_mla 512 + 16 + 128;
    k3v4's latent at 3 bits: 512 * 3 / 8 + 2 (fp16 scale) + 128 (k_pe bf16) = 322."""
    rep = memory_report(DEEPSEEK_V2_LITE, context=32768, batch=4)
    rows = _rows(rep)
    assert rep["attention"] == "mla" and (rep["kv_lora_rank"], rep["rope_dim"], rep["num_layers"]) == (512, 64, 27)
    assert [r["name"] for r in rep["rows"]][:3] == ["bf16", "fp8", "fp8_ds_mla"]
    assert len(rep["rows"]) == 3 + len(KV_FORMATS)
    want = {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656, "turboquant_k8v4": 640, "turboquant_4bit_nc": 386,
            "turboquant_k3v4_nc": 322, "turboquant_3p5bit_nc": 354, "turboquant_2p5bit_nc": 290,
            "turboquant_2bit_nc": 258}
    for name, n in want.items():
        assert rows[name]["bytes_per_token_per_layer"] == n, name
        assert rows[name]["kv_bytes"] == 27 * n * 32768 * 4
        assert rows[name]["tokens_per_gib"] == GIB // (27 * n)
        assert rows[name]["vs_bf16"] == pytest.approx(1152 / n) and rows[name]["vs_fp8"] == pytest.approx(576 / n)
        assert rows[name]["vs_fp8_ds_mla"] == pytest.approx(656 / n)
    assert rows["turboquant_k3v4_nc"]["latent"] == "3-bit Lloyd-Max +nc"


def test_mla_tokens_that_fit_and_tensor_parallel_replication():
    rep = memory_report(DEEPSEEK_V2_LITE, context=32768, batch=8, gpu_mem_gib=20)
    row = _rows(rep)["turboquant_k3v4_nc"]
    assert row["max_context"] == 20 * GIB // (8 * 27 * 322) and row["fits"]
    two = memory_report(DEEPSEEK_V2_LITE, context=32768, batch=8, gpu_mem_gib=20, tensor_parallel_size=2)
    assert [r["kv_bytes"] for r in two["rows"]] == [r["kv_bytes"] for r in rep["rows"]]
    with pytest.raises(ValueError, match="valid sizes: 1, 2, 4, 8, 16"):
        memory_report(DEEPSEEK_V2_LITE, context=10, tensor_parallel_size=3)


def test_mla_config_shape_and_errors():
    shape = mla_shape_from_config({"model_type": "x", "text_config": DEEPSEEK_V2_LITE})
    assert (shape.kv_lora_rank, shape.rope_dim, shape.nope_head_dim, shape.v_head_dim) == (512, 64, 128, 128)
    assert is_mla_config(DEEPSEEK_V2_LITE) and not is_mla_config(LLAMA_8B)
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        mla_shape_from_config({**DEEPSEEK_V2_LITE, "qk_rope_head_dim": None})
    with pytest.raises(ModelConfigError, match="kv_lora_rank 500 is not supported"):
        mla_shape_from_config({**DEEPSEEK_V2_LITE, "kv_lora_rank": 500})


@pytest.mark.parametrize("kv_heads,tp,want", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (1, 2, 1), (2, 4, 1)])
def test_kv_heads_per_gpu_as_vllm_splits_them(kv_heads, tp, want):
    assert kv_heads_per_gpu({**LLAMA_8B, "num_key_value_heads": kv_heads}, kv_heads, tp) == want


def test_tensor_parallel_sizes_per_gpu():
    one, two = memory_report(LLAMA_8B, 32768, 4, gpu_mem_gib=20), memory_report(LLAMA_8B, 32768, 4, 20,
                                                                                tensor_parallel_size=2)
    assert (two["num_kv_heads"], two["kv_heads_per_gpu"], two["tensor_parallel_size"]) == (8, 4, 2)
    for name, row in _rows(two).items():
        assert row["kv_bytes"] * 2 == _rows(one)[name]["kv_bytes"]  # each GPU holds half the heads
        assert row["max_total_tokens"] >= 2 * _rows(one)[name]["max_total_tokens"] - 4  # twice the tokens fit
    # one KV head replicated on both GPUs: each holds all of it
    mqa = {**LLAMA_8B, "num_key_value_heads": 1}
    assert _rows(memory_report(mqa, 1024, tensor_parallel_size=2))["bf16"]["kv_bytes"] == \
        _rows(memory_report(mqa, 1024))["bf16"]["kv_bytes"]


@pytest.mark.parametrize("tp,message", [(3, "valid sizes: 1, 2, 4, 8, 16, 32"), (0, "must be positive")])
def test_tensor_parallel_sizes_vllm_would_refuse(tp, message):
    with pytest.raises(ValueError, match=message):
        memory_report(LLAMA_8B, 1024, tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the model's 6 KV heads"):
        memory_report({**LLAMA_8B, "num_attention_heads": 24, "num_key_value_heads": 6}, 1024, tensor_parallel_size=4)


def test_llama_tokens_that_fit():
    rep = memory_report(LLAMA_8B, context=32768, batch=4, gpu_mem_gib=20)
    rows = _rows(rep)
    # 20 GiB / (4 seqs * 32 layers * 8 heads * 512 B) = 40960 tokens per sequence.
    assert rows["bf16"]["max_context"] == 40960 and rows["bf16"]["max_total_tokens"] == 4 * 40960
    assert rows["bf16"]["fits"]
    per_token = 4 * 32 * 8 * 68
    assert rows["turboquant_2bit_nc"]["max_context"] == 20 * GIB // per_token
    assert not _rows(memory_report(LLAMA_8B, context=32768, batch=4, gpu_mem_gib=15))["bf16"]["fits"]


def test_sliding_layers_hold_at_most_the_window():
    shape = kv_shape_from_config(GEMMA3_LIKE)
    assert shape.layer_windows == (1024,) * 5 + (None,)
    assert shape.cached_tokens(500) == 6 * 500
    assert shape.cached_tokens(10_000) == 5 * 1024 + 10_000
    rep = memory_report(GEMMA3_LIKE, context=10_000, batch=2, gpu_mem_gib=0.01)
    bpt = get_format("turboquant_k3v4_nc").bytes_per_token_per_head(256)
    row = _rows(rep)["turboquant_k3v4_nc"]
    assert row["kv_bytes"] == 2 * 2 * bpt * (5 * 1024 + 10_000)
    budget = int(0.01 * GIB)
    n = row["max_context"]
    assert shape.kv_bytes(n, 2, bpt) <= budget < shape.kv_bytes(n + 1, 2, bpt)
    assert n == (budget // (2 * 2 * bpt) - 5 * 1024)  # past the window only the full layer grows


def test_only_windowed_layers_never_run_out():
    cfg = {**GEMMA3_LIKE, "layer_types": ["sliding_attention"] * 6}
    row = _rows(memory_report(cfg, context=100_000, gpu_mem_gib=1))["turboquant_2bit_nc"]
    assert row["max_context"] is None and row["max_total_tokens"] is None
    tiny = _rows(memory_report(cfg, context=100_000, gpu_mem_gib=1e-4))["bf16"]
    assert tiny["max_context"] < 1024


def test_linear_attention_and_chunked_layers():
    cfg = {
        "model_type": "hybrid", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 128, "attention_chunk_size": 8192,
        "layer_types": ["linear_attention", "full_attention", "chunked_attention", "linear_attention"],
    }
    shape = kv_shape_from_config(cfg)
    assert shape.layer_windows == (0, None, 8192, 0)
    assert shape.cached_tokens(20_000) == 20_000 + 8192
    rep = memory_report(cfg, context=20_000)
    assert rep["no_kv_layers"] == 2 and rep["full_layers"] == 1 and rep["windowed_layers"] == 1


def test_head_dim_and_kv_heads_fallbacks():
    cfg = {"model_type": "gpt2ish", "num_hidden_layers": 2, "num_attention_heads": 12, "hidden_size": 768}
    shape = kv_shape_from_config(cfg)
    assert (shape.head_dim, shape.num_kv_heads) == (64, 12)


def test_multimodal_text_config():
    cfg = {"model_type": "llava", "vision_config": {"hidden_size": 1024}, "text_config": LLAMA_8B}
    assert kv_shape_from_config(cfg).num_layers == 32


def test_no_sliding_when_disabled():
    cfg = {**LLAMA_8B, "sliding_window": 4096, "use_sliding_window": False}
    assert kv_shape_from_config(cfg).layer_windows == (None,) * 32


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_attention_heads"])
def test_missing_keys_are_named(key):
    cfg = {k: v for k, v in LLAMA_8B.items() if k not in (key, "head_dim", "num_key_value_heads")}
    with pytest.raises(ModelConfigError, match=key if key == "num_hidden_layers" else "num_key_value_heads"):
        kv_shape_from_config(cfg)


def test_bad_configs():
    with pytest.raises(ModelConfigError, match="'head_dim' or both 'hidden_size' and 'num_attention_heads'"):
        kv_shape_from_config({"num_hidden_layers": 2, "num_key_value_heads": 2})
    with pytest.raises(ModelConfigError, match="head_dim 100 is not supported.*64, 80, 96"):
        kv_shape_from_config({**LLAMA_8B, "head_dim": 100})
    with pytest.raises(ModelConfigError, match="unknown layer type 'cross_attention'; known layer types: full_att"):
        kv_shape_from_config({**GEMMA3_LIKE, "layer_types": ["cross_attention"] * 6})
    with pytest.raises(ModelConfigError, match="one type per layer"):
        kv_shape_from_config({**GEMMA3_LIKE, "layer_types": ["full_attention"]})
    with pytest.raises(ModelConfigError, match="MLA"):
        kv_shape_from_config({**LLAMA_8B, "kv_lora_rank": 512})
    with pytest.raises(ModelConfigError, match="positive integer 'num_hidden_layers'"):
        kv_shape_from_config({**LLAMA_8B, "num_hidden_layers": "32"})
    with pytest.raises(ModelConfigError, match="sliding_window"):
        kv_shape_from_config({**GEMMA3_LIKE, "sliding_window": None})
    with pytest.raises(ValueError, match="--context must be positive"):
        memory_report(LLAMA_8B, context=0)
    with pytest.raises(ValueError, match="valid formats"):
        memory_report(LLAMA_8B, context=10, presets=["turboquant_1bit"])


def test_load_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert load_config(tmp_path) == LLAMA_8B
    assert load_config(tmp_path / "config.json") == LLAMA_8B
    with pytest.raises(ModelConfigError, match="not found"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_config(tmp_path / "list.json")


def test_configs_without_layer_types_follow_transformers():
    pytest.importorskip("transformers")
    # Gemma 2's config.json has no layer_types: transformers alternates sliding and full layers.
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 256, "hidden_size": 2304, "sliding_window": 4096}
    shape = kv_shape_from_config(gemma2)
    assert shape.layer_windows == (4096, None, 4096, None)
    assert shape.layer_types_source == "transformers layer_types"
    # Mistral (v0.1) applies its window to every layer; transformers gives no layer_types for it.
    mistral = {"model_type": "mistral", "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096, "sliding_window": 4096}
    shape = kv_shape_from_config(mistral)
    assert shape.layer_windows == (4096,) * 3 and shape.layer_types_source == "sliding_window applies to every layer"


def test_context_beyond_max_position_embeddings_is_named():
    cfg = {**LLAMA_8B, "max_position_embeddings": 131072}
    assert context_warning(cfg, 131072) is None
    assert context_warning(LLAMA_8B, 10**6) is None  # no limit in the config: nothing to say
    msg = context_warning(cfg, 200_000)
    assert msg.startswith("--context 200000 exceeds the model's max_position_embeddings 131072;")
    # A multimodal config: the decoder's limit counts.
    assert "131072" in context_warning({"model_type": "llava", "text_config": cfg}, 200_000)
    rep = memory_report(cfg, context=200_000)
    assert rep["max_position_embeddings"] == 131072
    assert _rows(rep)["bf16"]["kv_bytes"] == 32 * 8 * 512 * 200_000  # the table is still computed

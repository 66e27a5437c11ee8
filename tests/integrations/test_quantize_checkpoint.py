# SPDX-License-Identifier: Apache-2.0
"""``tq quantize`` (turboquant_core/integrations/quantize_checkpoint.py) on a tiny Llama saved by transformers in
several safetensors shards: which tensors change and into what bytes, the index and config it writes, that the
source is only read, and that a refused or failed run leaves nothing behind."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")


from turboquant_core.cli import main as tq_main  # noqa: E402
from turboquant_core.formats import get_weight_format  # noqa: E402
from turboquant_core.integrations.quantize_checkpoint import CheckpointError, quantize_checkpoint  # noqa: E402
from turboquant_core.ops.weight_codec import TQWeight, quantize_weight, tq_linear_reference  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (hidden 256, MLP 384, 4 heads of 64, 2 KV heads) in several shards with an index; the MLP's
    down projection takes 384 inputs (3 groups), every projection divides into groups."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    src = tmp_path_factory.mktemp("src") / "tiny-llama"
    model.save_pretrained(src, safe_serialization=True, max_shard_size="300KB")
    (src / "tokenizer.json").write_text('{"stand-in": true}')
    return src


@pytest.mark.parametrize("bits", [4, 3])
def test_projections_become_the_format_bytes_and_the_rest_is_copied(tiny, tmp_path, bits, folder_tensors,
                                                                   folder_digest):
    assert (tiny / "model.safetensors.index.json").is_file()  # the fixture really is sharded
    before = folder_digest(tiny)
    fmt = get_weight_format(f"tq{bits}")
    s = quantize_checkpoint(tiny, tmp_path / "out", fmt, progress=False)
    assert folder_digest(tiny) == before  # the source is only read
    src, out = folder_tensors(tiny), folder_tensors(tmp_path / "out")
    projections = [n for n in src if n.endswith("_proj.weight")]
    assert sorted(s.quantized) == sorted(projections) and len(projections) == 14 and s.kept == []
    for name in projections:
        stem = name.removesuffix(".weight")
        want = quantize_weight(src[name], fmt)
        assert torch.equal(out[f"{stem}.weight_packed"], want.packed) and torch.equal(out[f"{stem}.weight_scale"],
                                                                                    want.scales)
        assert name not in out
    for name in set(src) - set(projections):  # embeddings, lm_head, norms: unchanged
        assert torch.equal(out[name], src[name]), name
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out) and index["metadata"]["total_size"] == s.bytes_after
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["format"], q["bits"], q["group_size"], q["packing"]) == \
        ("turboquant", fmt.name, bits, 128, "planar8")
    assert q["rotation_seed"] == fmt.seed and len(q["quantized"]) == 14 and q["modules_not_converted"] == []
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"stand-in": true}'
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").quantization_config["format"] == fmt.name
    assert s.bytes_after < s.bytes_before
    # the stored weight computes the layer's product
    stem = "model.layers.1.mlp.down_proj"
    w = TQWeight(fmt.name, out[f"{stem}.weight_packed"], out[f"{stem}.weight_scale"], 384)
    x = torch.randn(3, 384)
    ref = x @ src[f"{stem}.weight"].float().T
    assert (tq_linear_reference(x, w) - ref).norm() / ref.norm() < (0.11 if bits == 4 else 0.2)


def test_keep_patterns_are_listed(tiny, tmp_path):
    s = quantize_checkpoint(tiny, tmp_path / "out", "tq4", keep=("*.v_proj.weight",), progress=False)
    assert sorted(n for n, _ in s.kept) == ["model.layers.0.self_attn.v_proj.weight",
                                            "model.layers.1.self_attn.v_proj.weight"]
    assert all(why == "kept by --keep" for _, why in s.kept) and len(s.quantized) == 12
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["modules_not_converted"] == ["model.layers.0.self_attn.v_proj",
                                                                   "model.layers.1.self_attn.v_proj"]


def test_moe_routers_stay_in_full_precision_and_experts_are_stored_flat(tmp_path, folder_tensors):
    """A tiny Qwen2-MoE (routed experts, a shared expert and both routers): the routers ``mlp.gate`` and
    ``mlp.shared_expert_gate`` are copied as they are and listed in ``modules_not_converted``, as
    ``--quantization`` keeps them; the routed experts' indices are stored [out, G * 16 * bits] (vLLM's expert loader
    reads any 3-D tensor as all of a layer's experts), the shared expert's (a plain linear layer)
    [out, G, 16 * bits]."""
    torch.manual_seed(1)
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=384, moe_intermediate_size=192,
                                      shared_expert_intermediate_size=384, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    src = tmp_path / "tiny-moe"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(src)
    s = quantize_checkpoint(src, tmp_path / "out", "tq3", progress=False)
    before, out = folder_tensors(src), folder_tensors(tmp_path / "out")
    routers = ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"]
    assert all(f"{r}.weight" in before for r in routers)  # the fixture really has both
    for r in routers:
        assert torch.equal(out[f"{r}.weight"], before[f"{r}.weight"]) and f"{r}.weight_packed" not in out, r
    assert sorted(n for n, _ in s.kept) == [f"{r}.weight" for r in routers]
    assert all(why == "MoE router, kept in full precision" for _, why in s.kept)
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q["modules_not_converted"] == routers and not set(routers) & set(q["quantized"]) and q["version"] == 2
    assert len(q["quantized"]) == 4 * 3 + 3 + 4  # routed experts, shared expert, attention

    for stem, rows in (("model.layers.0.mlp.experts.3.down_proj", 256), ("model.layers.0.mlp.experts.0.up_proj", 192)):
        want = quantize_weight(before[f"{stem}.weight"], "tq3")
        assert out[f"{stem}.weight_packed"].shape == (rows, want.packed.shape[1] * 48)
        assert torch.equal(out[f"{stem}.weight_packed"], want.packed.flatten(1))
        assert torch.equal(out[f"{stem}.weight_scale"], want.scales)
    stem = "model.layers.0.mlp.shared_expert.gate_proj"
    assert torch.equal(out[f"{stem}.weight_packed"], quantize_weight(before[f"{stem}.weight"], "tq3").packed)
    assert out[f"{stem}.weight_packed"].shape == (384, 2, 48)


def test_refusals_leave_nothing_behind(tiny, tmp_path):
    def leftovers():
        return sorted(p.name for p in tmp_path.iterdir())

    done = quantize_checkpoint(tiny, tmp_path / "q", "tq3", progress=False).dest
    with pytest.raises(CheckpointError, match="already quantized \\(turboquant\\)"):
        quantize_checkpoint(done, tmp_path / "again", "tq3", progress=False)
    with pytest.raises(FileExistsError, match="--overwrite"):
        quantize_checkpoint(tiny, done, "tq3", progress=False)
    with pytest.raises(ValueError, match="valid formats: tq4, tq3"):
        quantize_checkpoint(tiny, tmp_path / "x", "tq5", progress=False)
    # a truncated shard: refused naming it, after earlier shards were written to the temporary folder
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in tiny.iterdir():
        broken.joinpath(p.name).write_bytes(p.read_bytes())
    last = sorted(broken.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{last.name}: not a readable safetensors file"):
        quantize_checkpoint(broken, tmp_path / "y", "tq4", progress=False)
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        quantize_checkpoint(broken, tmp_path / "z", "tq4", progress=False)
    assert leftovers() == ["broken", "q"]  # no temporary folders, no partial outputs
    # overwrite replaces the old output in one rename
    assert quantize_checkpoint(tiny, done, "tq4", overwrite=True, progress=False).dest == done
    assert json.loads((done / "config.json").read_text())["quantization_config"]["format"] == "tq4"
    assert leftovers() == ["broken", "q"]


def test_cli(tiny, tmp_path, capsys):
    assert tq_main(["quantize", str(tiny), str(tmp_path / "o"), "--bits", "4", "--no-progress"]) == 0
    assert "14 weights in tq4, 0 kept" in capsys.readouterr().out
    assert tq_main(["quantize", str(tiny), str(tmp_path / "o"), "--bits", "4", "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err
    assert tq_main(["quantize", str(tiny), str(tmp_path / "p"), "--bits", "5"]) == 2
    assert "invalid choice: 5" in capsys.readouterr().err


def test_selection_by_role():
    """The helpers other tools share (the quality suite's RTN control rounds exactly these tensors)."""
    from turboquant_core.integrations.quantize_checkpoint import is_encodable, is_projection, is_router

    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.17.mlp.down_proj.weight",
                 "model.layers.3.mlp.experts.5.gate_proj.weight"):
        assert is_projection(name), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.block_sparse_moe.gate.weight"):
        assert not is_projection(name), name
    # routers (full precision, as --quantization keeps them), not the gate projections
    assert is_router("model.layers.0.mlp.gate.weight") and is_router("model.layers.2.mlp.shared_expert_gate.weight")
    assert not is_router("model.layers.0.mlp.gate_proj.weight") and not is_router("model.layers.0.mlp.gate.bias")
    assert not is_router("model.layers.3.mlp.experts.5.gate_proj.weight")
    assert is_encodable(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not is_encodable(torch.zeros(3)) and not is_encodable(torch.zeros(2, 3, dtype=torch.int8))

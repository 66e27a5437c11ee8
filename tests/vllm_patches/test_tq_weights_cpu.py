# SPDX-License-Identifier: Apache-2.0
"""``--quantization tq3|tq4`` (patch 0010, turboquant_core/vllm/quant_config.py) without a GPU: vLLM's own column-
and row-parallel linear layers (one rank, gloo) load a full-precision weight through their loaders, encode it once
loaded and compute the rotated-domain product of ops.weight_codec (the kernel in Triton's interpreter); the names
reach vLLM's registry and argument checks; what the method does not take stays as it is. Runs only where a patched
vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise."""

from __future__ import annotations

import pytest
import torch

from turboquant_core.ops.weight_codec import quantize_weight, served_layout, tq_linear_reference


@pytest.fixture(scope="module")
def vllm_linear(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU recipe (the kernel runs in the interpreter here)")
    from test_config_layer import _patched_imports

    config, parallel_state, linear, quantization = _patched_imports(
        "its linear layers", "vllm.config", "vllm.distributed.parallel_state", "vllm.model_executor.layers.linear",
        "vllm.model_executor.layers.quantization")
    VllmConfig, set_current_vllm_config = config.VllmConfig, config.set_current_vllm_config
    QUANTIZATION_METHODS, get_quantization_config = quantization.QUANTIZATION_METHODS, quantization.get_quantization_config
    init = f"file://{tmp_path_factory.mktemp('dist') / 'rendezvous'}"
    with set_current_vllm_config(VllmConfig()):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                        distributed_init_method=init, backend="gloo")
            parallel_state.initialize_model_parallel(1, 1)
        yield linear, QUANTIZATION_METHODS, get_quantization_config, set_current_vllm_config, VllmConfig


def _load(layer, weight, bias=None):
    layer.weight.weight_loader(layer.weight, weight)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("name", ["tq4", "tq3"])
def test_linear_layers_encode_at_load_and_compute_the_rotated_product(vllm_linear, name):
    linear, methods, get_config, _, _ = vllm_linear
    assert name in methods
    config = get_config(name)()
    g = torch.Generator().manual_seed(0)
    col = linear.ColumnParallelLinear(256, 192, bias=True, params_dtype=torch.float32, quant_config=config,
                                      prefix="layers.0.mlp.up_proj")
    row = linear.RowParallelLinear(384, 64, bias=False, params_dtype=torch.float32, quant_config=config,
                                   prefix="layers.0.mlp.down_proj")
    for layer, (out, inp) in ((col, (192, 256)), (row, (64, 384))):
        weight, x = torch.randn(out, inp, generator=g) * 0.05, torch.randn(5, inp, generator=g)
        bias = torch.randn(out, generator=g) if layer is col else None
        _load(layer, weight, bias)
        q = served_layout(quantize_weight(weight, name))  # as kernel words
        assert layer.weight.dtype == torch.int32
        assert torch.equal(layer.weight, q.packed) and torch.equal(layer.weight_scale, q.scales)
        got = layer(x)[0]
        want = tq_linear_reference(x, q, bias)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_a_layer_is_encoded_when_its_last_shard_loads_and_never_exists_whole_before(vllm_linear):
    """Layerwise online encoding: the full-precision weight is created on the meta device (the model never exists
    whole in full precision); vLLM's loader keeps the shards of a fused q/k/v layer until the last one arrives, then
    the layer is materialized, loaded and encoded at once, before the model-wide process_weights_after_loading
    (which then leaves it as it is)."""
    linear, _, get_config, _, _ = vllm_linear
    layer = linear.QKVParallelLinear(256, 64, 4, 2, bias=False, params_dtype=torch.float32, quant_config=get_config(
        "tq4")(), prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.quant_method.uses_meta_device and layer.weight.is_meta
    g = torch.Generator().manual_seed(5)
    shards = {sid: torch.randn(rows, 256, generator=g) * 0.05 for sid, rows in (("q", 256), ("k", 128), ("v", 128))}
    for sid in ("q", "k"):
        layer.weight.weight_loader(layer.weight, shards[sid], sid)
        assert layer.weight.is_meta  # buffered, not materialized
    layer.weight.weight_loader(layer.weight, shards["v"], "v")
    assert layer.weight.dtype == torch.int32 and not layer.weight.is_meta  # tq4 served as kernel words
    want = served_layout(quantize_weight(torch.cat([shards["q"], shards["k"], shards["v"]]), "tq4"))
    assert torch.equal(layer.weight, want.packed) and torch.equal(layer.weight_scale, want.scales)
    layer.quant_method.process_weights_after_loading(layer)  # the model-wide pass: nothing left to do
    assert torch.equal(layer.weight, want.packed)
    # what key smoothing reads of an encoded qkv_proj: the weight it computes with
    from turboquant_core.ops.weight_codec import dequantize_weight

    assert torch.equal(layer.quant_method.dequantized_weight(layer), dequantize_weight(want))


def test_embeddings_stay_and_ungrouped_inputs_are_padded(vllm_linear):
    linear, _, get_config, _, _ = vllm_linear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    config = get_config("tq4")()
    emb = VocabParallelEmbedding(128, 256, params_dtype=torch.float32, quant_config=config, prefix="embed_tokens")
    head = ParallelLMHead(128, 256, params_dtype=torch.float32, quant_config=config, prefix="lm_head")
    assert emb.weight.dtype == torch.float32 and head.weight.dtype == torch.float32
    # 200 inputs: one full group and a zero-padded one
    odd = linear.ReplicatedLinear(200, 64, bias=False, params_dtype=torch.float32, quant_config=config, prefix="odd")
    weight, x = torch.randn(64, 200) * 0.05, torch.randn(3, 200)
    _load(odd, weight)
    assert odd.weight.shape == (64, 2, 16) and odd.weight_scale.shape == (64, 2)  # kernel words
    want = tq_linear_reference(x, quantize_weight(weight, "tq4"))
    torch.testing.assert_close(odd(x)[0], want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_the_output_head_is_encoded_when_the_engine_asks(vllm_linear, monkeypatch):
    """--tq-weights-lm-head (TQConfig.weights_lm_head, read from the engine's config at construction): the output
    head loads its full-precision weight through its own loader (vocabulary rows padded with zeros), is encoded once
    loaded, and the logits' product (``quant_method.apply``) is the format's; the input embedding stays. A model
    whose head shares the input embedding's weight is refused."""
    from types import SimpleNamespace

    import vllm.config
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing

    from turboquant_core.config import TQConfig

    linear, _, get_config, set_current, VllmConfig = vllm_linear
    config = get_config("tq4")()
    engine = VllmConfig()
    engine.cache_config.turboquant = TQConfig(weights_lm_head=True)
    with set_current(engine):
        emb = VocabParallelEmbedding(100, 256, params_dtype=torch.float32, quant_config=config, prefix="embed_tokens")
        head = ParallelLMHead(100, 256, params_dtype=torch.float32, quant_config=config, prefix="lm_head")
    assert emb.weight.dtype == torch.float32
    weight, x = torch.randn(100, 256) * 0.05, torch.randn(3, 256)
    head.weight.weight_loader(head.weight, weight)
    assert head.weight.is_meta  # the padding rows never load: vLLM encodes such a layer once loading is done
    finalize_layerwise_processing(head, None)
    rows = head.num_embeddings_padded  # vocabulary padded to a multiple of 64, the padding rows zero
    assert head.weight.dtype == torch.int32 and head.weight.shape == (rows, 2, 16) and rows == 128
    padded = torch.cat([weight, weight.new_zeros(rows - 100, 256)])
    want = tq_linear_reference(x, quantize_weight(padded, "tq4"))
    got = head.quant_method.apply(head, x)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    assert got[:, 100:].abs().max() == 0

    # A tied model is refused at its first layer: some models then never build a head of their own.
    tied = SimpleNamespace(cache_config=engine.cache_config,
                           model_config=SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=True)))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: tied)
    with pytest.raises(ValueError, match=r"--tq-weights-lm-head: this model's output head shares the input embedding"):
        linear.ReplicatedLinear(256, 64, bias=False, params_dtype=torch.float32, quant_config=get_config("tq4")(),
                                prefix="model.layers.0.mlp.down_proj")


def test_decode_int8_follows_the_engines_option(vllm_linear, monkeypatch):
    """--tq-weights-decode-int8 (TQConfig.weights_decode_int8, on by default): every linear method of the online and
    checkpoint configs takes it from the engine's config at construction and hands it to the product op."""
    from turboquant_core.config import TQConfig
    from turboquant_core.vllm import quant_config as qc

    linear, _, get_config, set_current, VllmConfig = vllm_linear
    seen = []
    monkeypatch.setattr(qc, "tq_linear_op", lambda *args: seen.append(args[-1]) or args[0].new_zeros(1))
    for decode_int8 in (True, False):
        engine = VllmConfig()
        engine.cache_config.turboquant = TQConfig(weights_decode_int8=decode_int8)
        with set_current(engine):
            online = linear.ReplicatedLinear(256, 64, bias=False, params_dtype=torch.float32,
                                             quant_config=get_config("tq4")(), prefix="o_proj")
            stored = linear.ReplicatedLinear(256, 64, bias=False, params_dtype=torch.float32,
                                             quant_config=qc.TQCheckpointConfig(qc.get_weight_format("tq3"), []),
                                             prefix="o_proj")
        _load(online, torch.randn(64, 256) * 0.05)
        for layer in (online, stored):
            assert layer.quant_method.decode_int8 is decode_int8
            layer.quant_method.apply(layer, torch.zeros(1, 256))
    assert seen == [True, True, False, False]


def test_moe_routers_stay_in_full_precision(vllm_linear):
    """A MoE block's router (``mlp.gate``, ``shared_expert_gate``) keeps its weight: a perturbed router picks other
    experts. Other layers named like projections are encoded."""
    linear, _, get_config, _, _ = vllm_linear
    config = get_config("tq4")()
    for prefix in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"):
        router = linear.ReplicatedLinear(256, 8, bias=False, params_dtype=torch.float32, quant_config=config,
                                         prefix=prefix)
        assert router.weight.dtype == torch.float32 and router.weight.shape == (8, 256), prefix
    proj = linear.ReplicatedLinear(256, 8, bias=False, params_dtype=torch.float32, quant_config=config,
                                   prefix="model.layers.0.mlp.gate_proj")
    _load(proj, torch.randn(8, 256))
    assert proj.weight.dtype == torch.int32


def test_names_in_the_engine_arguments_and_checkpoints_already_quantized(vllm_linear):
    _, methods, get_config, _, _ = vllm_linear
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--quantization", "tq3"]).quantization == "tq3"
    assert "tq5" not in methods
    with pytest.raises(ValueError, match="Invalid quantization method: tq5"):
        get_config("tq5")
    with pytest.raises(ValueError, match="already quantized \\(turboquant\\)"):
        get_config("tq4").from_config({"quant_method": "turboquant"})


def _checkpoint_config(vllm_linear, **changes):
    _, _, get_config, _, _ = vllm_linear
    from turboquant_core.formats import get_weight_format

    fmt = get_weight_format("tq4")
    config = {"quant_method": "turboquant", "format": "tq4", "bits": 4, "group_size": 128,
              "rotation_seed": fmt.seed, "packing": "planar8", "version": 1, "modules_not_converted": []}
    return get_config("turboquant").from_config({**config, **changes})


def test_checkpoint_layers_load_the_stored_bytes_shard_by_shard(vllm_linear):
    """What ``tq quantize`` writes per projection (q, k, v apart) loads into vLLM's fused QKV layer through its own
    loaders, and the row-parallel layer takes its groups: the products equal the reference's."""
    linear = vllm_linear[0]
    config = _checkpoint_config(vllm_linear)
    g = torch.Generator().manual_seed(1)
    qkv = linear.QKVParallelLinear(256, 64, 4, 2, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                                   prefix="model.layers.0.self_attn.qkv_proj")
    weights = {s: torch.randn(n * 64, 256, generator=g) * 0.05 for s, n in (("q", 4), ("k", 2), ("v", 2))}
    for shard, weight in weights.items():
        q = quantize_weight(weight, "tq4")
        qkv.weight_packed.weight_loader(qkv.weight_packed, q.packed, shard)
        qkv.weight_scale.weight_loader(qkv.weight_scale, q.scales, shard)
    whole = quantize_weight(torch.cat(list(weights.values())), "tq4")
    assert torch.equal(qkv.weight_packed.data, whole.packed) and torch.equal(qkv.weight_scale.data, whole.scales)
    qkv.quant_method.process_weights_after_loading(qkv)  # served as kernel words
    assert torch.equal(qkv.weight_packed.data, served_layout(whole).packed)
    x = torch.randn(4, 256, generator=g)
    want = tq_linear_reference(x, whole)
    torch.testing.assert_close(qkv(x.bfloat16())[0].float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())

    row = linear.RowParallelLinear(384, 64, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                                   prefix="model.layers.0.mlp.down_proj")
    q = quantize_weight(torch.randn(64, 384, generator=g) * 0.05, "tq4")
    row.weight_packed.weight_loader(row.weight_packed, q.packed)
    row.weight_scale.weight_loader(row.weight_scale, q.scales)
    row.quant_method.process_weights_after_loading(row)
    x = torch.randn(2, 384, generator=g)
    want = tq_linear_reference(x, q)
    torch.testing.assert_close(row(x.bfloat16())[0].float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_checkpoint_configs_that_disagree_or_split_a_fused_layer_are_refused(vllm_linear):
    linear = vllm_linear[0]
    with pytest.raises(ValueError, match=r"disagrees with format tq4: group_size 64 \(the format's: 128\)"):
        _checkpoint_config(vllm_linear, group_size=64)
    with pytest.raises(ValueError, match="unknown weight format 'tq5'; valid formats: tq4, tq3"):
        _checkpoint_config(vllm_linear, format="tq5")
    with pytest.raises(ValueError, match="version 3 is not one this code reads"):
        _checkpoint_config(vllm_linear, version=3)
    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    some = _checkpoint_config(vllm_linear, modules_not_converted=["model.layers.0.self_attn.v_proj"])
    some.packed_modules_mapping = mapping
    with pytest.raises(ValueError, match="qkv_proj fuses .* of which only some are quantized"):
        linear.QKVParallelLinear(256, 64, 4, 2, quant_config=some, prefix="model.layers.0.self_attn.qkv_proj")
    kept = _checkpoint_config(vllm_linear, modules_not_converted=[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])
    kept.packed_modules_mapping = mapping
    layer = linear.QKVParallelLinear(256, 64, 4, 2, params_dtype=torch.float32, quant_config=kept,
                                     prefix="model.layers.0.self_attn.qkv_proj")
    assert layer.weight.dtype == torch.float32 and not hasattr(layer, "weight_packed")


def test_a_tq_quantize_checkpoint_config_is_read(vllm_linear, tmp_path):
    """The quantization_config ``tq quantize`` writes is the one the checkpoint config reads."""
    import json

    from safetensors.torch import save_file

    from turboquant_core.integrations.quantize_checkpoint import quantize_checkpoint

    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 256)}, str(src / "model.safetensors"))
    quantize_checkpoint(src, tmp_path / "out", "tq3", progress=False)
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    _, _, get_config, _, _ = vllm_linear
    config = get_config(q["quant_method"]).from_config(q)
    assert config.get_name() == "turboquant" and config.fmt.name == "tq3"


def _moe(vllm_linear, name, prefix, **kwargs):
    from vllm.model_executor.layers.fused_moe import FusedMoE

    _, _, get_config, _, _ = vllm_linear
    args = dict(num_experts=4, top_k=2, hidden_size=256, intermediate_size=192, params_dtype=torch.bfloat16,
                quant_config=get_config(name)(), prefix=prefix)
    return FusedMoE(**{**args, **kwargs})


@pytest.mark.parametrize("name", ["tq4", "tq3"])
def test_moe_experts_encode_at_load_and_compute_the_reference(vllm_linear, name):
    """vLLM's FusedMoE (4 experts, top-2, hidden 256, intermediate 192: w2's last group padded) gets the TurboQuant
    experts method: bf16 experts created as the unquantized method creates them, loaded through vLLM's expert loader
    shard by shard (gate, up, down), encoded once loaded; the routed product (what vLLM's runner calls after its
    router) equals ops.moe_linear.moe_reference."""
    from turboquant_core.ops.moe_linear import moe_reference, quantize_experts
    from turboquant_core.vllm.moe_method import TQFusedMoEMethod

    runner = _moe(vllm_linear, name, f"model.layers.0.mlp.experts.{name}")
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, TQFusedMoEMethod) and not runner.is_monolithic
    assert experts.w13_weight.shape == (4, 384, 256) and experts.w2_weight.shape == (4, 256, 192)
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.bfloat16
    assert experts.w13_weight.is_meta and experts.w2_weight.is_meta  # layerwise: materialized once all shards load
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 192, 256, generator=g) * 0.05 for _ in range(2))
    down = torch.randn(4, 256, 192, generator=g) * 0.05
    for e in range(4):
        for shard, param, weight in (("w1", "w13_weight", gate), ("w3", "w13_weight", up), ("w2", "w2_weight", down)):
            p = getattr(experts, param)
            p.weight_loader(p, weight[e].bfloat16(), param, shard_id=shard, expert_id=e)
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.uint8  # encoded when the last shard loaded
    experts.quant_method.process_weights_after_loading(experts)  # the model-wide pass: nothing left to do
    w13 = quantize_experts(torch.cat([gate, up], dim=1).bfloat16(), name)
    w2 = quantize_experts(down.bfloat16(), name)
    assert experts.w13_weight.dtype == torch.uint8 and experts.w13_weight_scale.dtype == torch.float16
    assert torch.equal(experts.w13_weight, w13.packed) and torch.equal(experts.w13_weight_scale, w13.scales)
    assert torch.equal(experts.w2_weight, w2.packed) and torch.equal(experts.w2_weight_scale, w2.scales)
    assert experts.w2_weight.shape == (4, 256, 2, 16 * w13.fmt.bits)

    x = torch.randn(6, 256, generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn(6, 4, generator=g), -1).topk(2)
    weights, ids = weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)
    got = experts.forward_modular(x=x, topk_weights=weights, topk_ids=ids)
    want = moe_reference(x, w13, w2, weights, ids)
    assert got.shape == (6, 256) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=4e-2 * want.abs().max().item())


def test_moe_features_the_experts_do_not_cover_are_refused_by_name(vllm_linear):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe import MoEActivation

    from turboquant_core.vllm.moe_method import unsupported_moe_features

    with pytest.raises(ValueError, match=r"--quantization tq4: MoE layer model.layers.1.mlp.experts uses activation "
                                         r"'gelu', which TurboQuant experts do not cover \(supported: gated SiLU"):
        _moe(vllm_linear, "tq4", "model.layers.1.mlp.experts", activation="gelu")
    with pytest.raises(ValueError, match="MoE layer model.layers.2.mlp.experts uses expert biases"):
        _moe(vllm_linear, "tq3", "model.layers.2.mlp.experts", has_bias=True)
    with pytest.raises(ValueError, match="uses SwiGLU swiglu_limit"):
        _moe(vllm_linear, "tq4", "model.layers.3.mlp.experts", swiglu_limit=7.0)
    # expert parallelism and LoRA need more than one rank or a LoRA config to build; the check reads the layer's config
    def layer(use_ep, lora):
        parallel = SimpleNamespace(use_ep=use_ep, enable_eplb=use_ep)
        return SimpleNamespace(moe_config=SimpleNamespace(activation=MoEActivation.SILU, has_bias=False,
                                                          is_lora_enabled=lora, moe_parallel_config=parallel))

    assert unsupported_moe_features(layer(True, True)) == ["expert parallelism with EPLB", "LoRA"]
    assert unsupported_moe_features(layer(False, False)) == []




def _mlp(layer):
    return f"model.layers.{layer}.mlp"


def _moe_state(layer, seed=2, experts=4, hidden=256, inter=192):
    """A small MoE block (decoder layer ``layer``; vLLM wants one name per MoE layer in a process) as a Hugging Face
    checkpoint names it (Qwen-style: per-expert gate/up/down projections and a router ``mlp.gate``), bf16."""
    mlp = _mlp(layer)
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(experts, inter, hidden, generator=g) * 0.05 for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=g) * 0.05
    state = {f"{mlp}.gate.weight": torch.randn(experts, hidden, generator=g)}
    for e in range(experts):
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            state[f"{mlp}.experts.{e}.{proj}.weight"] = w[e]
    return {k: v.bfloat16() for k, v in state.items()}


def _tq_quantize(tmp_path, state, name, **kwargs):
    """What ``tq quantize`` writes for ``state``: (its tensors, its quantization_config). An attention projection
    of another layer goes along (there is something to quantize when all experts are kept) and is left out of the
    tensors returned."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from turboquant_core.integrations.quantize_checkpoint import quantize_checkpoint

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    other = "model.layers.99.self_attn.o_proj"
    save_file({**state, f"{other}.weight": torch.zeros(128, 128, dtype=torch.bfloat16)}, str(src / "model.safetensors"))
    quantize_checkpoint(src, out, name, progress=False, **kwargs)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(other)}
    return tensors, json.loads((out / "config.json").read_text())["quantization_config"]


def _checkpoint_moe_block(vllm_linear, qconfig, layer, **kwargs):
    """vLLM's router and FusedMoE under the checkpoint's config, named as in the checkpoint (a module tree that
    vLLM's ``AutoWeightsLoader`` walks as it walks a model's)."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    mlp = _mlp(layer)
    linear, _, get_config, _, _ = vllm_linear
    config = get_config(qconfig["quant_method"]).from_config(qconfig)
    args = dict(num_experts=4, top_k=2, hidden_size=256, intermediate_size=192, params_dtype=torch.bfloat16,
                quant_config=config, prefix=f"{mlp}.experts")
    runner = FusedMoE(**{**args, **kwargs})
    router = linear.ReplicatedLinear(256, 4, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                                     prefix=f"{mlp}.gate")
    layers = torch.nn.ModuleDict({str(layer): torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
        {"gate": router, "experts": runner})})})
    model = torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"layers": layers})})
    return model, router, runner


def _load_through_vllm(model, tensors):
    from vllm.model_executor.models.utils import AutoWeightsLoader

    return AutoWeightsLoader(model).load_weights(tensors.items())


@pytest.mark.parametrize("name", ["tq4", "tq3"])
def test_checkpoint_moe_experts_load_the_stored_bytes_and_compute_the_reference(vllm_linear, tmp_path, name):
    """What ``tq quantize`` writes for a MoE block loads through vLLM's own loaders (``AutoWeightsLoader`` -> the
    runner -> ``RoutedExperts.load_weights``'s expert mapping -> its weight loader, expert by expert, shard by
    shard): the router stays in full precision, the experts hold exactly the bytes the online method encodes, and
    their forward is the online method's and the reference's."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from turboquant_core.formats import get_weight_format
    from turboquant_core.ops.moe_linear import moe_reference
    from turboquant_core.vllm.moe_method import TQPackedFusedMoEMethod

    layer = 10 + ["tq4", "tq3"].index(name)
    mlp = _mlp(layer)
    state = _moe_state(layer)
    tensors, qconfig = _tq_quantize(tmp_path, state, name)
    assert f"{mlp}.gate" in qconfig["modules_not_converted"]
    model, router, runner = _checkpoint_moe_block(vllm_linear, qconfig, layer)
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, TQPackedFusedMoEMethod) and not runner.is_monolithic
    assert isinstance(router.quant_method, UnquantizedLinearMethod)
    loaded = _load_through_vllm(model, tensors)
    assert {n.rpartition(".")[2] for n in loaded} == {"weight", "w13_weight_packed", "w13_weight_scale",
                                                      "w2_weight_packed", "w2_weight_scale"}
    experts.quant_method.process_weights_after_loading(experts)
    assert torch.equal(router.weight, state[f"{mlp}.gate.weight"])

    online = _moe(vllm_linear, name, f"{mlp}.online").routed_experts  # the same weights encoded at load
    for e in range(4):
        for shard, param, proj in (("w1", "w13_weight", "gate_proj"), ("w3", "w13_weight", "up_proj"),
                                   ("w2", "w2_weight", "down_proj")):
            p = getattr(online, param)
            p.weight_loader(p, state[f"{mlp}.experts.{e}.{proj}.weight"], param, shard_id=shard, expert_id=e)
    online.quant_method.process_weights_after_loading(online)
    bits = get_weight_format(name).bits
    assert experts.w13_weight_packed.shape == (4, 384, 2, 16 * bits) and experts.w13_weight_scale.shape == (4, 384, 2)
    assert experts.w2_weight_packed.shape == (4, 256, 2, 16 * bits) and experts.w2_weight_scale.shape == (4, 256, 2)
    for w in ("w13", "w2"):
        assert torch.equal(getattr(experts, f"{w}_weight_packed"), getattr(online, f"{w}_weight")), w
        assert torch.equal(getattr(experts, f"{w}_weight_scale"), getattr(online, f"{w}_weight_scale")), w

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 256, generator=g).bfloat16()
    weights, ids = torch.softmax(torch.randn(6, 4, generator=g), -1).topk(2)
    weights, ids = weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)
    got = experts.forward_modular(x=x, topk_weights=weights, topk_ids=ids)
    assert torch.equal(got, online.forward_modular(x=x, topk_weights=weights, topk_ids=ids))
    w13, w2 = experts.quant_method.experts(experts)
    want = moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=4e-2 * want.abs().max().item())


def test_checkpoint_moe_experts_take_their_tensor_parallel_slice(vllm_linear, tmp_path):
    """Two tensor-parallel ranks (this process is rank 0): w13 takes the rank's gate rows and up rows, w2 the rank's
    input groups, through vLLM's expert loader, and a rank's intermediate size that 128 does not divide is refused."""
    mlp = _mlp(20)
    state = _moe_state(20, experts=4, inter=512)
    tensors, qconfig = _tq_quantize(tmp_path, state, "tq4")
    model, _, runner = _checkpoint_moe_block(vllm_linear, qconfig, 20, intermediate_size=512, tp_size=2)
    experts = runner.routed_experts
    assert experts.moe_config.moe_parallel_config.tp_size == 2 and experts.moe_config.tp_rank == 0
    _load_through_vllm(model, tensors)
    experts.quant_method.process_weights_after_loading(experts)

    from turboquant_core.ops.moe_linear import quantize_experts

    def stack(proj):
        return torch.stack([state[f"{mlp}.experts.{e}.{proj}.weight"] for e in range(4)])

    w13 = quantize_experts(torch.cat([stack("gate_proj")[:, :256], stack("up_proj")[:, :256]], dim=1), "tq4")
    w2 = quantize_experts(stack("down_proj")[:, :, :256], "tq4")
    assert torch.equal(experts.w13_weight_packed, w13.packed) and torch.equal(experts.w13_weight_scale, w13.scales)
    assert torch.equal(experts.w2_weight_packed, w2.packed) and torch.equal(experts.w2_weight_scale, w2.scales)

    with pytest.raises(ValueError, match=r"MoE layer model.layers.20.mlp.experts has 96 expert intermediate features "
                                         r"\(down_proj inputs\) per tensor-parallel rank, not a multiple of the group "
                                         r"size 128; use fewer ranks"):
        _checkpoint_moe_block(vllm_linear, qconfig, 20, intermediate_size=192, tp_size=2)


def test_checkpoint_moe_experts_kept_partly_kept_unsupported_or_old_are_handled(vllm_linear, tmp_path):
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    mlp = _mlp(30)
    state = _moe_state(30)
    # all experts kept (tq quantize --keep): vLLM's unquantized experts, loaded as they are stored
    tensors, qconfig = _tq_quantize(tmp_path / "kept", state, "tq4", keep=("*.experts.*",))
    assert not any(k.startswith(f"{mlp}.experts.") for k in qconfig["quantized"])
    model, _, runner = _checkpoint_moe_block(vllm_linear, qconfig, 30)
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, UnquantizedFusedMoEMethod)
    _load_through_vllm(model, tensors)
    gate_up = torch.cat([state[f"{mlp}.experts.3.gate_proj.weight"],
                         state[f"{mlp}.experts.3.up_proj.weight"]])
    assert torch.equal(experts.w13_weight[3], gate_up)
    assert torch.equal(experts.w2_weight[3], state[f"{mlp}.experts.3.down_proj.weight"])

    _, partly = _tq_quantize(tmp_path / "partly", state, "tq4", keep=("*.experts.0.*",))
    with pytest.raises(ValueError, match=r"the experts of MoE layer model.layers.30.mlp.experts are partly "
                                         r"quantized \(9 projections, e.g. model.layers.30.mlp.experts.1.down_proj; "
                                         r"3 kept, e.g. model.layers.30.mlp.experts.0.down_proj\)"):
        _checkpoint_moe_block(vllm_linear, partly, 30)

    _, qconfig = _tq_quantize(tmp_path / "all", state, "tq3")
    with pytest.raises(ValueError, match=r"TurboQuant checkpoint: MoE layer model.layers.30.mlp.experts uses "
                                         r"activation 'gelu', which TurboQuant experts do not cover \(supported: "
                                         r"gated SiLU .*\); quantize the model again with its experts kept"):
        _checkpoint_moe_block(vllm_linear, qconfig, 30, activation="gelu")
    with pytest.raises(ValueError, match="MoE layer model.layers.30.mlp.experts uses expert biases"):
        _checkpoint_moe_block(vllm_linear, qconfig, 30, has_bias=True)
    with pytest.raises(ValueError, match=r"version 1 stored the experts of MoE layer model.layers.30.mlp.experts "
                                         r"in a layout vLLM's expert loader cannot read"):
        _checkpoint_moe_block(vllm_linear, {**qconfig, "version": 1}, 30)

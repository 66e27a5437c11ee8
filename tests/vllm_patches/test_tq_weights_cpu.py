# SPDX-License-Identifier: Apache-2.0
"""``--quantization tq3|tq4`` (patch 0010, turboquant_core/vllm/quant_config.py) without a GPU: vLLM's own column-
and row-parallel linear layers (one rank, gloo) load a full-precision weight through their loaders, encode it once
loaded and compute the rotated-domain product of ops.weight_codec (the kernel in Triton's interpreter); the names
reach vLLM's registry and argument checks; what the method does not take stays as it is. Runs only where a patched
vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise."""

from __future__ import annotations

import pytest
import torch

from turboquant_core.ops.weight_codec import quantize_weight, tq_linear_reference


@pytest.fixture(scope="module")
def vllm_linear(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU recipe (the kernel runs in the interpreter here)")
    from test_config_layer import _patched_vllm_dir, _select_cpu_platform_if_none_detected

    _patched_vllm_dir()
    try:
        _select_cpu_platform_if_none_detected()
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state
        from vllm.model_executor.layers import linear
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    except ImportError as e:
        pytest.skip(f"patched vllm is installed but its linear layers do not import: {e}")
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
        q = quantize_weight(weight, name)
        assert layer.tq_encoded and layer.weight.dtype == torch.uint8
        assert torch.equal(layer.weight, q.packed) and torch.equal(layer.weight_scale, q.scales)
        got = layer(x)[0]
        want = tq_linear_reference(x, q, bias)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_layers_the_format_does_not_take_stay_as_they_are(vllm_linear):
    linear, _, get_config, _, _ = vllm_linear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    config = get_config("tq4")()
    emb = VocabParallelEmbedding(128, 256, params_dtype=torch.float32, quant_config=config, prefix="embed_tokens")
    head = ParallelLMHead(128, 256, params_dtype=torch.float32, quant_config=config, prefix="lm_head")
    assert emb.weight.dtype == torch.float32 and head.weight.dtype == torch.float32
    odd = linear.ReplicatedLinear(200, 64, bias=False, params_dtype=torch.float32, quant_config=config, prefix="odd")
    weight, x = torch.randn(64, 200), torch.randn(3, 200)
    _load(odd, weight)
    assert not odd.tq_encoded and odd.weight.dtype == torch.float32
    torch.testing.assert_close(odd(x)[0], x @ weight.T)


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

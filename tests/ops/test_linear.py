# SPDX-License-Identifier: Apache-2.0
"""The TurboQuant linear kernel (turboquant_core/kernels/linear_jit.py via ops.linear.tq_linear) against the
plain-torch rotated-domain product (ops.weight_codec.tq_linear_reference): both formats, 1 to 40 activation rows
(one and several batch tiles), output sizes that do not fill a block, bias, bf16 activations with outliers beyond
fp16's range, a product split over ranges of groups, an input dimension whose last group is padded. In Triton's
interpreter on the CPU, compiled on a GPU."""

import pytest
import torch

from turboquant_core.ops.linear import num_group_splits, rotated_activation, tq_linear
from turboquant_core.ops.weight_codec import quantize_weight, tq_linear_reference


def _case(out, inp, rows, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g) * 0.05
    x = torch.randn(rows, inp, generator=g)
    return weight.to(device), x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("out,inp,rows", [(64, 128, 1), (80, 256, 3), (40, 384, 16), (72, 256, 17), (64, 1152, 2),
                                          (48, 576, 3)])
def test_kernel_matches_the_rotated_reference(fmt, out, inp, rows, device):
    weight, x = _case(out, inp, rows, out + inp + rows, device)
    w = quantize_weight(weight, fmt)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(3)).to(device)
    want = tq_linear_reference(x, w, bias)
    got = tq_linear(x, w, bias)
    assert got.shape == (rows, out) and got.dtype == x.dtype
    # fp16 operands (activation rounded once), fp32 accumulation
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_few_output_tiles_split_the_groups():
    """One output tile and one batch tile over 9 groups: two ranges of groups (5 and 4), summed after."""
    assert num_group_splits(1, 9, "cpu") == 2 and num_group_splits(1, 7, "cpu") == 1
    assert num_group_splits(10 ** 4, 64, "cpu") == 1  # enough tiles: no split


def test_leading_dims_bf16_and_outliers_beyond_fp16(device):
    weight, _ = _case(48, 256, 1, 11, device)
    w = quantize_weight(weight, "tq4")
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4)).to(device)
    x[0, 1, 7] = 3.0e5  # a bf16 activation fp16 cannot hold
    x = x.to(torch.bfloat16)
    got = tq_linear(x, w)
    want = tq_linear_reference(x, w)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().amax(-1, keepdim=True).max().item())


def test_rotated_activation_scale_is_a_power_of_two_and_exact(device):
    weight, x = _case(16, 256, 5, 2, device)
    w = quantize_weight(weight, "tq3")
    xk, scale = rotated_activation(x * 1e4, w)
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))
    assert xk.dtype == torch.float16 and xk.abs().max() <= 4096


def test_wrong_activation_width_is_named(device):
    weight, _ = _case(16, 256, 1, 0, device)
    with pytest.raises(ValueError, match="activation has 255 features, the weight 256"):
        tq_linear(torch.zeros(1, 255, device=device), quantize_weight(weight, "tq4"))


PROBE = r'''
import torch
from tests.ops import sm90_probe


def on_launch(launch):
    res = launch.compile()
    print(res["kernel"], res["stack"], res["shared"], flush=True)


sm90_probe.install(on_launch)

from turboquant_core.ops.linear import tq_linear
from turboquant_core.ops.weight_codec import quantize_weight

for fmt in ("tq4", "tq3"):
    tq_linear(torch.randn(3, 256), quantize_weight(torch.randn(64, 256), fmt))
'''


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills():
    """Both formats compile for sm_90 (the register codebook lookups the interpreter cannot run included), with
    no register spills."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    res = [line.split() for line in p.stdout.strip().splitlines()]
    assert [r[0] for r in res] == ["tq_linear_kernel", "tq_linear_kernel"], res
    assert all(int(stack) == 0 for _, stack, _ in res), res


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_cuda_graph_replay_equals_eager(fmt):
    """Captured once (after a first call made the tables), replayed on new activations: what vLLM's graphs do."""
    weight, x = _case(96, 512, 8, 5, "cuda", torch.bfloat16)
    w = quantize_weight(weight, fmt)
    tq_linear(x, w)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = tq_linear(static_x, w)
    for seed in (6, 7):
        new = torch.randn(8, 512, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        static_x.copy_(new)
        graph.replay()
        torch.testing.assert_close(static_y, tq_linear(new, w), rtol=0, atol=0)

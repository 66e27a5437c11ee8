# SPDX-License-Identifier: Apache-2.0
"""The TurboQuant MoE kernel (turboquant_core/kernels/moe_linear_jit.py via ops.moe_linear) against the plain-torch
references (ops.moe_linear.moe_linear_reference, moe_reference): both formats, a few tokens routed top-2 over 4
experts unevenly (one expert with no tokens, one over several blocks), input sizes whose last group is padded,
router weights on either product, bf16 and fp16; the plain-torch routing layout against vLLM's contract (and, on a
GPU with vLLM, against its moe_align_block_size). In Triton's interpreter on the CPU, compiled on a GPU."""

import pytest
import torch
import triton

from turboquant_core.formats import get_weight_format
from turboquant_core.ops.moe_linear import (
    moe_align_block_size_torch,
    moe_block_m,
    moe_linear_reference,
    moe_reference,
    quantize_experts,
    tq_fused_moe,
    tq_moe_linear,
)
from turboquant_core.ops.weight_codec import quantize_weight

E = 4
# token t's two experts: expert 1 takes most rows, expert 2 none
ROUTES = [[1, 0], [1, 3], [0, 1], [3, 1], [1, 0]]


def _experts(fmt, hidden, inter, seed, device):
    g = torch.Generator().manual_seed(seed)
    w13 = quantize_experts((torch.randn(E, 2 * inter, hidden, generator=g) * 0.05).to(device), fmt)
    w2 = quantize_experts((torch.randn(E, hidden, inter, generator=g) * 0.05).to(device), fmt)
    return w13, w2


def _routing(tokens, seed, device, uneven=ROUTES):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([uneven[t % len(uneven)] for t in range(tokens)], dtype=torch.int32)
    weights = torch.rand(tokens, 2, generator=g)
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def _tol(dtype, want, products=1):
    # the activation rounded to bf16/fp16 before and after its rotation, the codebook values and each product's
    # output in that type, fp32 accumulation (test_linear.py's tolerances), once per chained product
    scale = want.abs().max().item() * products
    return dict(rtol=1e-2, atol=2e-2 * scale) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=4e-3 * scale)


def check_layout(topk_ids, block, num_experts, sorted_ids, expert_ids, num_post):
    """vLLM's moe_align_block_size contract (see ops.moe_linear.moe_align_block_size_torch), order within an
    expert's range aside."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    size = numel + num_experts * (block - 1)
    if numel < num_experts:
        size = min(numel * block, size)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert tuple(sorted_ids.shape) == (size,) and tuple(expert_ids.shape) == (triton.cdiv(size, block),)
    s, ex = sorted_ids.cpu(), expert_ids.cpu()
    pos = 0
    for e in range(num_experts):
        rows = (flat == e).nonzero().flatten().tolist()
        n = triton.cdiv(len(rows), block) * block
        assert sorted(s[pos:pos + len(rows)].tolist()) == rows, e
        assert (s[pos + len(rows):pos + n] == numel).all(), e
        assert (ex[pos // block:(pos + n) // block] == e).all(), e
        pos += n
    assert int(num_post) == pos
    assert (ex[pos // block:] == -1).all() and (s[pos:] == numel).all()


def test_torch_alignment_is_vllms_layout(device):
    # vLLM's docstring example (0-based experts): 12 routed rows, 3 per expert, blocks of 4
    ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_post = moe_align_block_size_torch(ids, 4, 4)
    assert sorted_ids.tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12] + [12] * 8
    assert expert_ids.tolist() == [0, 1, 2, 3, -1, -1] and num_post.tolist() == [16]
    g = torch.Generator().manual_seed(0)
    for tokens, top_k, experts, block in [(5, 2, 4, 16), (1, 2, 8, 16), (40, 2, 4, 16), (33, 8, 128, 64),
                                          (3, 1, 4, 2)]:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(device)
        ids[: tokens // 2] = ids[0].clone()  # uneven: half the tokens on the same experts
        check_layout(ids, block, experts, *moe_align_block_size_torch(ids, block, experts))


@pytest.mark.gpu
def test_torch_alignment_equals_vllms_cuda_op():
    """Where vLLM imports: its CUDA moe_align_block_size gives the same layout, up to the order of rows within an
    expert's range."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    g = torch.Generator().manual_seed(1)
    for tokens, top_k, experts, block in [(5, 2, 4, 16), (1, 8, 128, 16), (300, 8, 128, 64), (2000, 8, 128, 64)]:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to("cuda",
                                                                                                   torch.int32)
        got = moe_align_block_size(ids, block, experts)
        check_layout(ids, block, experts, *got)  # so each expert's range holds the same rows as ours
        mine = moe_align_block_size_torch(ids, block, experts)
        assert got[0].shape == mine[0].shape and torch.equal(got[1], mine[1]) and torch.equal(got[2], mine[2])


def test_block_rows_follow_the_rows_per_expert():
    assert moe_block_m(1, 8, 128) == 16 and moe_block_m(5, 2, 4) == 16
    assert moe_block_m(40, 2, 4) == 32 and moe_block_m(2048, 8, 128) == 64


def test_stacked_experts_are_per_expert_weights_and_exact_bytes():
    fmt = get_weight_format("tq3")
    weights = torch.randn(3, 40, 200, generator=torch.Generator().manual_seed(2)) * 0.05
    w = quantize_experts(weights, fmt)
    assert w.packed.shape == (3, 40, 2, 48) and w.scales.shape == (3, 40, 2)
    assert w.nbytes() == 3 * fmt.weight_bytes(40, 200) == 3 * 40 * 2 * (16 * 3 + 2)
    for e in range(3):
        q = quantize_weight(weights[e], fmt)
        assert torch.equal(w.expert(e).packed, q.packed) and torch.equal(w.expert(e).scales, q.scales)


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_product_matches_the_reference(fmt, dtype, device):
    """w13 (input rows t, top_k 2) and w2 (its rows, top_k 1, times the router weights), one launch each, against
    the per-expert reference; 320 and 96 inputs leave the last group padded, 192 outputs three tiles of 64."""
    w13, w2 = _experts(fmt, 320, 96, 3, device)
    ids, weights = _routing(5, 4, device)
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    block_m = moe_block_m(5, 2, E)
    layout = moe_align_block_size_torch(ids, block_m, E)
    h = tq_moe_linear(x, w13, *layout, 2, block_m)
    want = moe_linear_reference(x, w13, ids)
    assert h.shape == (10, 192) and h.dtype == dtype
    torch.testing.assert_close(h.float(), want, **_tol(dtype, want))
    a = torch.randn(10, 96, generator=torch.Generator().manual_seed(6)).to(device, dtype)
    y = tq_moe_linear(a, w2, *layout, 1, block_m, weights)
    want = moe_linear_reference(a, w2, ids.reshape(-1, 1), weights)
    torch.testing.assert_close(y.float(), want, **_tol(dtype, want))


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_fused_moe_matches_the_reference(fmt, device):
    """The layer: w13, SiLU-and-mul, w2 with the router weights, the top-2 sum; 40 tokens so that blocks take 32
    rows and expert 1 spans several of them; expert 2 gets no token."""
    w13, w2 = _experts(fmt, 256, 192, 7, device)
    ids, weights = _routing(40, 8, device)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(9)).to(device, torch.bfloat16)
    assert moe_block_m(40, 2, E) == 32
    got = tq_fused_moe(x, w13, w2, weights, ids)
    want = moe_reference(x, w13, w2, weights, ids)
    assert got.shape == (40, 256) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, **_tol(torch.bfloat16, want, products=2))


def test_router_weight_on_the_input_and_fp32_activations(device):
    """vLLM's apply_router_weight_on_input (top-1 models): the weight multiplies w13's output; fp32 activations run
    in fp16 and come back in fp32."""
    w13, w2 = _experts("tq4", 128, 128, 10, device)
    ids = torch.tensor([[2], [0], [2]], dtype=torch.int32, device=device)
    weights = torch.tensor([[0.5], [2.0], [1.5]], device=device)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(11)).to(device)
    got = tq_fused_moe(x, w13, w2, weights, ids, apply_router_weight_on_input=True)
    want = moe_reference(x, w13, w2, weights, ids, apply_router_weight_on_input=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **_tol(torch.float16, want, products=2))


def test_shapes_that_do_not_chain_are_named(device):
    w13, w2 = _experts("tq4", 128, 64, 12, device)
    ids, weights = _routing(2, 0, device)
    with pytest.raises(ValueError, match="experts do not chain"):
        tq_fused_moe(torch.zeros(2, 256, device=device), w13, w2, weights, ids)
    layout = moe_align_block_size_torch(ids, 16, E)
    with pytest.raises(ValueError, match=r"activation must be \[tokens, 128\]"):
        tq_moe_linear(torch.zeros(2, 127, device=device), w13, *layout, 2, 16)
    with pytest.raises(ValueError, match="3 router weights for 4 routed rows"):
        tq_moe_linear(torch.zeros(2, 128, device=device), w13, *layout, 2, 16, weights.reshape(-1)[:3])


PROBE = r'''
import torch
from tests.ops import sm90_probe

sm90_probe.install_printer()

from turboquant_core.ops.moe_linear import moe_block_m, quantize_experts, tq_fused_moe

for fmt in ("tq4", "tq3"):
    w13 = quantize_experts(torch.randn(16, 2 * 192, 2048) * 0.05, fmt)
    w2 = quantize_experts(torch.randn(16, 2048, 192) * 0.05, fmt)
    for dtype in (torch.bfloat16, torch.float16):
        for tokens in (3, 200):  # blocks of 16 (decode) and 64 (prefill) rows
            ids = torch.stack([torch.randperm(16)[:8] for _ in range(tokens)]).int()
            x = torch.randn(tokens, 2048, dtype=dtype)
            tq_fused_moe(x, w13, w2, torch.rand(tokens, 8), ids)
'''


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills():
    """Every variant (both formats and activation types, 16 and 64 rows per block, w13 with top-8 rows and w2 with
    the router weights) compiles for sm_90, the register codebook lookups the interpreter cannot run included,
    with no register spills."""
    assert moe_block_m(3, 8, 16) == 16 and moe_block_m(200, 8, 16) == 64
    from tests.ops import sm90_probe

    res = sm90_probe.run_probe(PROBE)
    assert [r[0] for r in res] == ["tq_moe_linear_kernel"] * 16, res
    assert all(stack == 0 for _, _, stack, _ in res), res


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_cuda_graph_replay_equals_eager(fmt):
    """Captured once (after a first call compiled the kernels and made the tables), replayed on new activations and
    routes: the layout, both products and the sum read only device tensors."""
    w13, w2 = _experts(fmt, 256, 192, 13, "cuda")
    ids, weights = _routing(6, 14, "cuda")
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(15)).to("cuda", torch.bfloat16)
    tq_fused_moe(x, w13, w2, weights, ids)
    static = [x.clone(), ids.clone(), weights.clone()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tq_fused_moe(static[0], w13, w2, static[2], static[1])
    for seed in (16, 17):
        new_x = torch.randn(6, 256, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        new_ids, new_w = _routing(6, seed, "cuda", uneven=[[2, 3], [0, 2], [3, 1]])
        for s, n in zip(static, (new_x, new_ids, new_w)):
            s.copy_(n)
        graph.replay()
        torch.testing.assert_close(out, tq_fused_moe(new_x, w13, w2, new_w, new_ids), rtol=0, atol=0)

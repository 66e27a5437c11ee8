# SPDX-License-Identifier: Apache-2.0
"""The register-tile decode path (``ops.paged_decode``, ``kernels.paged_decode_jit``): its coordinate orders
and codebook words on the CPU, its kernels compiled for sm_90 on the CPU (no GPU needed), and on a GPU its
outputs against the reference and the Triton kernel."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ops.test_codebook_lookup import _run_jit_helpers
from tests.ops.test_paged import _check, _paged_batch
from turboquant_core.formats import format_names, get_format
from turboquant_core.kernels.paged_decode_jit import plane_transpose_asm
from turboquant_core.ops import paged_decode
from turboquant_core.ops.page_layout import paged_layout
from turboquant_core.ops.paged import tq_paged_attention_ref
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan
from turboquant_core.ops.paged_decode import (
    DECODE_BITS,
    codebook_permute_words,
    decode_key_order,
    decode_path_applies,
    decode_value_order,
)

ROOT = Path(__file__).resolve().parents[2]
# The GPU tests here are the register-tile kernel's: on an sm_90 GPU the default ("auto") takes k3v4 decode batches
# of head_dim 128 to the e4m3 warpgroup-MMA kernel (tests/ops/test_paged_decode_wgmma.py).
REGISTER_TILE = TQAttentionConfig(decode_kernel="register-tile")


@pytest.mark.parametrize("num_reqs,context,want", [(8, 32768, 24), (16, 16384, 12), (64, 1280, 3), (32, 8448, 6),
                                                   (128, 2048, 3), (384, 2304, 1), (1, 32768, 128), (4, 2048, 8)])
def test_split_count_fills_whole_waves_of_programs(num_reqs, context, want):
    """132 SMs (the CPU stands in for an H100), 8 KV heads, pages of 16, one split per 256 tokens at most: the
    counts the split sweep measured fastest, none leaving a few programs to a wave of their own."""
    wave = paged_decode.DECODE_PROGRAMS_PER_SM * 132
    got = paged_decode.num_decode_splits(num_reqs, 8, context, "cpu", 256, 1 << 20)
    assert got == want
    programs = num_reqs * 8 * got
    if got > 1 and got < context // 256:  # not capped by the context: the waves are nearly full
        assert programs / (-(-programs // wave) * wave) >= 0.9, (programs, wave)
    assert paged_decode.num_decode_splits(num_reqs, 8, context, "cpu", 256, 2) <= 2


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_orders_are_permutations_with_a_words_fields_in_one_thread(dim):
    for order, lane_bits in ((decode_key_order(dim), (1, 2)), (decode_value_order(dim), (0, 1, 2))):
        assert sorted(order.tolist()) == list(range(dim))
        # Coordinate j*G + g: the 8 fields of group g differ only in register bits of the position.
        g_count = dim // 8
        pos_of = {c: p for p, c in enumerate(order.tolist())}
        for g in range(g_count):
            lanes = {tuple((pos_of[j * g_count + g] >> b) & 1 for b in lane_bits) for j in range(8)}
            assert len(lanes) == 1, (dim, g)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_words_equal_the_kernels_own(bits):
    from turboquant_core.codebooks import codebook_tensors

    if torch.cuda.is_available():
        pytest.skip("interpreter check (the helpers run on CPU tensors)")

    table = codebook_tensors(bits, 128, "cpu")[0].to(torch.float16)
    _, cb = _run_jit_helpers(torch.zeros(4, dtype=torch.int32), table, bits)
    want = [w - (1 << 32) if w >= 1 << 31 else w for w in cb]
    assert list(codebook_permute_words(table)) == want


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` (default mode): output byte k = byte (sel >> 4k) & 7 of {b, a}, sign-replicated when bit 3."""
    src = (a | (b << 32)).to_bytes(8, "little")
    out = 0
    for k in range(4):
        s = (sel >> (4 * k)) & 0xF
        byte = src[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _run_prmt_asm(asm: str, inputs: list[int], n_out: int) -> list[int]:
    """Emulate a ``{ .reg ...; prmt.b32 ...; }`` block of ``plane_transpose_asm``: $0..$(n_out-1) outputs, then
    the inputs."""
    regs = {f"${n_out + i}": v for i, v in enumerate(inputs)}
    for stmt in re.findall(r"prmt\.b32 ([^;]+);", asm):
        d, a, b, sel = (x.strip() for x in stmt.split(","))
        regs[d] = _prmt(regs[a], regs[b], int(sel, 16))
    return [regs[f"${i}"] for i in range(n_out)]


@pytest.mark.parametrize("b", [2, 3, 4])
@pytest.mark.parametrize("gr", [1, 2, 4])
def test_plane_transpose_asm_makes_words_from_planes(b, gr):
    """Byte k of word g = byte g of plane k (the bytes a b-bit word uses; planes hold gr groups' bytes)."""
    rng = random.Random(b * 10 + gr)
    asm = plane_transpose_asm.fn(b, gr)  # the constexpr function's Python body
    for _ in range(50):
        planes = [rng.getrandbits(8 * gr) for _ in range(b)]
        words = _run_prmt_asm(asm, planes, gr)
        for g, w in enumerate(words):
            for k in range(b):
                assert (w >> (8 * k)) & 0xFF == (planes[k] >> (8 * g)) & 0xFF, (b, gr, g, k)


def test_decode_path_applies_only_where_it_serves():
    lay = paged_layout("turboquant_k3v4_nc", 128, 16)
    kw = dict(max_query_len=1, causal=True, sliding_window=None)
    assert not decode_path_applies(lay, 4, torch.device("cpu"), **kw)  # no GPU
    served = [n for n in format_names()
              if all(c.has_codebook and c.bits in DECODE_BITS for c in (get_format(n).key, get_format(n).value))]
    assert served == ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k4v3_nc",
                      "turboquant_k3v2_nc", "turboquant_2bit_nc"]


PROBE = r'''
import sys
import torch
from tests.ops import sm90_probe


def on_launch(launch):
    res = launch.compile()
    print(res["kernel"], res["stack"], res["shared"], flush=True)


sm90_probe.install(on_launch)

from turboquant_core.ops import paged_decode
from turboquant_core.ops.page_layout import _cache_views, allocate_kv_cache, paged_layout
from turboquant_core.ops.paged_attention import TQAttentionPlan

fmt, d, hq, hkv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lay = paged_layout(fmt, head_dim=d, block_size=16)
cache = allocate_kv_cache(4, hkv, lay)
plan = TQAttentionPlan(lay, hq, hkv, "cpu", workspace_bytes=8 << 20)
plan.decode_words = (paged_decode.codebook_permute_words(plan.k_tables.cent_f16[0]),
                     paged_decode.codebook_permute_words(plan.v_tables.cent_f16[0]))
table = torch.zeros(4, 8, dtype=torch.int32)
plan.plan(table, torch.arange(5, dtype=torch.int32), torch.full((4,), 100, dtype=torch.int32), num_tokens=4,
          max_query_len=1, max_seq_len=100, causal=True)
plan.decode_splits = 2
q = torch.zeros(4, hq, d, dtype=torch.bfloat16)
u8, f16 = _cache_views(cache, lay, hkv)
paged_decode.run_decode(plan, q, u8, f16, torch.empty_like(q), None)
'''


@pytest.mark.parametrize("d,hq,tokens", [(128, 32, 2), (64, 9, 3)])
@pytest.mark.parametrize("num_splits", [1, 3, 5, 8, 13, 16, 17, 40, 64])
@pytest.mark.parametrize("write_lse", [False, True])
def test_split_merge_matches_its_reference(d, hq, tokens, num_splits, write_lse, device):
    """``merge_unrotate`` (on the CPU, Triton's interpreter runs its kernel): the splits' partial outputs weighted
    by their log2-sum-exps, the rotation back and the log-sum-exp, against float64 torch. Empty splits (-inf) hold
    NaN in the workspace, as a split the kernel never wrote may; rows whose splits are all empty come out zero,
    -inf. 5 and 8 splits take two chunks of the kernel's 4, so the running maximum's rescaling is tested too; from 9
    splits the merge runs in two levels (groups of 4, then the groups, read at 4 times the split stride), and from
    17 in groups of 8."""
    g = torch.Generator().manual_seed(num_splits * 100 + d)
    rows = tokens * hq
    part_o = torch.randn(num_splits, tokens, hq, d, generator=g)
    part_l = torch.randn(num_splits, tokens, hq, generator=g) * 4
    empty = torch.rand(num_splits, tokens, hq, generator=g) < 0.3
    empty[:, 0, 1] = True  # a row with no split at all
    part_l[empty] = float("-inf")
    part_o[empty] = float("nan")
    rot = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].contiguous()
    hi = rot.to(torch.float16)
    lo = (rot - hi.double()).to(torch.float16)
    out = torch.empty(tokens, hq, d, dtype=torch.bfloat16, device=device)
    lse = torch.empty(hq, tokens, device=device) if write_lse else None
    # (copies: a merge of many splits writes its first level into the workspace)
    paged_decode.merge_unrotate(part_o.clone().to(device), part_l.clone().to(device), (hi.to(device), lo.to(device)),
                                out, lse, rows, num_splits, 1.5, hq, d, False)
    out, lse = out.cpu(), (lse.cpu() if write_lse else None)

    w = torch.exp2(part_l.double() - part_l.double().amax(0).clamp_min(-1e30))
    w = torch.where(empty, 0.0, w)
    total = w.sum(0)
    y = torch.where(empty[..., None], 0.0, part_o.double() * w[..., None]).sum(0) / total.clamp_min(1e-300)[..., None]
    want = (y @ rot) * 1.5
    assert torch.equal(out[0, 1].float(), torch.zeros(d))
    torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), rtol=2e-2, atol=2e-2)
    assert (out.double() - want).abs().max() <= 0.008 * want.abs().max()
    if write_lse:
        want_lse = torch.where(total > 0, (part_l.double().amax(0) + torch.log2(total)) * 0.6931471805599453,
                               float("-inf")).T
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,page,seq_lens", [(32, 8, 16, (700, 1, 16, 17)), (9, 3, 16, (64, 129)),
                                                   (64, 8, 16, (300,)), (28, 4, 32, (1100, 33))])
def test_center_logits_match_their_reference(hq, hkv, page, seq_lens, device):
    """``center_logits`` (on the CPU, Triton's interpreter runs its kernel): each request's query logits for every
    16-token group of its sequence, in its KV head's columns, against float64 torch from the fp16 operands
    ``center_query_operands`` makes of the same queries and sums; groups past the table's end reuse its last row
    (700 tokens = 44 pages of a 32-row table), head blocks are masked past the heads (9 of 16) or split (64 in two),
    32-token pages give two groups each, and nothing is written past a request's groups or a KV head's query heads
    (groups of 3 and 7 of 8 columns). The launch also writes the rotated queries."""
    from turboquant_core.ops.key_centering import key_centering_tables
    from turboquant_core.ops.kv_store import new_center_sums
    from turboquant_core.ops.page_layout import paged_layout
    from turboquant_core.ops.paged_attention import TQAttentionPlan

    g = torch.Generator().manual_seed(hq)
    d = 128
    centering = key_centering_tables(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), d, page,
                                     32 * page, device=device)
    reqs, gq = len(seq_lens), hq // hkv
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32)
    plan = TQAttentionPlan(paged_layout("turboquant_k3v4_nc", d, page), hq, hkv, device, workspace_bytes=1 << 20)
    plan.plan(torch.zeros(reqs, 64, dtype=torch.int32, device=device), qsl.to(device), lens.to(device),
              num_tokens=reqs, max_query_len=1, max_seq_len=max(seq_lens))
    q = torch.randn(reqs, hq, d, generator=g).to(torch.bfloat16).to(device)
    sums = new_center_sums(reqs, hkv, centering, "cpu")
    sums.copy_(torch.randn(sums.shape, generator=g) * 3)
    sums = sums.to(device)
    groups = -(-max(seq_lens) // 16) + 3
    logits = torch.full((reqs, hkv, groups, 8), float("nan"), device=device)
    # the same launch rotates the queries, as tq_rotate_queries_kernel does
    rot = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].contiguous()
    hi = rot.to(torch.float16)
    lo = (rot - hi.double()).to(torch.float16)
    qrot = torch.full((reqs, hq, d), float("nan"), dtype=torch.float16, device=device)
    paged_decode.center_logits(plan, q, centering, sums, logits, rotate=((hi.to(device), lo.to(device)), qrot, 0.7,
                                                                         False))
    want_qrot = q.double().cpu() @ rot.T * 0.7
    torch.testing.assert_close(qrot.cpu().double(), want_qrot, rtol=2e-3, atol=2e-3 * want_qrot.abs().max().item())
    cwz = torch.empty(reqs, hq, 2, d, dtype=torch.float16, device=device)
    cscale = torch.empty(reqs, hq, device=device)
    paged_decode.center_query_operands(plan, q, cwz, cscale, centering, sums)
    want = paged_decode.center_logits_ref(cwz.cpu(), cscale.cpu(), qsl, lens, centering, page, hkv, groups)
    valid = ((torch.arange(groups)[None, :] < -(-lens[:, None] // 16))[:, None, :, None]
             & (torch.arange(8) < gq)).expand(-1, hkv, -1, -1)
    got = logits.cpu().double()
    assert got[~valid].isnan().all(), "groups past a request's sequence or columns past its heads were written"
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("fmt,d,hq,hkv", [
    ("turboquant_k3v4_nc", 128, 32, 8),  # Qwen3-8B heads
    ("turboquant_4bit_nc", 64, 9, 3),  # SmolLM2 heads
    ("turboquant_2bit_nc", 128, 4, 1),
    ("turboquant_k4v3_nc", 128, 64, 4),  # a group of 16
])
def test_decode_kernels_compile_for_sm90_without_spills_or_shared_memory(fmt, d, hq, hkv):
    """The register-tile layouts convert trivially (``assert_trivial`` fails the compile otherwise); the
    attention kernel neither spills nor touches shared memory, and the helpers do not spill. Every launch's
    constexprs serialize as Triton's compile hooks serialize them (a layout object passed as an argument did
    not: the NIAH run of the quality suite failed on it)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PROBE, fmt, str(d), str(hq), str(hkv)], env=env, capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    res = {name: (int(stack), int(shared)) for name, stack, shared in
           (line.split() for line in p.stdout.strip().splitlines())}
    assert set(res) == {"tq_rotate_queries_kernel", "tq_paged_decode_kernel", "tq_merge_unrotate_kernel"}
    assert res["tq_paged_decode_kernel"] == (0, 0)
    assert all(stack == 0 for stack, _ in res.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc", "turboquant_2bit_nc",
                                  "turboquant_k4v3_nc", "turboquant_k3v2_nc"])
@pytest.mark.parametrize("d,group", [(64, 3), (128, 4), (128, 8), (64, 1), (128, 16)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_register_tile_decode_matches_reference_and_triton(name, d, group, splits):
    # Contexts of 1, a partial tile, a partial page past whole tiles, and several tiles.
    _check_register_tile(*_paged_batch(name, d, 2, group, [1, 37, 64, 213], [1, 1, 1, 1], "cuda", seed=3),
                         max_query_len=1, splits=splits)


def _check_register_tile(lay, cache, bt, qsl, sl, q, *, max_query_len, splits):
    """The register-tile kernel serves the batch and matches the float64 reference, and the Triton kernel."""
    plan = TQAttentionPlan(lay, q.shape[1], cache.shape[1], "cuda", config=REGISTER_TILE)
    plan.plan(bt, qsl, sl, num_tokens=q.shape[0], max_query_len=max_query_len, max_seq_len=int(sl.max()),
              num_splits=splits)
    assert plan.decode_splits > 0
    out, lse = plan.run(q, cache, return_lse=True)
    ref_out, ref_lse = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    _check(out, lse, ref_out, ref_lse)
    plan.decode_splits = 0
    tri_out, _ = plan.run(q, cache, return_lse=True)
    torch.testing.assert_close(out.float(), tri_out.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc", "turboquant_2bit_nc"])
@pytest.mark.parametrize("d,group,ql", [(64, 3, 4), (128, 4, 4), (128, 8, 2), (128, 1, 4), (64, 4, 3)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_register_tile_verification_matches_reference_and_triton(name, d, group, ql, splits):
    """Speculative verification as decode: each request's last 1..ql tokens, causal among themselves (a column
    per (query token, head)), contexts from as short as the queries to several tiles, splits that end inside
    the queries' own tokens."""
    q_lens = [ql, 1, ql - 1, ql, 2]
    _check_register_tile(*_paged_batch(name, d, 2, group, [ql, 37, 64, 213, 17], q_lens, "cuda", seed=4),
                         max_query_len=ql, splits=splits)


def test_decode_path_serves_verification_up_to_16_columns(monkeypatch):
    monkeypatch.setattr(paged_decode, "_gluon_runs", lambda device: True)  # as on a GPU
    lay = paged_layout("turboquant_k3v4_nc", 128, 16)
    kw = dict(causal=True, sliding_window=None)
    cuda = torch.device("cuda")
    assert decode_path_applies(lay, 4, cuda, max_query_len=4, **kw)
    assert decode_path_applies(lay, 3, cuda, max_query_len=5, **kw)
    assert decode_path_applies(lay, 16, cuda, max_query_len=1, **kw)
    assert not decode_path_applies(lay, 4, cuda, max_query_len=5, **kw)  # 20 columns
    assert not decode_path_applies(lay, 4, cuda, max_query_len=4, causal=False, sliding_window=None)
    assert not decode_path_applies(lay, 4, cuda, max_query_len=4, causal=True, sliding_window=64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", "turboquant_4bit_nc"])
def test_decode_output_barely_depends_on_the_split_count(name):
    """The split count follows the batch (``num_decode_splits``), so a request's output must not follow it: with
    whole-number running maxima the tiles' fp16 probabilities are the same whatever the split, and fp16 outputs
    at 1, 2, 5 and 11 splits agree but for rare last-bit differences of the fp32 sums (measured with float
    maxima and without: benchmarks/results/2026-11-25-h100-qwen3-8b-same-machine/)."""
    lay, cache, bt, qsl, sl, q = _paged_batch(name, 128, 2, 4, [700, 1500, 2900], [1, 1, 1], "cuda", seed=5)
    q = q.half()
    outs = []
    for splits in (1, 2, 5, 11):
        plan = TQAttentionPlan(lay, q.shape[1], 2, "cuda", config=REGISTER_TILE)
        plan.plan(bt, qsl, sl, num_tokens=q.shape[0], max_query_len=1, max_seq_len=2900, num_splits=splits)
        assert plan.decode_splits == splits
        outs.append(plan.run(q, cache))
    for o in outs[1:]:
        differ = (o != outs[0]).float().mean().item()
        assert differ < 0.04, f"{differ:.2%} of the outputs differ between split counts"
        torch.testing.assert_close(o, outs[0], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx,q_lens,later", [([5, 300], [1, 1], None), ([9, 300, 60], [4, 4, 4], [7, 299, 58])],
                         ids=["decode", "verification"])
def test_register_tile_in_a_cuda_graph(ctx, q_lens, later):
    """A decode batch and a uniform verification batch (4 queries per request), each captured once and replayed;
    the verification batch after its lengths changed in place (as vLLM's full CUDA graphs replay)."""
    lay, cache, bt, qsl, sl, q = _paged_batch("turboquant_k3v4_nc", 128, 2, 4, ctx, q_lens, "cuda")
    plan = TQAttentionPlan(lay, q.shape[1], 2, "cuda", config=REGISTER_TILE)
    plan.plan(bt, qsl, sl, num_tokens=q.shape[0], max_query_len=max(q_lens), max_seq_len=4096)
    out = torch.empty_like(q)
    plan.run(q, cache, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, cache, out=out)
    if later is not None:
        sl.copy_(torch.tensor(later, dtype=torch.int32))
    out.zero_()
    g.replay()
    ref_out, _ = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=1e-2)

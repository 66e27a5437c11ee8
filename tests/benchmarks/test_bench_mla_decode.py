# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_mla_decode.py without a GPU: its cases, and the batch it times (stored pages that decode back to
attention on the stored latents)."""

import pytest
import torch

from benchmarks import bench_mla_decode
from turboquant_core.ops.mla import mla_decode_attention
from turboquant_core.ops.mla_reference import mla_decode_attention_ref


def test_cases_parse_and_bad_ones_are_refused_with_the_expected_form():
    assert bench_mla_decode.parse_case("64X1024:2,4,8") == (64, 1024, [2, 4, 8])
    assert bench_mla_decode.parse_case("8x32768") == (8, 32768, [])
    with pytest.raises(SystemExit, match="expected BATCHxCONTEXT"):
        bench_mla_decode.parse_case("1024:2")


def test_launches_parse_and_bad_ones_are_refused_with_the_expected_form():
    from turboquant_core.ops.mla import MLADecodeLaunch

    spec = bench_mla_decode.LaunchSpec
    assert bench_mla_decode.parse_launch("auto") == spec()
    assert bench_mla_decode.parse_launch("wgmma") == spec("wgmma")
    assert bench_mla_decode.parse_launch("wgmma:2") == spec("wgmma", (("MLA_WGMMA_STAGES", 2),))
    assert bench_mla_decode.parse_launch("mma:4:2") == spec("mma", (("MLA_MMA_WARPS", 4), ("MLA_MMA_DEPTH", 2),
                                                                    ("MLA_MMA_MAXNREG", None)))
    assert bench_mla_decode.parse_launch("mma:4:2:168").settings[2] == ("MLA_MMA_MAXNREG", 168)
    assert bench_mla_decode.parse_launch("16,32,4,1") == spec("triton", triton=MLADecodeLaunch(16, 32, 4, 1))
    for bad in ("16,32", "mma:4", "wgmma:2:8", "wgmma:x", "flash"):
        with pytest.raises(SystemExit, match="expected auto, wgmma"):
            bench_mla_decode.parse_launch(bad)


def test_a_launch_spec_applies_its_settings_for_the_timing_only():
    from turboquant_core.ops import mla as mla_ops
    from turboquant_core.ops.mla_layout import mla_paged_layout

    lay = mla_paged_layout("turboquant_k3v4_nc", 16)
    shipped = mla_ops.MLA_MMA_WARPS, mla_ops.MLA_MMA_DEPTH, mla_ops.MLA_WGMMA_STAGES
    spec = bench_mla_decode.parse_launch("mma:8:3:168")
    with bench_mla_decode.applied(spec):
        assert (mla_ops.MLA_MMA_WARPS, mla_ops.MLA_MMA_DEPTH, mla_ops.MLA_MMA_MAXNREG) == (8, 3, 168)
        assert bench_mla_decode.kernel_name(lay, "cpu", spec) == "register-tile 8 warps, 3 ahead, at most 168 registers"
    with bench_mla_decode.applied(bench_mla_decode.parse_launch("wgmma:2")):
        assert bench_mla_decode.kernel_name(lay, "cpu", bench_mla_decode.parse_launch("wgmma:2")) == (
            "warpgroup MMA, 2 stages")
    assert (mla_ops.MLA_MMA_WARPS, mla_ops.MLA_MMA_DEPTH, mla_ops.MLA_WGMMA_STAGES) == shipped
    assert mla_ops.MLA_MMA_MAXNREG is None
    # auto on the CPU: the Triton kernel, at its shipped launch shape
    assert bench_mla_decode.kernel_name(lay, "cpu", bench_mla_decode.LaunchSpec()) == "triton 16,32,4,1"


def test_the_timed_batch_is_a_real_one():
    """The pages hold every request's tokens (the reference reads them through the block table), and the timed call
    (rotated queries, as the vLLM backend runs it) matches the reference, which takes unrotated ones."""
    b = bench_mla_decode.build("turboquant_k3v4_nc", batch=2, context=20, heads=4, device="cpu")
    lay, cache, bt, sl, q, q_pe = b["layout"], b["cache"], b["block_table"], b["seq_lens"], b["q"], b["q_pe"]
    assert bt.shape == (2, 2) and len(set(bt.flatten().tolist())) == 4 and 0 not in bt.flatten().tolist()
    out, lse = mla_decode_attention(q, q_pe, cache, lay, bt, sl, 0.1, num_splits=2, rotated=True)
    from turboquant_core.ops.mla_layout import mla_tables

    t = mla_tables(lay, "cpu")
    rows = t.attn_rows
    q_plain = q.float() @ rows  # the queries the rotated ones came from (rows is orthogonal)
    ref, ref_lse = mla_decode_attention_ref(q_plain, q_pe.float(), cache, lay, bt, sl, 0.1)
    got = out.float() @ rows  # back from the rotated domain
    assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 2e-2
    torch.testing.assert_close(lse, ref_lse, rtol=5e-3, atol=2e-2)

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

    assert bench_mla_decode.parse_launch("auto") is None
    assert bench_mla_decode.parse_launch("mma:4:2") == (4, 2, None)
    assert bench_mla_decode.parse_launch("mma:4:2:168") == (4, 2, 168)
    assert bench_mla_decode.parse_launch("16,32,4,1") == MLADecodeLaunch(16, 32, 4, 1)
    with pytest.raises(SystemExit, match="expected auto"):
        bench_mla_decode.parse_launch("16,32")


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

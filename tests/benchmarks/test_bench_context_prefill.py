# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_context_prefill.py without a GPU: its cases, and the workspace bound it shares with the backend."""

import pytest

from benchmarks import bench_context_prefill


def test_cases_parse_and_bad_ones_are_refused_with_the_expected_form():
    assert bench_context_prefill.parse_case("4x8192X512") == (4, 8192, 512)
    with pytest.raises(SystemExit, match="expected REQUESTSxCONTEXTxCHUNK"):
        bench_context_prefill.parse_case("8192x512")
    with pytest.raises(SystemExit, match="at most 65536 rows"):
        bench_context_prefill.parse_case("8x8192x1024")


def test_row_bound_is_the_backends():
    tq = pytest.importorskip("turboquant_core.vllm.backend", reason="needs the patched vLLM")
    assert bench_context_prefill.MAX_ROWS == tq.TQAttentionMetadataBuilder.CONTEXT_GATHER_MAX_ROWS

# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_linear.py without a GPU: variant parsing (unknown knobs named with the valid ones), the shapes
of a Qwen3-8B decoder layer, and the table it writes (speed-up against bf16 per row count and shape)."""

import pytest

from benchmarks import bench_linear
from turboquant_core.ops import linear as linear_ops


def test_variants_name_launcher_constants_and_unknown_knobs_are_refused():
    assert bench_linear.parse_variant("mma_block_o=16, mma_programs_per_sm=8") == {"mma_block_o": 16,
                                                                                 "mma_programs_per_sm": 8}
    assert all(hasattr(linear_ops, const) for const in bench_linear.KNOBS.values())
    with pytest.raises(SystemExit, match="unknown knob 'block_o'; valid: mma_max_rows"):
        bench_linear.parse_variant("block_o=32")


def test_layer_shapes_are_qwen3_8b():
    assert bench_linear.SHAPES == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                                   "down": (4096, 12288)}


def test_table_gives_the_speed_up_over_bf16_and_the_failed_variants():
    rows = [dict(config="bf16", rows=1, shape="layer", us_per_layer=110.0, weight_gbps=3500.0),
            dict(config="tq4", rows=1, shape="layer", us_per_layer=55.0, weight_gbps=1800.0, variant={}),
            dict(config="tq4", rows=1, shape="layer", us_per_layer=220.0, weight_gbps=450.0,
                 variant={"mma_block_o": 16})]
    res = dict(device="GPU", date="2026-11-25", command="bench", copy_gbps=4000.0, rows=rows,
               failed=[dict(config="tq3", variant={"mma_block_o": 64}, error="OutOfResources")])
    md = bench_linear.markdown(res)
    assert "| tq4 | shipped | 1 | layer | 55.0 | 2.00 | 1800 | 45 |" in md
    assert "| tq4 | mma_block_o=16 | 1 | layer | 220.0 | 0.50 | 450 | 11 |" in md
    assert "failed: tq3 {'mma_block_o': 64}: OutOfResources" in md


def test_breakdown_rows_show_the_time_no_kernel_runs():
    rows = [dict(config="tq4", rows=1, shape="o", us_per_layer=15.6, weight_gbps=560.0, variant={},
                 kernels_us={"tq_linear_mma_kernel": 11.0, "tq_rotate_fp16_kernel": 1.5}, kernel_sum_us=12.5),
            dict(config="bf16", rows=1, shape="o", us_per_layer=14.6, weight_gbps=2300.0)]
    res = dict(device="GPU", date="2026-11-27", command="bench --breakdown", copy_gbps=3000.0, rows=rows)
    md = bench_linear.markdown(res)
    assert "| tq4 | shipped | 1 | o | 15.6 | 12.5 | 3.1 | tq_linear_mma_kernel 11.0; tq_rotate_fp16_kernel 1.5 |" in md
    assert md.count("| bf16 |") == 1  # a row without a breakdown stays out of the second table


def test_layer_weights_have_the_format_tables_bytes():
    bf16 = bench_linear.layer_weights("bf16", 1, "cpu")
    tq4 = bench_linear.layer_weights("tq4", 1, "cpu")
    ratio = sum(bench_linear.nbytes(w[0]) for w in tq4.values()) / sum(bench_linear.nbytes(w[0]) for w in bf16.values())
    assert ratio == pytest.approx((16 * 4 + 2) / (2 * 128))  # 4-bit indices and one fp16 scale per 128 weights

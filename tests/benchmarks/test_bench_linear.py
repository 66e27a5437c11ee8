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

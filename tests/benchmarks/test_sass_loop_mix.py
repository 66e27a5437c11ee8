# SPDX-License-Identifier: Apache-2.0
"""benchmarks/sass_loop_mix.py without a GPU: the loop it finds in a SASS listing and how it counts it."""

from benchmarks.sass_loop_mix import loop_mix

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   PRMT R2, R3, 0x5140, R4 ;
        /*0020*/                   LOP3.LUT R5, R2, 0x7, RZ, 0xc0, !PT ;
        /*0030*/                   PRMT R6, R5, 0x7362, R4 ;
        /*0040*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0050*/              @!P0 BRA 0x10 ;
        /*0060*/                   IMAD.MOV.U32 R7, RZ, RZ, R6 ;
        /*0070*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*0080*/                   BRA 0x70 ;
        /*0090*/                   EXIT ;
"""


def test_the_longest_backward_branch_is_the_loop_and_its_ops_are_counted_by_pipe():
    mix = loop_mix(SASS)
    assert mix["instructions"] == 5  # 0x10 .. 0x50: the later two-instruction loop is shorter
    assert mix["ops"] == {"PRMT": 2, "LOP3": 1, "HMMA": 1, "BRA": 1}
    assert mix["pipes"] == {"alu": 3, "tensor": 1, "control": 1}
    assert loop_mix("        /*0000*/                   EXIT ;") == dict(instructions=0, ops={}, pipes={})


def test_an_unknown_weight_format_is_refused_with_the_valid_ones(tmp_path):
    import pytest

    from benchmarks.sass_loop_mix import WEIGHT_FORMATS, main
    from turboquant_core.formats import WEIGHT_FORMATS as TABLE

    assert WEIGHT_FORMATS == tuple(TABLE)  # the script's copy of the format table's names
    with pytest.raises(SystemExit, match="unknown weight format 'tq5'; valid: tq4, tq3"):
        main(["--linear", "tq5", "--out", str(tmp_path / "mix.json")])

# SPDX-License-Identifier: Apache-2.0
"""benchmarks/sass_loop_mix.py without a GPU: the loop it finds in a SASS listing and how it counts it."""

import pytest

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
    assert mix["copies"] == dict(register=0, from_uniform=0)
    assert loop_mix("        /*0000*/                   EXIT ;") == dict(instructions=0, ops={}, pipes={},
                                                                    copies=dict(register=0, from_uniform=0),
                                                                    load_leads=[])


def test_load_leads_count_to_the_first_read_round_the_loop():
    """A load read two instructions later, and a 16-byte load whose third register is read at the top of the next
    iteration; a store's address register counts as a read, a write of the loaded register does not end the count."""
    body = """
        /*0000*/                   PRMT R9, R6, 0x5140, R4 ;
        /*0010*/                   LDG.E R2, desc[UR4][R10.64] ;
        /*0020*/                   IMAD.MOV.U32 R3, RZ, RZ, 0x1 ;
        /*0030*/                   FADD R3, R2, R3 ;
        /*0040*/              @!P0 LDG.E.128 R4, desc[UR4][R12.64] ;
        /*0050*/                   MOV R7, 0x1 ;
        /*0060*/                   STG.E desc[UR4][R2.64], R3 ;
        /*0070*/                   BRA 0x0 ;
"""
    assert loop_mix(body)["load_leads"] == [2, 4]


def test_copies_between_registers_and_out_of_uniform_ones_are_counted():
    """Moves that place an operand (register to register) and those that rematerialize a kernel argument out of a
    uniform register; loads of constants, shifts written as multiplies and immediates are not copies."""
    body = """
        /*0000*/                   IMAD.MOV.U32 R62, RZ, RZ, R46 ;
        /*0010*/                   IMAD.MOV.U32 R16, RZ, RZ, R96.reuse ;
        /*0020*/                   MOV R3, R4 ;
        /*0030*/                   IMAD.U32 R62, RZ, RZ, UR4 ;
        /*0040*/                   MOV R3, UR5 ;
        /*0050*/                   MOV R1, c[0x0][0x28] ;
        /*0060*/                   IMAD.U32 R5, R6, 0x10000, RZ ;
        /*0070*/                   IMAD.MOV.U32 R5, RZ, RZ, 0x1 ;
        /*0080*/                   BRA 0x0 ;
"""
    assert loop_mix(body)["copies"] == dict(register=3, from_uniform=2)


def test_an_unknown_weight_format_is_refused_with_the_valid_ones(tmp_path):
    from benchmarks.sass_loop_mix import WEIGHT_FORMATS, main
    from turboquant_core.formats import WEIGHT_FORMATS as TABLE

    assert WEIGHT_FORMATS == tuple(TABLE)  # the script's copy of the format table's names
    with pytest.raises(SystemExit, match="unknown weight format 'tq5'; valid: tq4, tq3"):
        main(["--linear", "tq5", "--out", str(tmp_path / "mix.json")])


@pytest.mark.slow
def test_mla_mode_reads_the_warpgroup_mma_decode_tile_loop(tmp_path):
    """``--mla``: the MLA decode kernel Hopper serves, compiled for sm_90 from the launcher's own launch, its tile
    loop counted (it holds the warpgroup MMAs), with its registers and spills."""
    import json

    from benchmarks.sass_loop_mix import main

    out = tmp_path / "mix.json"
    assert main(["--mla", "turboquant_k3v4_nc", "--out", str(out)]) == 0
    (v,) = json.loads(out.read_text())["variants"]
    assert v["kernel"] == "tq_mla_decode_wgmma_kernel" and v["spill_bytes"] == 0 and v["registers"] <= 255
    assert v["ops"]["HGMMA"] > 0 and v["instructions"] > 500

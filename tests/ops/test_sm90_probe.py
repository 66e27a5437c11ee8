# SPDX-License-Identifier: Apache-2.0
"""The sm_90 probe's SASS check: writes to the A registers of a warpgroup MMA in flight."""

from tests.ops.sm90_probe import wgmma_register_hazards


def _loop(wait_keeps: int, second_operand: bool = False) -> str:
    """A loop that decodes an operand, issues its MMA and waits until ``wait_keeps`` groups are left in flight;
    with ``second_operand``, two groups per iteration in two register sets, the way SASS lists them."""
    body = ["        /*0100*/                   PRMT R56, R4, 0x9d8c, R59 ;",
            "        /*0110*/                   WARPGROUP.ARRIVE ;",
            "        /*0120*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8], R24, gsb0 ;",
            f"        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, {wait_keeps:#x} ;"]
    if second_operand:
        body += ["        /*0140*/                   LDS.128 R60, [R2] ;",
                 "        /*0150*/                   WARPGROUP.ARRIVE ;",
                 "        /*0160*/                   HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR8], R24, gsb0 ;",
                 f"        /*0170*/                   WARPGROUP.DEPBAR.LE gsb0, {wait_keeps:#x} ;"]
    body.append(f"        /*{0x140 + 0x40 * second_operand:04x}*/              @P0 BRA 0x100 ;")
    return "\n".join(body)


def test_a_loop_that_decodes_into_the_registers_of_a_product_in_flight_is_found():
    found = wgmma_register_hazards(_loop(wait_keeps=1))
    assert found == ["0x0100 PRMT R56, R4, 0x9d8c, R59"]


def test_waiting_for_every_product_or_two_operands_is_clean():
    assert wgmma_register_hazards(_loop(wait_keeps=0)) == []
    assert wgmma_register_hazards(_loop(wait_keeps=1, second_operand=True)) == []
    # a 16-byte load into the other set's registers while that set's product runs
    assert wgmma_register_hazards(_loop(wait_keeps=2, second_operand=True)) == ["0x0100 PRMT R56, R4, 0x9d8c, R59",
                                                                               "0x0140 LDS.128 R60, [R2]"]

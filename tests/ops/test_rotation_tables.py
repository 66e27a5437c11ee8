# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.ops.rotation_tables import codec_tables, encoder_levels


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [64, 128, None])
def test_encoder_levels_hold_half_index_and_square(bits, dim):
    cent, _ = codebook_tensors(bits, dim)
    lv = encoder_levels(cent)
    h = cent.numel() // 2
    assert lv.dtype == torch.int32 and lv.shape == (h,)
    assert torch.equal(lv & (h - 1), torch.arange(h, dtype=torch.int32))
    sq = cent[h:].double() ** 2
    assert torch.all((lv.view(torch.float32).double() - sq).abs() <= sq * 2.0**-20)


@pytest.mark.parametrize("dim,bits", [(64, 3), (128, 4), (256, 2.5), (96, 3)])
def test_bf16_rotation_rows_equal_the_fp16_ones_when_exact(dim, bits):
    t = codec_tables(dim, bits, 7)
    assert t.rot_bf16.dtype == torch.bfloat16 and t.rot_bf16.shape == t.rot_hi.shape
    if t.exact_rot:  # +-1 and 0 entries: the same values in both types
        assert torch.equal(t.rot_bf16.float(), t.rot_hi.float())
        assert set(t.rot_hi.unique().tolist()) <= {-1.0, 0.0, 1.0}

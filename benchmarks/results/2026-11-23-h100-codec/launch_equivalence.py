# SPDX-License-Identifier: Apache-2.0
"""Do other launch configurations of the dense codec write the same encoding as the default? (CUDA)

One JSON line per (bits, rows per program, warps): codebook indices that differ from the default
launch, the largest relative change of the fp16 scale, and the largest change of the decoded values.
"""

import json

import torch

from turboquant_core.ops.codec import decode, encode, unpack_segments

n, d = 200000, 128
x = torch.randn(n, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).to(torch.bfloat16)
for b in (3, 4):
    p0, s0 = encode(x, b, 0)
    i0 = unpack_segments(p0, d, b)
    y0 = decode(p0, s0, d, b, 0, torch.float32)
    for bn, nw in ((16, 2), (32, 2), (32, 4), (64, 2), (64, 8), (128, 4), (128, 2)):
        p, s = encode(x, b, 0, block_rows=bn, num_warps=nw)
        i = unpack_segments(p, d, b)
        y = decode(p0, s0, d, b, 0, torch.float32, block_rows=bn, num_warps=nw)
        print(json.dumps({
            "bits": b, "rows": bn, "warps": nw,
            "idx_diff_coords": int((i != i0).sum()), "of": n * d,
            "max_idx_step": int((i.int() - i0.int()).abs().max()),
            "scale_max_rel": float(((s.float() - s0.float()).abs() / s0.float()).max()),
            "decode_max_abs": float((y - y0).abs().max()), "decode_ref_max": float(y0.abs().max()),
        }))

# SPDX-License-Identifier: Apache-2.0
"""Bytes of every encode launch configuration against the default one (1M bf16 vectors, d = 128)."""

import torch

from turboquant_core.ops.codec import encode

x = torch.randn(1000000, 128, device="cuda").to(torch.bfloat16)
for b in (2, 2.5, 3, 3.5, 4):
    p, s = encode(x, b, 0)
    for bn in (32, 64, 128):
        for nw in (4, 8):
            q, t = encode(x, b, 0, block_rows=bn, num_warps=nw)
            ds = ((t.float() - s.float()).abs() / s.float().clamp_min(1e-30)).max().item()
            print(f"bits {b} rows {bn} warps {nw}: bytes differing {(q != p).sum().item()}, "
                  f"scales differing {(t != s).sum().item()} (max rel {ds:.2e})")

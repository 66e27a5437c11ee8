# SPDX-License-Identifier: Apache-2.0
"""The 3-bit circular trellis code of this study, for the CPU simulation (numba; not a project dependency).

A packed 3-bit word holds fields b_0..b_7 of a group of 8 rotated coordinates; field j reconstructs to
TABLE[b_{j-1} * 8 + b_j] (b_{-1} = b_7, so the trellis of a word is a circle). ``encode_circles`` finds the best
word exactly: one Viterbi pass (8 states: the previous symbol) per value of b_7, the best of the 8 wins.
"""

from __future__ import annotations

import json
from pathlib import Path

import numba
import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def load_table(name: str = "sim-table.json") -> torch.Tensor:
    return torch.tensor(json.loads((HERE / name).read_text())["values"], dtype=torch.float64)


@numba.njit(cache=True)
def encode_circles(x, table):
    """x [N, 8] float64, table [64] (index prev * 8 + cur) -> packed symbols [N] (symbol j at bits 3j)."""
    n_rows = x.shape[0]
    out = np.zeros(n_rows, np.int64)
    back = np.zeros((8, 8), np.int8)
    cost = np.zeros(8)
    new = np.zeros(8)
    for n in range(n_rows):
        best = 1e30
        best_word = 0
        for s in range(8):
            for o in range(8):
                cost[o] = 1e30
            cost[s] = 0.0
            for j in range(8):
                xj = x[n, j]
                for b in range(8):
                    m = 1e30
                    a = 0
                    for o in range(8):
                        v = table[o * 8 + b]
                        c = cost[o] + (xj - v) * (xj - v)
                        if c < m:
                            m = c
                            a = o
                    new[b] = m
                    back[j, b] = a
                for b in range(8):
                    cost[b] = new[b]
            if cost[s] < best:
                best = cost[s]
                w = 0
                st = s
                for j in range(7, -1, -1):
                    w |= st << (3 * j)
                    st = back[j, st]
                best_word = w
        out[n] = best_word
    return out


def windows(packed: torch.Tensor) -> torch.Tensor:
    sym = torch.stack([(packed >> (3 * j)) & 7 for j in range(8)], dim=1)
    return torch.roll(sym, 1, 1) * 8 + sym


def quantize_dequantize(s: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Scaled rotated coordinates s [M, 8k] -> their reconstruction, groups of 8 consecutive coordinates."""
    m, d = s.shape
    packed = torch.from_numpy(encode_circles(s.reshape(-1, 8).double().numpy(), table.numpy()))
    return table[windows(packed)].reshape(m, d).to(s.dtype)

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Study: would float8 (e4m3) tensor-core operands keep decode attention's accuracy?

The register-tile decode kernel is bound by its ALU pipe turning packed fields into fp16 operands; e4m3 operands
would take one byte permute per four 3-bit values. This simulates, in plain torch on the CPU, the kernel's
arithmetic (rotated domain, log2 scores, running maxima rounded up to whole numbers, p * v_scale as the PV
operand) with fp16 operands as shipped and with e4m3 operands for the query, the key codebook, the
probabilities and the value codebook, one at a time and together, against float64 attention over the same
stored (quantized) K/V; the quantization error itself (against the unquantized K/V) is the yardstick.

    python benchmarks/study_fp8_operands.py --contexts 1024 32768 --out fp8-operands.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turboquant_core.codebooks import codebook_tensors  # noqa: E402
from turboquant_core.quantizer import MSEQuantizer  # noqa: E402
from turboquant_core.rotation import rotate  # noqa: E402

D, GQ = 128, 4
E4M3 = torch.float8_e4m3fn


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(E4M3).float()


def pow2_scale(amax: torch.Tensor, target: float = 224.0) -> torch.Tensor:
    """A power of two s with amax / s <= target (e4m3 operands scaled into range without rounding the scale)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / target)))


def best_codebook_scale(cent: torch.Tensor) -> float:
    """The factor a whose a * c_j round to e4m3 with the least worst relative error (searched over [8, 16))."""
    best, best_err = 1.0, float("inf")
    for a in torch.linspace(8.0, 16.0, 801).tolist():
        v = cent * a / cent.abs().max()
        err = ((e4m3(v) - v).abs() / v.abs()).max().item()
        if err < best_err:
            best, best_err = a / cent.abs().max().item(), err
    return best


def make_case(n: int, regime: str, gen: torch.Generator):
    """Keys with a mean offset and a few outlier channels (pre-rotation), values Gaussian, GQ queries that attend
    flatly ("flat": logits of std about 1) or to a few keys ("peaked": a query near 8 of the keys)."""
    k = torch.randn(n, D, generator=gen, dtype=torch.float64)
    k[:, :4] *= 6.0
    k += 0.5 * torch.randn(1, D, generator=gen, dtype=torch.float64)
    v = torch.randn(n, D, generator=gen, dtype=torch.float64) * (0.5 + torch.rand(n, 1, generator=gen))
    if regime == "flat":
        q = torch.randn(GQ, D, generator=gen, dtype=torch.float64) * 0.1
    else:
        pick = torch.randint(0, n, (GQ, 8), generator=gen)
        q = k[pick].mean(1) * 0.6 + 0.05 * torch.randn(GQ, D, generator=gen, dtype=torch.float64)
    return q, k, v


def attend(q, k, v, scale):
    s = (q @ k.T) * scale
    return torch.softmax(s, dim=-1) @ v


def kernel_attention(qr, kidx, ksc, vidx, vsc, kc, vc, scale, *, fp8: set[str], tile: int = 16):
    """The decode kernel's arithmetic in the rotated domain; ``fp8`` names the operands taken as e4m3."""
    log2e = 1.0 / math.log(2.0)
    qp = (qr * scale * log2e).float()
    if "q" in fp8:
        sq = pow2_scale(qp.abs().amax(dim=1, keepdim=True))
        q_op, q_back = e4m3(qp / sq), sq
    else:
        q_op, q_back = qp.half().float(), torch.ones(1, 1)
    if "k" in fp8:
        a = best_codebook_scale(kc)
        k_op, k_back = e4m3(kc[kidx] * a), 1.0 / a
    else:
        k_op, k_back = kc[kidx].half().float(), 1.0
    if "v" in fp8:
        b = best_codebook_scale(vc)
        v_op, v_back = e4m3(vc[vidx] * b), 1.0 / b
    else:
        v_op, v_back = vc[vidx].half().float(), 1.0
    n = kidx.shape[0]
    m = torch.full((qr.shape[0],), float("-inf"))
    acc = torch.zeros(qr.shape[0], qr.shape[1])
    lsum = torch.zeros(qr.shape[0])
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        s = (q_op @ k_op[t0:t1].T) * q_back * k_back * ksc[t0:t1][None, :]
        m_new = torch.maximum(m, torch.ceil(s.max(dim=1).values))
        p = torch.exp2(s - m_new[:, None])
        alpha = torch.exp2(m - m_new)
        lsum = lsum * alpha + p.sum(dim=1)
        acc = acc * alpha[:, None]
        pv = p * vsc[t0:t1][None, :]
        if "p" in fp8:
            sp = pow2_scale(pv.abs().amax(dim=1, keepdim=True))  # per tile and query column
            p_op = e4m3(pv / sp) * sp
        else:
            p_op = pv.half().float()
        acc = acc + (p_op @ v_op[t0:t1]) * v_back
        m = m_new
    return acc / lsum[:, None]


def run(contexts, regimes, seeds) -> list[dict]:
    kq, vq = MSEQuantizer(D, 3, seed=1), MSEQuantizer(D, 4, seed=2)
    kc, vc = codebook_tensors(3, D)[0], codebook_tensors(4, D)[0]
    variants = {"fp16 (shipped)": set(), "e4m3 q": {"q"}, "e4m3 k": {"k"}, "e4m3 p": {"p"}, "e4m3 v": {"v"},
                "e4m3 q+k": {"q", "k"}, "e4m3 p+v": {"p", "v"}, "e4m3 all": {"q", "k", "p", "v"}}
    rows = []
    for n in contexts:
        for regime in regimes:
            errs = {name: [] for name in ["quantization"] + list(variants)}
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(seed)
                q, k, v = make_case(n, regime, gen)
                scale = D ** -0.5
                exact = attend(q, k, v, scale)
                kqz, vqz = kq.quantize(k.float()), vq.quantize(v.float())
                k_hat, v_hat = kq.dequantize(kqz).double(), vq.dequantize(vqz).double()
                stored = attend(q, k_hat, v_hat, scale)
                errs["quantization"].append(((stored - exact).norm(dim=1) / exact.norm(dim=1)).mean().item())
                # Rotated domain: <q, k_hat> = scale_k <R q, c[idx]>; the output comes out rotated by V's rotation.
                qr = rotate(q.float(), 1)
                ref = rotate(stored.float(), 2).double()
                for name, fp8 in variants.items():
                    out = kernel_attention(qr, kqz.idx.long(), kqz.scale, vqz.idx.long(), vqz.scale, kc, vc, scale,
                                           fp8=fp8).double()
                    errs[name].append(((out - ref).norm(dim=1) / ref.norm(dim=1)).mean().item())
            row = dict(context=n, regime=regime, seeds=seeds, **{name: sum(e) / len(e) for name, e in errs.items()})
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 32768])
    ap.add_argument("--regimes", nargs="+", default=["flat", "peaked"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rows = run(args.contexts, args.regimes, args.seeds)
    args.out.write_text(json.dumps(dict(command="python benchmarks/study_fp8_operands.py "
                                        + " ".join(argv or sys.argv[1:]), rows=rows), indent=1))
    names = [k for k in rows[0] if k not in ("context", "regime", "seeds")]
    print("| context | regime | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['context']} | {r['regime']} | " + " | ".join(f"{100 * r[k]:.2f} %" for k in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

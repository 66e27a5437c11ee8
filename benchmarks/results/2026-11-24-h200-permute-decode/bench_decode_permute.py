#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Dense decode (``ops.codec.decode``, bf16 out) and the paged gather-dequant with codebook values by byte
permutes vs gathered per index, on the current GPU. 1M vectors of d = 128 (``tq bench``'s shape); the
gather-dequant on 64 requests x 1280 cached tokens, Qwen3-8B KV heads (8). Median ms of
``triton.testing.do_bench``, bytes moved against the measured copy bandwidth.

    python bench_decode_permute.py --out decode-permute.json
"""

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.bench_paged_attention import build_batch  # noqa: E402
from turboquant_core.bench import copy_bandwidth_gbs, index_bytes  # noqa: E402
from turboquant_core.ops.codec import decode, encode  # noqa: E402
from turboquant_core.ops.paged import tq_gather_dequant  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode-permute.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbs(dev)
    n, d = 1_000_000, 128
    x = torch.randn(n, d, device=dev).to(torch.bfloat16)
    rows = []
    for bits in (2, 3, 3.5, 4):
        packed, scale = encode(x, bits, 0)
        moved = n * d * 2 + n * (index_bytes(d, bits) + 2)
        for permute in (False, True):
            ms = triton.testing.do_bench(partial(decode, packed, scale, d, bits, 0, torch.bfloat16,
                                                 permute_lookup=permute), warmup=25, rep=200)
            rows.append(dict(op="dense decode", bits=bits, permute=permute, ms=ms,
                             fraction_of_copy=moved / (ms * 1e-3) / 1e9 / copy["gbs"]))
            print(json.dumps(rows[-1]), flush=True)
    for fmt in ("turboquant_k3v4_nc", "turboquant_4bit_nc"):
        b = build_batch(fmt, 64, 1280, hq=32, hkv=8, d=d, block_size=16, device="cuda", keep_dense=False)
        cu = torch.arange(0, 65 * 1280, 1280, dtype=torch.int32, device=dev)
        k = torch.empty(64 * 1280, 8, d, device=dev, dtype=torch.bfloat16)
        v = torch.empty_like(k)
        for permute in (False, True):
            ms = triton.testing.do_bench(partial(
                tq_gather_dequant, b["cache"], b["layout"], b["block_table"], b["seq_lens"], cu, k, v,
                max_seq_len=1280, permute_lookup=permute), warmup=25, rep=200)
            rows.append(dict(op="paged gather-dequant 64x1280", format=fmt, permute=permute, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              triton=triton.__version__, copy=copy, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Throughput of the fused encode / decode kernels against the device's copy bandwidth.

Encoding and decoding are memory-bound: per vector, encode reads d bf16 values and writes the
packed indices plus an fp16 scale; decode does the reverse. The useful yardstick is therefore
the bandwidth the same device reaches for a plain ``copy_`` of a large tensor, and the ratio
of the two says how close the kernels are to the hardware limit.

On CUDA the Triton kernels are timed with ``triton.testing.do_bench``. Without CUDA the plain
torch references are timed with a wall clock instead: those numbers only show that the command
works, they say nothing about serving speed.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
import warnings

import torch

from .quantizer import split_segments
from .rotation import check_head_dim

CODEC_BITS = (2, 2.5, 3, 3.5, 4)
DEFAULT_VECTORS_CUDA = 1_000_000
DEFAULT_VECTORS_CPU = 20_000
BF16_BYTES = 2
SCALE_BYTES = 2  # fp16 scale per vector


def parse_bits(text: str) -> list[float]:
    """'3,4' -> [3.0, 4.0]; every value must be a codec bit width."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            b = float(part)
        except ValueError:
            b = None
        if b not in CODEC_BITS:
            raise ValueError(f"bits {part!r} not supported; valid bits: {', '.join(f'{v:g}' for v in CODEC_BITS)}")
        out.append(b)
    if not out:
        raise ValueError("no bits given")
    return out


def index_bytes(dim: int, bits: float) -> int:
    return sum(n * b // 8 for n, b in split_segments(dim, bits))


def _wall_ms(fn, reps: int = 3) -> float:
    fn()  # warm-up: builds cached tables
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    return _wall_ms(fn)


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None) -> dict:
    """GB/s (1e9 bytes/s, read + write counted) of ``dst.copy_(src)`` for a large buffer."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), device)
    return {"bytes": nbytes, "ms": ms, "gbs": 2 * nbytes / (ms * 1e-3) / 1e9}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def bench_codec(
    n_vectors: int | None = None,
    dim: int = 128,
    bits: list[float] = (3, 4),
    seed: int = 0,
    device: torch.device | None = None,
    command: str | None = None,
) -> dict:
    """Time encode and decode of ``n_vectors`` bf16 vectors for each bit width."""
    import triton

    check_head_dim(dim)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    if not on_cuda:
        warnings.warn(
            "no CUDA device: timing the plain torch reference on the CPU; these numbers say nothing about "
            "kernel speed",
            stacklevel=2,
        )
    if n_vectors is None:
        n_vectors = DEFAULT_VECTORS_CUDA if on_cuda else DEFAULT_VECTORS_CPU
    if n_vectors < 1:
        raise ValueError(f"--vectors must be positive, got {n_vectors}")
    if on_cuda:
        from .ops.codec import choose_encoder, decode, encode
        from .ops.rotation_tables import codec_tables
    else:
        from .ops.codec import decode_ref as decode
        from .ops.codec import encode_ref as encode

    copy = copy_bandwidth_gbs(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n_vectors, dim, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    rows = []
    for b in bits:
        ib = index_bytes(dim, b)
        packed, scale = encode(x, b, seed)
        enc_ms = _time_ms(lambda b=b: encode(x, b, seed), device)
        dec_ms = _time_ms(lambda b=b, p=packed, s=scale: decode(p, s, dim, b, seed, torch.bfloat16), device)
        moved = n_vectors * dim * BF16_BYTES + n_vectors * (ib + SCALE_BYTES)
        kernel = {"encode": "reference", "decode": "reference"}
        if on_cuda:
            kernel["encode"] = choose_encoder(codec_tables(dim, b, seed, str(device)), x.dtype)
            kernel["decode"] = "triton"
        for op, ms in (("encode", enc_ms), ("decode", dec_ms)):
            gbs = moved / (ms * 1e-3) / 1e9
            rows.append({
                "op": op,
                "kernel": kernel[op],
                "bits": b,
                "dim": dim,
                "vectors": n_vectors,
                "index_bytes": ib,
                "bytes_moved": moved,
                "ms": ms,
                "vectors_per_s": n_vectors / (ms * 1e-3),
                "gbs": gbs,
                "fraction_of_copy": gbs / copy["gbs"],
            })
    return {
        "device": device_name(device),
        "device_type": device.type,
        "backend": "triton" if on_cuda else "reference",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
        "copy": copy,
        "results": rows,
    }

# SPDX-License-Identifier: Apache-2.0
"""Statistical validation of the KV-cache presets on random unit vectors.

For every preset and head dim, K and V are encoded and decoded and compared with

- the Lloyd-Max distortion of their codebook (``lloyd_max_codebook(bits, d).mse``; for fractional
  rates the coordinate-weighted average of the two segments), which is the expected squared error
  of reconstructing a unit vector. Norm correction moves the measured value a little away from it
  (asymptotically to 2 - 2 sqrt(1 - D), +3% at 2 bits; finite d pulls the other way, -3.5% at
  4 bits and d=64), hence a default tolerance of 5% here; at d=128 the presets stay within 3%.
- an inner-product check: mean and spread of <q, x_hat> - <q, x> for a query q correlated with x
  (q = normalize(x + y), y an independent random unit vector, so <q, x> is about 0.7). MSE
  quantizers shrink inner products (a bias of about -D <q, x> without norm correction), which is
  what the paper's QJL variant removes; the QJL rows show its mean error in standard errors.

All functions return plain dicts (JSON-ready); ``turboquant_core.cli`` prints them.
"""

from __future__ import annotations

import math
import os

import torch
from tqdm import tqdm

from .codebooks import lloyd_max_codebook
from .formats import ComponentFormat, get_format
from .quantizer import MSEQuantizer, QJLQuantizer
from .rotation import check_head_dim

BACKENDS = ("auto", "triton", "reference")
QJL_BITS = (2, 3, 4)
DEFAULT_TOLERANCE = 0.05
# |mean error| / standard error below this counts as unbiased (false alarm rate ~6e-5 per row).
UNBIASED_Z = 4.0
CHUNK_ROWS = 16384


class _Moments:
    """Running mean / standard deviation of a stream of per-vector values (float64)."""

    def __init__(self):
        self.n, self.s1, self.s2 = 0, 0.0, 0.0

    def add(self, v: torch.Tensor) -> None:
        v = v.double()
        self.n += v.numel()
        self.s1 += float(v.sum())
        self.s2 += float((v * v).sum())

    @property
    def mean(self) -> float:
        return self.s1 / max(self.n, 1)

    @property
    def std(self) -> float:
        if self.n < 2:
            return 0.0
        var = (self.s2 - self.n * self.mean**2) / (self.n - 1)
        return math.sqrt(max(var, 0.0))

    @property
    def stderr(self) -> float:
        return self.std / math.sqrt(max(self.n, 1))

    @property
    def z(self) -> float:
        se = self.stderr
        return self.mean / se if se > 0 else 0.0


def theory_mse(component: ComponentFormat, dim: int) -> float | None:
    """Lloyd-Max distortion of a unit vector for a codebook component (None for fp8: no codebook)."""
    if not component.has_codebook:
        return None
    return sum(n * lloyd_max_codebook(b, dim).mse for n, b in component.segments(dim)) / dim


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA, 'reference' elsewhere; 'triton' off CUDA needs the interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the slow interpreter)")
    return backend


def unit_vector_chunks(n_vectors: int, dim: int, seed: int, device: torch.device):
    """Yield (x, q) chunks: x random unit vectors, q = normalize(x + y) with y independent.

    Deterministic in (n_vectors, dim, seed) and independent of the device.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + dim)
    done = 0
    while done < n_vectors:
        m = min(CHUNK_ROWS, n_vectors - done)
        x = torch.randn(m, dim, generator=gen)
        y = torch.randn(m, dim, generator=gen)
        x = x / x.norm(dim=-1, keepdim=True)
        y = y / y.norm(dim=-1, keepdim=True)
        q = x + y
        q = q / q.norm(dim=-1, keepdim=True)
        yield x.to(device), q.to(device)
        done += m


def _roundtrip_fn(component: ComponentFormat, dim: int, seed: int, backend: str):
    """x [m, d] fp32 -> x_hat [m, d] fp32 through the component's encoding."""
    if not component.has_codebook:
        q = component.quantizer(dim, seed)
        return lambda x: q.dequantize(q.quantize(x)).float(), "reference"
    if backend == "triton":
        from .ops.codec import decode, encode

        def run(x):
            packed, scale = encode(x, component.bits, seed, component.norm_correction)
            return decode(packed, scale, dim, component.bits, seed, torch.float32)

        return run, "triton"
    mq = MSEQuantizer(dim, component.bits, component.norm_correction, seed)
    return lambda x: mq.dequantize(mq.quantize(x)), "reference"


def _measure(fn, n_vectors: int, dim: int, data_seed: int, device: torch.device) -> dict:
    sq, ip = _Moments(), _Moments()
    for x, q in unit_vector_chunks(n_vectors, dim, data_seed, device):
        x_hat = fn(x)
        sq.add(((x_hat - x) ** 2).sum(dim=-1))
        ip.add(((x_hat - x) * q).sum(dim=-1))
    return {
        "mse": sq.mean,
        "mse_stderr": sq.stderr,
        "ip_mean": ip.mean,
        "ip_std": ip.std,
        "ip_stderr": ip.stderr,
        "ip_z": ip.z,
    }


def validate_presets(
    presets: list[str],
    dims: list[int],
    n_vectors: int,
    seed: int = 0,
    backend: str = "auto",
    device: torch.device | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    progress: bool = True,
) -> list[dict]:
    """One row per (preset, dim, K|V): measured MSE vs theory and the inner-product error."""
    device = device or default_device()
    backend = resolve_backend(backend, device)
    formats = [get_format(p) for p in presets]
    for d in dims:
        check_head_dim(d)
    jobs = [(f, d, role) for d in dims for f in formats for role in ("K", "V")]
    cache: dict[tuple, dict] = {}
    rows = []
    for f, d, role in tqdm(jobs, desc="validate presets", disable=None if progress else True):
        comp, comp_seed = (f.key, f.key_seed) if role == "K" else (f.value, f.value_seed)
        # Presets share components (same bits and seed): measure each once per dim.
        key = (comp, comp_seed, d)
        if key not in cache:
            fn, used = _roundtrip_fn(comp, d, comp_seed, backend)
            cache[key] = {**_measure(fn, n_vectors, d, seed, device), "backend": used}
        m = cache[key]
        theory = theory_mse(comp, d)
        rel = None if theory is None else m["mse"] / theory - 1.0
        rows.append({
            "preset": f.name,
            "dim": d,
            "component": role,
            "encoding": comp.describe(),
            "bits": comp.bits,
            "vectors": n_vectors,
            **m,
            "theory_mse": theory,
            "rel_dev": rel,
            "ok": rel is None or abs(rel) <= tolerance,
        })
    return rows


def validate_qjl(
    dims: list[int],
    n_vectors: int,
    seed: int = 0,
    bits: tuple[int, ...] = QJL_BITS,
    device: torch.device | None = None,
    progress: bool = True,
) -> list[dict]:
    """QJL (inner-product) variant vs the plain MSE quantizer at the same bits.

    Unbiasedness holds in expectation over the random sketch, so each chunk of vectors gets its
    own (rotation, sketch) seed; the mean error over all vectors is then a fair test.
    """
    device = device or default_device()
    for d in dims:
        check_head_dim(d)
    rows = []
    jobs = [(d, b) for d in dims for b in bits]
    for d, b in tqdm(jobs, desc="validate qjl", disable=None if progress else True):
        sq, ip, ip_mse = _Moments(), _Moments(), _Moments()
        for k, (x, q) in enumerate(unit_vector_chunks(n_vectors, d, seed, device)):
            qjl = QJLQuantizer(d, b, seed=seed + 7919 * k)
            x_hat = qjl.dequantize(qjl.quantize(x))
            sq.add(((x_hat - x) ** 2).sum(dim=-1))
            ip.add(((x_hat - x) * q).sum(dim=-1))
            mq = MSEQuantizer(d, b, norm_correction=False, seed=seed + 7919 * k)
            ip_mse.add(((mq.dequantize(mq.quantize(x)) - x) * q).sum(dim=-1))
        rows.append({
            "variant": "qjl",
            "dim": d,
            "bits": b,
            "vectors": n_vectors,
            "mse": sq.mean,
            "ip_mean": ip.mean,
            "ip_std": ip.std,
            "ip_stderr": ip.stderr,
            "ip_z": ip.z,
            "unbiased": abs(ip.z) < UNBIASED_Z,
            "mse_only_ip_mean": ip_mse.mean,
            "mse_only_ip_z": ip_mse.z,
        })
    return rows


def run_validation(
    presets: list[str],
    dims: list[int],
    n_vectors: int,
    seed: int = 0,
    backend: str = "auto",
    tolerance: float = DEFAULT_TOLERANCE,
    qjl: bool = True,
    progress: bool = True,
) -> dict:
    """Everything ``tq validate`` reports, as one dict with an overall ``ok``."""
    if n_vectors < 2:
        raise ValueError(f"--vectors must be at least 2, got {n_vectors}")
    device = default_device()
    resolved = resolve_backend(backend, device)
    preset_rows = validate_presets(presets, dims, n_vectors, seed, resolved, device, tolerance, progress)
    qjl_rows = validate_qjl(dims, n_vectors, seed, device=device, progress=progress) if qjl else []
    ok = all(r["ok"] for r in preset_rows) and all(r["unbiased"] for r in qjl_rows)
    return {
        "device": str(device),
        "backend": resolved,
        "vectors": n_vectors,
        "seed": seed,
        "tolerance": tolerance,
        "dims": list(dims),
        "presets": preset_rows,
        "qjl": qjl_rows,
        "ok": ok,
    }

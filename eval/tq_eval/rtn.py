# SPDX-License-Identifier: Apache-2.0
"""The round-to-nearest (RTN) control of the weight axis: what plain rounding does at tq's group size and bytes.

Per group of ``group_size`` (128) consecutive input weights of a row (the last group zero-padded, as tq's
``ops.weight_codec.pad_to_groups``), GPTQ's symmetric round-to-nearest at ``bits``:

    maxq  = 2**bits - 1
    amax  = max |w| over the group
    scale = fp16(2 * amax / maxq)            (a group whose scale is 0 in fp16, e.g. all zeros: scale 1)
    zero  = (maxq + 1) / 2
    q     = clamp(round(w / scale) + zero, 0, maxq)     (round: half to even, as torch.round)
    w_hat = scale * (q - zero)

The scale is rounded to fp16 before it is used, so ``w_hat`` is exactly what a stored form decodes to: ``bits``
per weight plus one fp16 scale per group, ``128 * bits / 8 + 2`` bytes per group -- 66 B at 4 bits, 50 B at 3,
the bytes of ``tq4`` / ``tq3`` (``formats.WEIGHT_FORMATS``). Only the codes differ: tq rotates each group and
uses Lloyd-Max levels with a norm-correcting scale, RTN uses a uniform grid spanning the group's largest weight.

``write_rtn_folder`` serves the control to vLLM without any new loader: a copy of the model folder in which the
tensors ``tq quantize`` selects (``integrations.quantize_checkpoint.is_projection`` / ``is_encodable``: the
2-D projection weights of the decoder layers) are replaced by ``w_hat`` in their own dtype; everything else is
copied byte for byte, so the copy loads as the plain bf16 model it imitates.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

GROUP_SIZE = 128  # tq's group (formats.WEIGHT_GROUP_SIZE); a test keeps them equal
SCALE_BYTES = 2  # one fp16 scale per group
MANIFEST = "rtn_control.json"  # written into the folder: what it was built from, for reuse
SCHEME = "gptq-symmetric-rtn"
# Rows rounded per step: bounds the float32 temporaries of a large layer.
ROWS_PER_STEP = 4096


def bytes_per_group(bits: int, group_size: int = GROUP_SIZE) -> int:
    """Stored bytes of one group: ``bits`` per weight and one fp16 scale."""
    return group_size * bits // 8 + SCALE_BYTES


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``w`` [out, in] (see the module docstring): q uint8 [out, G, group_size] in
    [0, 2**bits - 1] and the fp16 scales [out, G], G = ceil(in / group_size) (the last group zero-padded)."""
    if w.dim() != 2:
        raise ValueError(f"RTN quantizes a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"RTN bits must be 2..8, got {bits}")
    rows, cols = w.shape
    groups = -(-cols // group_size)
    wf = torch.nn.functional.pad(w.float(), (0, groups * group_size - cols)).reshape(rows, groups, group_size)
    maxq = 2**bits - 1
    scale = (2.0 * wf.abs().amax(dim=-1) / maxq).to(torch.float16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = (maxq + 1) / 2
    q = torch.clamp(torch.round(wf / scale.float().unsqueeze(-1)) + zero, 0, maxq)
    return q.to(torch.uint8), scale


def rtn_dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int, in_features: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_hat [out, in_features] in ``dtype`` from ``rtn_quantize``'s codes and scales."""
    zero = (2**bits) / 2
    w_hat = scale.float().unsqueeze(-1) * (q.float() - zero)
    return w_hat.reshape(q.shape[0], -1)[:, :in_features].to(dtype)


def rtn_fake_quant(w: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``w`` replaced by its RTN reconstruction, same shape and dtype (rows in steps of ``ROWS_PER_STEP``)."""
    out = torch.empty_like(w)
    for start in range(0, w.shape[0], ROWS_PER_STEP):
        part = w[start:start + ROWS_PER_STEP]
        q, scale = rtn_quantize(part, bits, group_size)
        out[start:start + ROWS_PER_STEP] = rtn_dequantize(q, scale, bits, w.shape[1], w.dtype)
    return out


# ----------------------------------------------------------------------------- the served folder

@dataclass
class RtnFolder:
    dest: Path
    bits: int
    built: bool  # False: an existing folder built from the same source was reused
    quantized: list[str] = field(default_factory=list)


def _source_files(src: Path) -> dict[str, list[int]]:
    """(size, mtime) of every file of the source: a change to any of them means rebuilding."""
    return {str(p.relative_to(src)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(src.rglob("*")) if p.is_file()}


def _manifest(src: Path, bits: int, group_size: int) -> dict:
    return {"scheme": SCHEME, "bits": bits, "group_size": group_size, "source": str(src),
            "source_files": _source_files(src)}


def _reusable(dest: Path, want: dict) -> bool:
    try:
        have = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return {k: have.get(k) for k in want} == want


def write_rtn_folder(src: str | os.PathLike, dest: str | os.PathLike, bits: int, *,
                     group_size: int = GROUP_SIZE, progress: bool = True) -> RtnFolder:
    """Write ``dest``: the model folder ``src`` with every tensor tq quantizes replaced by its RTN reconstruction
    (module docstring), or reuse ``dest`` when it was built from the same, unchanged source at the same bits.

    Every other file is copied as it is (config.json included: the copy is served as the plain model), and so are
    the shards that hold no selected tensor; the others are rewritten with their unselected tensors unchanged.
    ``src`` is only read; ``dest`` appears all at once (``atomic_folder``), and a failure leaves nothing behind."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from turboquant_core.integrations.atomic_folder import atomic_folder
    from turboquant_core.integrations.quantize_checkpoint import (
        CheckpointError,
        is_encodable,
        is_projection,
        read_source_config,
        safetensors_shards,
    )

    src, dest = Path(src).resolve(), Path(dest).resolve()
    if dest == src or src in dest.parents or dest in src.parents:
        raise ValueError(f"{dest} overlaps the source {src}; write it elsewhere")
    read_source_config(src)  # a model folder, not already quantized
    shards, _ = safetensors_shards(src)
    want = _manifest(src, bits, group_size)
    if _reusable(dest, want):
        return RtnFolder(dest, bits, built=False, quantized=json.loads((dest / MANIFEST).read_text())["quantized"])
    if dest.exists() and not (dest / MANIFEST).is_file():
        # Only an earlier RTN folder (stale: other source or bits) is replaced, never a folder of other origin.
        raise FileExistsError(f"{dest} exists and is not an RTN control folder ({MANIFEST} missing); remove it or "
                              "choose another place")
    try:
        selected = {}
        for shard in shards:
            with safe_open(str(src / shard), framework="pt") as f:
                selected[shard] = [n for n in f.keys() if is_projection(n)]
    except SafetensorError as e:
        raise CheckpointError(f"{src}: a safetensors file is not readable ({e})") from None
    if not any(selected.values()):
        raise CheckpointError(f"{src}: no projection weights to quantize")

    result = RtnFolder(dest, bits, built=True)
    with atomic_folder(dest) as tmp:
        for p in src.iterdir():
            if p.name in selected:
                continue  # written below
            if p.is_dir():
                shutil.copytree(p, tmp / p.name)
            else:
                shutil.copy2(p, tmp / p.name)
        total = sum(len(v) for v in selected.values())
        with tqdm(total=total, desc=f"RTN control ({bits}-bit)", unit="tensor", disable=not progress) as bar:
            for shard, names in selected.items():
                if not names:
                    shutil.copy2(src / shard, tmp / shard)
                    continue
                out: dict[str, torch.Tensor] = {}
                try:
                    with safe_open(str(src / shard), framework="pt") as f:
                        metadata = f.metadata()
                        for name in f.keys():
                            t = f.get_tensor(name)
                            if name in names and is_encodable(t):
                                t = rtn_fake_quant(t, bits, group_size)
                                result.quantized.append(name)
                            if name in names:
                                bar.update(1)
                            out[name] = t
                except SafetensorError as e:
                    raise CheckpointError(f"{src / shard}: not a readable safetensors file ({e})") from None
                save_file(out, str(tmp / shard), metadata=metadata or {"format": "pt"})
                del out
        if not result.quantized:
            raise CheckpointError(f"{src}: no 2-D floating-point projection weights to quantize")
        (tmp / MANIFEST).write_text(json.dumps({**want, "quantized": sorted(result.quantized)}, indent=1) + "\n")
    return result

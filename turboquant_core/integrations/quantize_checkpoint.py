# SPDX-License-Identifier: Apache-2.0
"""``tq quantize SRC OUT --bits 3|4``: a Hugging Face checkpoint (safetensors) with its linear weights in a TurboQuant
weight format (``formats.WEIGHT_FORMATS``), written next to everything else unchanged.

Which tensors: every 2-D floating-point ``*.weight`` of a projection inside the decoder layers (``*_proj.weight``,
MoE experts' included). Embeddings, the output head, norms, biases and anything else are copied as they are.
MoE routers (modules named as in ``ROUTER_GATES``: ``mlp.gate``, ``shared_expert_gate``) are copied too, as
``--quantization tq3|tq4`` keeps them in full precision, and listed in ``modules_not_converted``; ``--keep`` adds
name patterns to keep (listed there alike).

Each quantized ``NAME.weight`` [out, in] becomes two tensors (``ops.weight_codec.TQWeight``; G = ceil(in / 128),
the last group zero-padded): ``NAME.weight_packed`` uint8 [out, G, 16 * bits] (each group's Lloyd-Max indices,
planar8) and ``NAME.weight_scale`` float16 [out, G]. A routed MoE expert's projection (``*.experts.N.*.weight``,
``EXPERT_WEIGHT``) stores the same bytes as ``NAME.weight_packed`` [out, G * 16 * bits], the group axis flattened:
vLLM's expert loader takes any 3-D tensor for all of a layer's experts fused (version 2; version 1 wrote experts
3-D, which no loader reads). ``config.json`` gains::

    "quantization_config": {"quant_method": "turboquant", "format": "tq4", "bits": 4, "group_size": 128,
                            "rotation_seed": 31747, "packing": "planar8", "version": 2,
                            "quantized": [...], "modules_not_converted": [...]}

Streaming: one source shard at a time, one tensor at a time, one output shard per source shard (memory bounded by
the largest shard). Atomic: everything is written into a temporary folder beside OUT, renamed to OUT at the end;
SRC is only read. A source that already carries a quantization_config, a corrupt or truncated safetensors file, or
an index that names missing tensors is refused with the file named.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats import WEIGHT_FORMATS, WeightFormat
from ..ops.weight_codec import quantize_weight
from .atomic_folder import atomic_folder

QUANT_METHOD = "turboquant"
CHECKPOINT_VERSION = 2
PROJECTION_PATTERNS = ("*layers.*_proj.weight", "*layers.*experts.*.weight")
# A routed expert's projection (not a shared expert's: ``shared_experts.gate_proj`` is a plain linear layer in vLLM).
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")
# MoE routers stay in full precision: they are small, and a perturbed router picks other experts (vLLM also reads
# some of them as plain tensors, e.g. Qwen3-Next concatenates gate and shared_expert_gate weights).
ROUTER_GATES = ("gate", "shared_expert_gate")
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The source checkpoint cannot be quantized as it is (named file, reason)."""


@dataclass
class QuantizeSummary:
    dest: Path
    format: str
    quantized: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (tensor, why): MoE routers, projections --keep names
    bytes_before: int = 0
    bytes_after: int = 0


def safetensors_shards(src: Path) -> tuple[list[str], dict | None]:
    """The checkpoint's safetensors files (names in ``src``) and its index's weight map (None: a single file)."""
    index = src / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (src / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are not in {src}: {', '.join(missing[:4])}")
        return shards, weight_map
    single = sorted(p.name for p in src.glob("*.safetensors"))
    if not single:
        raise CheckpointError(f"{src}: no *.safetensors weights (only safetensors checkpoints are read)")
    if len(single) > 1:
        raise CheckpointError(f"{src}: {len(single)} safetensors files and no {INDEX_NAME}")
    return single, None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def is_router(name: str) -> bool:
    """Whether the tensor ``name`` is the weight of a MoE router inside the decoder layers (``ROUTER_GATES``)."""
    module, _, last = name.rpartition(".")
    return last == "weight" and _matches(module, ("*layers.*",)) and module.rpartition(".")[2] in ROUTER_GATES


def is_projection(name: str) -> bool:
    """Whether the tensor ``name`` belongs to a projection inside the decoder layers (``PROJECTION_PATTERNS``; MoE
    routers are not projections here)."""
    return _matches(name, PROJECTION_PATTERNS) and not is_router(name)


def is_encodable(t: torch.Tensor) -> bool:
    """Whether a projection's tensor is a weight the codec encodes: 2-D floating point."""
    return t.dim() == 2 and t.dtype.is_floating_point


def read_source_config(src: Path) -> dict:
    """``src``'s config.json, refused when missing, unreadable or already quantized (only full-precision
    checkpoints are converted)."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{src}: no config.json (expected a Hugging Face model folder)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{config_path}: the checkpoint is already quantized ({method}); start from the "
                              "full-precision one")
    return config


def quantize_checkpoint(src: str | os.PathLike, dest: str | os.PathLike, fmt: WeightFormat | str, *,
                        keep: tuple[str, ...] = (), overwrite: bool = False, progress: bool = True,
                        device: str = "cpu") -> QuantizeSummary:
    """Write ``dest``: the checkpoint ``src`` with its projections in ``fmt`` (see the module docstring)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    fmt = WEIGHT_FORMATS[fmt] if isinstance(fmt, str) and fmt in WEIGHT_FORMATS else fmt
    if not isinstance(fmt, WeightFormat):
        raise ValueError(f"unknown TurboQuant weight format {fmt!r}; valid formats: {', '.join(WEIGHT_FORMATS)}")
    src, dest = Path(src).resolve(), Path(dest).resolve()
    config = read_source_config(src)
    if dest == src or src in dest.parents:
        raise ValueError(f"{dest} is inside the source {src}; write it elsewhere")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    shards, weight_map = safetensors_shards(src)

    summary = QuantizeSummary(dest, fmt.name)
    with atomic_folder(dest) as tmp:
        for p in src.iterdir():  # tokenizer, generation config, ...: everything but the weights and their index
            if p.is_file() and p.suffix != ".safetensors" and p.name not in (INDEX_NAME, "config.json"):
                shutil.copy2(p, tmp / p.name)
        out_map: dict[str, str] = {}
        seen: set[str] = set()
        with tqdm(total=len(shards), desc=f"tq quantize ({fmt.name})", unit="shard", disable=not progress) as bar:
            for shard in shards:
                out: dict[str, torch.Tensor] = {}
                try:
                    with safe_open(str(src / shard), framework="pt", device=device) as f:
                        metadata = f.metadata()
                        for name in f.keys():
                            t = f.get_tensor(name)
                            seen.add(name)
                            summary.bytes_before += t.numel() * t.element_size()
                            projection = is_projection(name)
                            kept = projection and _matches(name, keep)
                            if projection and not kept and is_encodable(t):
                                q = quantize_weight(t, fmt)
                                stem = name.removesuffix(".weight")
                                packed = q.packed.flatten(1) if EXPERT_WEIGHT.search(name) else q.packed
                                out[f"{stem}.weight_packed"] = packed.cpu()
                                out[f"{stem}.weight_scale"] = q.scales.cpu()
                                summary.quantized.append(name)
                                continue
                            if kept:
                                summary.kept.append((name, "kept by --keep"))
                            elif is_router(name):
                                summary.kept.append((name, "MoE router, kept in full precision"))
                            out[name] = t.cpu()
                except SafetensorError as e:
                    raise CheckpointError(f"{src / shard}: not a readable safetensors file ({e})") from None
                for name, t in out.items():
                    summary.bytes_after += t.numel() * t.element_size()
                    out_map[name] = shard
                save_file(out, str(tmp / shard), metadata=metadata or {"format": "pt"})
                del out
                bar.update(1)
        if weight_map is not None:
            missing = sorted(set(weight_map) - seen)
            if missing:
                raise CheckpointError(f"{src / INDEX_NAME} names tensors its shards do not hold: {missing[:4]}")
            (tmp / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": summary.bytes_after}, "weight_map": dict(sorted(out_map.items()))},
                indent=2) + "\n")
        if not summary.quantized:
            patterns = ", ".join(PROJECTION_PATTERNS)
            raise CheckpointError(f"{src}: no projection weights to quantize (patterns {patterns})")
        config["quantization_config"] = {
            "quant_method": QUANT_METHOD, "format": fmt.name, "bits": fmt.bits, "group_size": fmt.group_size,
            "rotation_seed": fmt.seed, "packing": fmt.packing, "version": CHECKPOINT_VERSION,
            "quantized": sorted({n.removesuffix(".weight") for n in summary.quantized}),
            "modules_not_converted": sorted({n.removesuffix(".weight") for n, _ in summary.kept}),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return summary


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="tq quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="Hugging Face model folder with safetensors weights (read only)")
    ap.add_argument("dest", help="output folder (written atomically)")
    ap.add_argument("--bits", type=int, required=True, choices=sorted(f.bits for f in WEIGHT_FORMATS.values()),
                    help="3 (tq3) or 4 (tq4)")
    ap.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                    help="also keep tensors matching this glob in full precision (repeatable)")
    ap.add_argument("--device", default="cpu", help="where to encode (cpu, cuda)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    fmt = next(f for f in WEIGHT_FORMATS.values() if f.bits == args.bits)
    try:
        s = quantize_checkpoint(args.src, args.dest, fmt, keep=tuple(args.keep), overwrite=args.overwrite,
                                progress=not args.no_progress, device=args.device)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"saved {s.dest}: {len(s.quantized)} weights in {s.format}, {len(s.kept)} kept "
          f"({s.bytes_before / 2**20:.1f} MiB -> {s.bytes_after / 2**20:.1f} MiB)")
    for name, why in s.kept:
        print(f"  kept {name}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

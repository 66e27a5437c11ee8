# SPDX-License-Identifier: Apache-2.0
"""KV-cache size of a Hugging Face model for each preset, from its ``config.json``.

Per sequence and layer, a full-attention layer holds every token of the context, a sliding-window
layer at most ``sliding_window`` tokens, a chunked-attention layer at most ``attention_chunk_size``,
and linear-attention / state-space layers hold no KV cache at all. Bytes are exact per token and
KV head (``KVFormat.bytes_per_token_per_head``); block rounding and allocator overheads of a serving
engine are not included.

MLA models (a ``kv_lora_rank`` in the config: DeepSeek V2/V3, Kimi K2) cache one latent entry per token and
layer, shared by every head and replicated on every tensor-parallel rank (``mla_shape_from_config``); their
report compares vLLM's own MLA entries (``formats.mla_baseline_bytes``: bf16 1152 B, fp8 576 B, fp8_ds_mla
656 B) with each preset's MLA entry (``formats.MLAFormat``).

Which layers slide comes from ``layer_types`` when the config has it. Older configs leave it out
(Gemma 2, Gemma 3); then transformers, when installed, fills it in the way the model code does,
and without transformers a set ``sliding_window`` is taken to apply to every layer (Mistral).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .formats import BF16_BYTES, KV_FORMATS, get_format, mla_baseline_bytes, mla_format
from .rotation import SUPPORTED_HEAD_DIMS

FP8_BYTES = 1
GIB = 1 << 30

FULL_LAYER_TYPES = ("full_attention", "attention", "global_attention")
SLIDING_LAYER_TYPES = ("sliding_attention", "local_attention")
CHUNKED_LAYER_TYPES = ("chunked_attention",)
NO_KV_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "recurrent")
KNOWN_LAYER_TYPES = FULL_LAYER_TYPES + SLIDING_LAYER_TYPES + CHUNKED_LAYER_TYPES + NO_KV_LAYER_TYPES


class ModelConfigError(ValueError):
    """The config does not describe a KV cache that can be sized here."""


@dataclass(frozen=True)
class KVShape:
    """What the KV cache of one sequence looks like, per layer."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # per layer: None = whole context, 0 = no KV, n = at most n tokens
    layer_types_source: str

    def tokens_per_layer(self, context: int) -> list[int]:
        return [context if w is None else min(context, w) for w in self.layer_windows]

    def cached_tokens(self, context: int) -> int:
        """Sum over layers of the tokens one sequence keeps at this context length."""
        return sum(self.tokens_per_layer(context))

    def kv_bytes(self, context: int, batch: int, bytes_per_token_per_head: int) -> int:
        return batch * self.num_kv_heads * bytes_per_token_per_head * self.cached_tokens(context)

    def max_context(self, batch: int, bytes_per_token_per_head: int, budget_bytes: int) -> int | None:
        """Longest context per sequence (batch sequences) that fits; None when it never runs out."""
        per_token = batch * self.num_kv_heads * bytes_per_token_per_head
        full_layers = sum(1 for w in self.layer_windows if w is None)
        if full_layers == 0:
            cap = max([w for w in self.layer_windows if w] or [0])
            if self.kv_bytes(cap, batch, bytes_per_token_per_head) <= budget_bytes:
                return None
        lo, hi = 0, budget_bytes // (per_token * max(full_layers, 1)) + 1
        while lo < hi:  # largest n with kv_bytes(n) <= budget (kv_bytes is non-decreasing in n)
            mid = (lo + hi + 1) // 2
            if self.kv_bytes(mid, batch, bytes_per_token_per_head) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo


def load_config(path: str | Path) -> dict:
    """Read a config.json; a multimodal config's ``text_config`` is what holds the decoder."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ModelConfigError(f"config file not found: {p}") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{p} does not hold a JSON object")
    return cfg


def _text_config(cfg: dict) -> dict:
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"]
    return cfg


def _require_int(cfg: dict, key: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelConfigError(f"model config needs a positive integer {key!r}, got {v!r}")
    return v


def _layer_types_from_transformers(cfg: dict) -> list[str] | None:
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        filled = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception:  # an unknown model type or a config transformers rejects: use the plain rules
        return None
    types = getattr(filled, "layer_types", None)
    return list(types) if isinstance(types, (list, tuple)) else None


def kv_shape_from_config(cfg: dict) -> KVShape:
    """The per-layer KV layout of a decoder config (raises ``ModelConfigError`` with what is missing)."""
    cfg = _text_config(cfg)
    if cfg.get("kv_lora_rank"):
        raise ModelConfigError("MLA configs (kv_lora_rank, e.g. DeepSeek V2/V3) keep one latent per token and layer, "
                               "not K and V per head: mla_shape_from_config sizes them")
    layers = _require_int(cfg, "num_hidden_layers")
    if cfg.get("num_key_value_heads") is not None:
        kv_heads = _require_int(cfg, "num_key_value_heads")
    elif cfg.get("num_attention_heads") is not None:
        kv_heads = _require_int(cfg, "num_attention_heads")  # no GQA field: every head has its own K/V
    else:
        raise ModelConfigError("model config needs 'num_key_value_heads' (or 'num_attention_heads')")
    if cfg.get("head_dim") is not None:
        head_dim = _require_int(cfg, "head_dim")
    elif cfg.get("hidden_size") is not None and cfg.get("num_attention_heads") is not None:
        hidden, heads = _require_int(cfg, "hidden_size"), _require_int(cfg, "num_attention_heads")
        if hidden % heads:
            raise ModelConfigError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    else:
        raise ModelConfigError("model config needs 'head_dim' or both 'hidden_size' and 'num_attention_heads'")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ModelConfigError(
            f"head_dim {head_dim} is not supported by the TurboQuant formats; supported head dims: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )

    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    source = "config layer_types"
    if layer_types is None:
        if window is None or cfg.get("use_sliding_window") is False:
            layer_types, source = ["full_attention"] * layers, "no sliding window: all layers full"
        else:
            layer_types = _layer_types_from_transformers(cfg) if cfg.get("model_type") else None
            source = "transformers layer_types"
            if layer_types is None:
                layer_types, source = ["sliding_attention"] * layers, "sliding_window applies to every layer"
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        raise ModelConfigError(f"layer_types must list one type per layer ({layers}), got {layer_types!r}")

    windows: list[int | None] = []
    for t in layer_types:
        if t in FULL_LAYER_TYPES:
            windows.append(None)
        elif t in SLIDING_LAYER_TYPES:
            windows.append(_require_int(cfg, "sliding_window"))
        elif t in CHUNKED_LAYER_TYPES:
            windows.append(_require_int(cfg, "attention_chunk_size"))
        elif t in NO_KV_LAYER_TYPES:
            windows.append(0)
        else:
            raise ModelConfigError(f"unknown layer type {t!r}; known layer types: {', '.join(KNOWN_LAYER_TYPES)}")
    return KVShape(str(cfg.get("model_type", "unknown")), layers, kv_heads, head_dim, tuple(windows), source)


@dataclass(frozen=True)
class MLAShape:
    """What the KV cache of one sequence looks like in an MLA model: one entry of ``kv_lora_rank`` latent and
    ``rope_dim`` rope coordinates per token and layer, whatever the number of heads."""

    model_type: str
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_head_dim: int | None
    v_head_dim: int | None

    def kv_shape(self) -> KVShape:
        """The same cache as a ``KVShape`` of one KV head of head_dim kv_lora_rank + rope_dim, every layer full:
        its byte and fit arithmetic, given bytes per token and layer for ``bytes_per_token_per_head``."""
        return KVShape(self.model_type, self.num_layers, 1, self.kv_lora_rank + self.rope_dim,
                       (None,) * self.num_layers, "MLA: one latent entry per token and layer")


def is_mla_config(cfg: dict) -> bool:
    return bool(_text_config(cfg).get("kv_lora_rank"))


def mla_shape_from_config(cfg: dict) -> MLAShape:
    """The latent cache of an MLA decoder config (``kv_lora_rank``, ``qk_rope_head_dim``; raises
    ``ModelConfigError`` with what is missing or unsupported)."""
    cfg = _text_config(cfg)
    rank = _require_int(cfg, "kv_lora_rank")
    rope = _require_int(cfg, "qk_rope_head_dim")
    layers = _require_int(cfg, "num_hidden_layers")
    heads = _require_int(cfg, "num_attention_heads")
    if rank not in SUPPORTED_HEAD_DIMS:
        raise ModelConfigError(f"kv_lora_rank {rank} is not supported by the TurboQuant rotations; supported: "
                               f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if rope % 8:
        raise ModelConfigError(f"qk_rope_head_dim {rope} is not a multiple of 8")
    nope, v = cfg.get("qk_nope_head_dim"), cfg.get("v_head_dim")
    return MLAShape(str(cfg.get("model_type", "unknown")), layers, heads, rank, rope,
                    nope if isinstance(nope, int) else None, v if isinstance(v, int) else None)


def context_warning(cfg: dict, context: int) -> str | None:
    """Why ``context`` tokens are beyond what the model was configured for, or None when they are not."""
    limit = _text_config(cfg).get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < context:
        return (f"--context {context} exceeds the model's max_position_embeddings {limit}; sizes are computed "
                "anyway, but the model was not configured for contexts this long")
    return None


def kv_heads_per_gpu(cfg: dict, num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each GPU holds with ``tensor_parallel_size`` ranks, as vLLM splits them: a contiguous share, or
    one head replicated on ``tensor_parallel_size / num_kv_heads`` ranks when there are fewer heads than ranks."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be positive, got {tp}")
    heads = _text_config(cfg).get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        valid = [n for n in range(1, heads + 1) if heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads; "
                         f"valid sizes: {', '.join(map(str, valid))}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp} neither divides nor is a multiple of the model's "
                         f"{num_kv_heads} KV heads")
    return max(1, num_kv_heads // tp)


def memory_report(
    cfg: dict,
    context: int,
    batch: int = 1,
    gpu_mem_gib: float | None = None,
    presets: list[str] | None = None,
    tensor_parallel_size: int = 1,
) -> dict:
    """KV bytes per GPU for bf16, fp8 and each preset at ``context`` tokens x ``batch`` sequences.

    With ``gpu_mem_gib`` (GiB available to the KV cache on each GPU), also the longest context per
    sequence and the total tokens that fit at this batch size. ``tensor_parallel_size``: each GPU holds
    its share of the KV heads (``kv_heads_per_gpu``); with one rank that is all of them.
    """
    if context < 1:
        raise ValueError(f"--context must be positive, got {context}")
    if batch < 1:
        raise ValueError(f"--batch must be positive, got {batch}")
    if gpu_mem_gib is not None and not gpu_mem_gib > 0:
        raise ValueError(f"--gpu-mem-gb must be positive, got {gpu_mem_gib}")
    if is_mla_config(cfg):
        return mla_memory_report(cfg, context, batch, gpu_mem_gib, presets, tensor_parallel_size)
    model_shape = kv_shape_from_config(cfg)
    shape = replace(model_shape, num_kv_heads=kv_heads_per_gpu(cfg, model_shape.num_kv_heads, tensor_parallel_size))
    d = shape.head_dim
    names = presets if presets is not None else list(KV_FORMATS)
    entries = [("bf16", "baseline", 2 * BF16_BYTES * d), ("fp8", "baseline", 2 * FP8_BYTES * d)]
    entries += [(n, get_format(n).origin, get_format(n).bytes_per_token_per_head(d)) for n in names]
    budget = None if gpu_mem_gib is None else int(gpu_mem_gib * GIB)
    rows = _size_rows(shape, entries, context, batch, budget, {"bf16": 2 * BF16_BYTES * d, "fp8": 2 * FP8_BYTES * d})
    windows = shape.layer_windows
    return {
        "model_type": shape.model_type,
        "num_layers": shape.num_layers,
        "num_kv_heads": model_shape.num_kv_heads,
        "tensor_parallel_size": tensor_parallel_size,
        "kv_heads_per_gpu": shape.num_kv_heads,
        "head_dim": d,
        "full_layers": sum(1 for w in windows if w is None),
        "windowed_layers": sum(1 for w in windows if w),
        "no_kv_layers": sum(1 for w in windows if w == 0),
        "layer_types_source": shape.layer_types_source,
        "max_position_embeddings": _text_config(cfg).get("max_position_embeddings"),
        "context": context,
        "batch": batch,
        "gpu_mem_gib": gpu_mem_gib,
        "rows": rows,
    }


def _size_rows(shape: KVShape, entries: list[tuple[str, str, int]], context: int, batch: int,
               budget: int | None, baselines: dict[str, int]) -> list[dict]:
    """One row per (name, origin, bytes per token per head) entry; ``vs_<name>`` against each baseline."""
    base_bytes = {b: shape.kv_bytes(context, batch, n) for b, n in baselines.items()}
    rows = []
    for name, origin, bpt in entries:
        total = shape.kv_bytes(context, batch, bpt)
        row = {"name": name, "origin": origin, "bytes_per_token_per_head": bpt, "kv_bytes": total,
               "kv_gib": total / GIB}
        for b, n in base_bytes.items():
            row[f"vs_{b}"] = n / total if total else math.nan
        if budget is not None:
            max_ctx = shape.max_context(batch, bpt, budget)
            row["fits"] = total <= budget
            row["max_context"] = max_ctx
            row["max_total_tokens"] = None if max_ctx is None else max_ctx * batch
        rows.append(row)
    return rows


def mla_memory_report(
    cfg: dict,
    context: int,
    batch: int = 1,
    gpu_mem_gib: float | None = None,
    presets: list[str] | None = None,
    tensor_parallel_size: int = 1,
) -> dict:
    """``memory_report`` for an MLA model: bytes per GPU of vLLM's bf16, fp8 and fp8_ds_mla entries and of each
    preset's MLA entry, at ``context`` tokens x ``batch`` sequences, and the tokens one GiB holds.

    vLLM keeps the whole latent cache on every tensor-parallel rank (the latent is shared by all heads), so
    ``tensor_parallel_size`` changes no size here; it is checked as vLLM would (it must divide the heads)."""
    shape = mla_shape_from_config(cfg)
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be positive, got {tp}")
    if shape.num_heads % tp:
        valid = [n for n in range(1, shape.num_heads + 1) if shape.num_heads % n == 0]
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {shape.num_heads} attention "
                         f"heads; valid sizes: {', '.join(map(str, valid))}")
    rank, rope = shape.kv_lora_rank, shape.rope_dim
    baselines = mla_baseline_bytes(rank, rope)
    names = presets if presets is not None else list(KV_FORMATS)
    entries = [(b, "baseline", n) for b, n in baselines.items()]
    entries += [(n, get_format(n).origin, mla_format(n, rank, rope).bytes_per_token()) for n in names]
    kv = shape.kv_shape()
    budget = None if gpu_mem_gib is None else int(gpu_mem_gib * GIB)
    rows = _size_rows(kv, entries, context, batch, budget, baselines)
    for row in rows:
        row["bytes_per_token_per_layer"] = row.pop("bytes_per_token_per_head")
        row["tokens_per_gib"] = GIB // (row["bytes_per_token_per_layer"] * shape.num_layers)
        if row["origin"] != "baseline":
            row["latent"] = mla_format(row["name"], rank, rope).latent.describe()
    return {
        "attention": "mla",
        "model_type": shape.model_type,
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "kv_lora_rank": rank,
        "rope_dim": rope,
        "qk_nope_head_dim": shape.nope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "tensor_parallel_size": tp,
        "max_position_embeddings": _text_config(cfg).get("max_position_embeddings"),
        "context": context,
        "batch": batch,
        "gpu_mem_gib": gpu_mem_gib,
        "rows": rows,
    }

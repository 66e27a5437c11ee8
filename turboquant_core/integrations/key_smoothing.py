# SPDX-License-Identifier: Apache-2.0
"""Key smoothing folded into the attention weights: data-free, exact in full precision.

The MSE quantizer's error on a key is isotropic after the random rotation and proportional to the key's
norm, so the error of a logit q . k_hat has variance ~ |q|^2 |k|^2. Scaling key channel i by s_i and the
query channel by 1 / s_i leaves every q . k unchanged and changes that variance to |q / s|^2 |k * s|^2,
which is smallest for s_i^2 = rms(q_i) / rms(k_i): channels where queries are weak and keys strong (a
common pattern, e.g. behind per-head q/k norm gains) stop dominating the key norm.

The rms values come from the weights alone (no calibration data): with a normalized hidden state, the
rms of channel i is about the norm of row i of W * g (g the input RMSNorm gain); models with q/k
RMSNorm use the normalized row norms times their gain. RoPE rotates channel pairs (i, i + d/2) of
the rotate-half convention, so one s serves each pair and commutes with RoPE. The scale goes
into the weights once, at load time:

- no q/k norm (Llama, Qwen2, Mistral): rows of W_k (and its bias) times s, rows of W_q times 1/s
  (each query head with the s of its KV head); s per layer and KV head;
- q/k norm with one gain shared by all heads (Qwen3, Gemma 3): the k_norm gain times s and the q_norm
  gain times 1/s (Gemma's "1 + w" gains accordingly); s per layer, shared by the heads.

One computation of s (``weight_scales``), two front-ends:

- ``apply_key_smoothing``: Hugging Face transformers models (separate q_proj / k_proj); used by
  ``tq eval-ppl --key-smoothing``.
- ``apply_key_smoothing_fused``: vLLM-style decoder layers (duck-typed, no vLLM import): a fused
  ``self_attn.qkv_proj.weight`` of [q rows | k rows | v rows] for this tensor-parallel rank, per-rank
  ``q_size``, ``kv_size``, ``head_dim``, ``num_heads``, ``num_kv_heads``, ``rotary_emb`` and
  optional ``q_norm`` / ``k_norm`` (``RMSNorm``: x * w, ``GemmaRMSNorm``: x * (1 + w)). The
  patched vLLM (``turboquant_core.vllm.key_smoothing``, patch 0008) calls it once, when the weights
  are loaded, for every ``turboquant_*`` KV-cache dtype: by default (``--tq-key-smoothing auto``) with
  ``fold_qkv_rows=False``, i.e. only layers with q/k-norm gains; ``all`` folds into the qkv rows too.
  Layers it cannot smooth exactly are left untouched and reported: non-float (quantized) qkv
  weights, RoPE other than rotate-half over the whole head, odd head_dim, unknown norm types. With
  tensor parallelism (``TensorParallelHeads``) the ranks gather each other's row norms, so every rank
  folds the s of the whole layer, the same as with one rank and as the Hugging Face front-end's: a
  rank's quantized keys do not depend on how the heads are split (KV heads replicated over ranks
  included).

Measured on the CPU (benchmarks/results/eval-ppl-cpu/key-research): Gemma 3 270M, 4-bit keys and
values: +11.5 % -> +2.5 % perplexity; neutral on SmolLM2-135M. In vLLM on an H100
(eval/results/*/2026-11-23-h100*): Gemma 3 turboquant_k3v4_nc +19.9 % -> +2.1 %; SmolLM2 (no q/k norms)
slightly worse with it (KL 0.0157 vs 0.0150), hence the vLLM default of q/k-norm layers only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pair_rms(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d/2]: rms over each rotate-half RoPE pair (i, i + d/2)."""
    h = x.shape[-1] // 2
    return ((x[..., :h].pow(2) + x[..., h:].pow(2)) / 2).sqrt()


def smoothing_scales(rms_q: torch.Tensor, rms_k: torch.Tensor, power: float = 0.5) -> torch.Tensor:
    """[H, d/2] query and key pair rms -> s [H, d] = (rms_q / rms_k) ** power per pair, geometric mean 1
    per row (an overall factor does not change the quantization error of a normalized key)."""
    if rms_q.shape != rms_k.shape:
        raise ValueError(f"rms_q {tuple(rms_q.shape)} and rms_k {tuple(rms_k.shape)} must match")
    ratio = (rms_q.clamp_min(1e-12) / rms_k.clamp_min(1e-12)).pow(power)
    ratio = ratio / ratio.log().mean(-1, keepdim=True).exp()
    return torch.cat([ratio, ratio], dim=-1)


@torch.no_grad()
def weight_scales(w_q: torch.Tensor, w_k: torch.Tensor, in_gain: torch.Tensor, n_q: int, n_kv: int, d: int,
                  q_gain: torch.Tensor | None = None, k_gain: torch.Tensor | None = None,
                  power: float = 0.5) -> torch.Tensor:
    """The smoothing scales of one attention layer, from its weights alone.

    ``w_q`` [n_q * d, hidden] and ``w_k`` [n_kv * d, hidden]: the query and key projection rows;
    ``in_gain`` [hidden]: the effective gain of the input RMSNorm; ``q_gain`` / ``k_gain`` [d]: the
    effective gains of per-head q/k RMSNorms (both or neither). Returns s [n_kv, d] (one row per KV
    head: fold s into the key rows and 1/s into the query rows of that KV head's query heads) or,
    with q/k norm gains, s [1, d] (fold s into the k_norm gain and 1/s into the q_norm gain)."""
    if d % 2:
        raise ValueError(f"key smoothing needs an even head_dim, got {d}")
    if n_kv < 1 or n_q % n_kv:
        raise ValueError(f"{n_q} query heads do not divide into {n_kv} KV heads")
    if (q_gain is None) != (k_gain is None):
        raise ValueError("q_norm and k_norm gains must both be given or both be absent")
    g = in_gain.detach().float().to(w_q.device)
    return _scales_from_row_norms(_row_norms(w_q, g), _row_norms(w_k, g), n_q, n_kv, d, q_gain, k_gain, power)


def _row_norms(w: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """Norm of every row of W * g: the rms of its output channel for a normalized input."""
    return (w.detach().float() * gain).norm(dim=1)


def _scales_from_row_norms(row_q: torch.Tensor, row_k: torch.Tensor, n_q: int, n_kv: int, d: int,
                          q_gain: torch.Tensor | None = None, k_gain: torch.Tensor | None = None,
                          power: float = 0.5) -> torch.Tensor:
    """``weight_scales`` from the row norms of W_q * g [n_q * d] and W_k * g [n_kv * d]."""
    dev = row_q.device
    rq, rk = row_q.view(n_q, d), row_k.view(n_kv, d)
    if q_gain is not None:
        # Per-head RMSNorm after the projection: the row norms matter only relative to their head.
        rq = rq / rq.pow(2).mean(-1, keepdim=True).sqrt() * q_gain.detach().float().to(dev)
        rk = rk / rk.pow(2).mean(-1, keepdim=True).sqrt() * k_gain.detach().float().to(dev)
        # One gain shared by all heads: one s per layer, from the rms pooled over heads.
        return smoothing_scales(pair_rms(rq).pow(2).mean(0, keepdim=True).sqrt(),
                                pair_rms(rk).pow(2).mean(0, keepdim=True).sqrt(), power)
    rq_kv = pair_rms(rq).pow(2).view(n_kv, n_q // n_kv, d // 2).mean(1).sqrt()
    return smoothing_scales(rq_kv, pair_rms(rk), power)


@dataclass(frozen=True)
class TensorParallelHeads:
    """This rank's place in the tensor-parallel group that splits a layer's heads (vLLM: query and KV heads in
    contiguous blocks per rank; with fewer KV heads than ranks each KV head replicated on ``size / total``
    consecutive ranks). ``group``: the torch.distributed process group over the ``size`` ranks."""

    rank: int
    size: int
    group: object

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] of every rank, concatenated in rank order (a collective: every rank calls it)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts)

    def kv_heads(self, total: int, local: int) -> tuple[int, int]:
        """(first KV head of this rank in the layer's order, ranks holding each KV head)."""
        replicas = max(1, self.size // total)
        if total % self.size and self.size % total:
            raise KeySmoothingUnsupported(f"{total} KV heads do not split over {self.size} tensor-parallel ranks")
        return (self.rank // replicas) * local, replicas


def _layer_row_norms(row_q: torch.Tensor, row_k: torch.Tensor, attn, n_kv: int, d: int,
                     tp: TensorParallelHeads) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The row norms of the whole layer from every rank's (query rows in rank order; one copy of each
    replicated KV head), the layer's head counts, and this rank's first KV head."""
    total_kv = _int_attr(attn, "total_num_kv_heads", "self_attn")
    first_kv, replicas = tp.kv_heads(total_kv, n_kv)
    row_q, row_k = tp.gather(row_q), tp.gather(row_k)
    row_k = row_k.view(tp.size, n_kv * d)[::replicas].reshape(-1)
    return row_q, row_k, row_k.numel() // d, first_kv


def _fold_into_gain(norm: torch.nn.Module, factor: torch.Tensor, one_plus: bool) -> None:
    w = norm.weight
    f = factor.to(w.device)
    new = (1.0 + w.float()) * f - 1.0 if one_plus else w.float() * f
    w.copy_(new.to(w.dtype))


def _fold_into_rows(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> None:
    weight.mul_(rows.to(device=weight.device, dtype=weight.dtype)[:, None])
    if bias is not None:
        bias.mul_(rows.to(device=bias.device, dtype=bias.dtype))


def _row_factors(s: torch.Tensor, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """s [n_kv, d] -> (key row factors [n_kv * d], query row factors [n_q * d])."""
    return s.reshape(-1), (1.0 / s).repeat_interleave(n_q // s.shape[0], dim=0).reshape(-1)


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers models
# ----------------------------------------------------------------------------------------------


@dataclass
class SmoothedLayer:
    layer: int
    scales: torch.Tensor  # [Hkv or 1, d]


def _attention_modules(model):
    text = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(text, "layers", None)
    if layers is None:
        raise ValueError(f"key smoothing supports decoder models with .layers, got {type(model).__name__}")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        norm = getattr(layer, "input_layernorm", None)
        if attn is None or norm is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj")):
            raise ValueError(f"layer {i} of {type(model).__name__} has no self_attn.q_proj/k_proj/input_layernorm; "
                             "key smoothing supports Llama, Qwen2/3, Mistral and Gemma 3 style decoders")
        yield i, attn, norm


def _gain(norm: torch.nn.Module, one_plus: bool) -> torch.Tensor:
    w = norm.weight.detach().float()
    return 1.0 + w if one_plus else w


def _one_plus(model) -> bool:
    # Gemma's RMSNorm multiplies by (1 + weight); the others by weight.
    return getattr(model.config.get_text_config(decoder=True), "model_type", "").startswith("gemma")


@torch.no_grad()
def apply_key_smoothing(model, power: float = 0.5) -> list[SmoothedLayer]:
    """Fold weight-derived key smoothing into the Hugging Face ``model`` in place; returns the scales
    per layer.

    Logits are unchanged up to floating-point rounding; only the keys the cache stores (and so their
    quantization error) change."""
    cfg = model.config.get_text_config(decoder=True)
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    if d % 2:
        raise ValueError(f"key smoothing needs an even head_dim, got {d}")
    one_plus = _one_plus(model)
    out = []
    for i, attn, norm in _attention_modules(model):
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"layer {i}: q_norm and k_norm must both be present or both absent")
        if q_norm is not None and (q_norm.weight.numel() != d or k_norm.weight.numel() != d):
            raise ValueError(f"layer {i}: q_norm/k_norm gains of {q_norm.weight.numel()} channels, expected {d}")
        s = weight_scales(attn.q_proj.weight, attn.k_proj.weight, _gain(norm, one_plus), n_q, n_kv, d,
                          None if q_norm is None else _gain(q_norm, one_plus),
                          None if k_norm is None else _gain(k_norm, one_plus), power)
        if q_norm is not None:
            _fold_into_gain(k_norm, s[0], one_plus)
            _fold_into_gain(q_norm, 1.0 / s[0], one_plus)
        else:
            k_rows, q_rows = _row_factors(s, n_q)
            _fold_into_rows(attn.k_proj.weight, getattr(attn.k_proj, "bias", None), k_rows)
            _fold_into_rows(attn.q_proj.weight, getattr(attn.q_proj, "bias", None), q_rows)
        out.append(SmoothedLayer(i, s.clone()))
    return out


# ----------------------------------------------------------------------------------------------
# vLLM-style decoder layers (fused qkv_proj, per tensor-parallel rank); duck-typed
# ----------------------------------------------------------------------------------------------


class KeySmoothingUnsupported(ValueError):
    """This layer cannot be smoothed exactly; it was left untouched."""


@dataclass
class SmoothingSummary:
    smoothed: list[str] = field(default_factory=list)  # module names of the smoothed decoder layers
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module name, reason)

    def describe(self) -> str:
        """One line for a log."""
        total = len(self.smoothed) + len(self.skipped)
        if total == 0:
            return "no decoder layers with self_attn and input_layernorm found; nothing smoothed"
        line = f"{len(self.smoothed)} of {total} decoder layers smoothed"
        if self.skipped:
            first: dict[str, str] = {}
            for name, reason in self.skipped:
                first.setdefault(reason, name)
            counts = Counter(reason for _, reason in self.skipped)
            line += "; skipped: " + "; ".join(f"{n} x {reason} (first {first[reason]})"
                                               for reason, n in counts.most_common())
        return line


def _norm_is_one_plus(norm: torch.nn.Module, where: str) -> bool:
    """True for vLLM's GemmaRMSNorm (x * (1 + w)), False for RMSNorm (x * w); otherwise unsupported."""
    names = {c.__name__ for c in type(norm).__mro__}
    if "GemmaRMSNorm" in names:
        return True
    if "RMSNorm" in names:
        return False
    raise KeySmoothingUnsupported(f"{where} is a {type(norm).__name__}, not RMSNorm or GemmaRMSNorm")


def _norm_gain(norm: torch.nn.Module, where: str, size: int, foldable: bool) -> tuple[torch.Tensor, bool]:
    one_plus = _norm_is_one_plus(norm, where)
    w = getattr(norm, "weight", None)
    if foldable and not (getattr(norm, "has_weight", True) and getattr(norm, "pass_weight", True)):
        raise KeySmoothingUnsupported(f"{where} has no weight to fold the scale into")
    if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES or w.is_meta or w.shape != (size,):
        desc = "none" if not isinstance(w, torch.Tensor) else f"{w.dtype} {tuple(w.shape)}"
        raise KeySmoothingUnsupported(f"{where}.weight is {desc}, expected a float tensor of shape ({size},)")
    return _gain(norm, one_plus), one_plus


def _int_attr(obj, name: str, where: str) -> int:
    v = getattr(obj, name, None)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise KeySmoothingUnsupported(f"{where}.{name} is {v!r}, expected a positive int")
    return v


def _check_rope(attn, d: int) -> None:
    rope = getattr(attn, "rotary_emb", None)
    if rope is None:
        raise KeySmoothingUnsupported("self_attn has no rotary_emb")
    neox = getattr(rope, "is_neox_style", None)
    if neox is not True:
        raise KeySmoothingUnsupported(f"RoPE is not rotate-half ({type(rope).__name__}.is_neox_style={neox!r}); "
                                      "the channel pairs differ")
    rotary_dim, head_size = getattr(rope, "rotary_dim", None), getattr(rope, "head_size", None)
    if rotary_dim != d or (head_size is not None and head_size != d):
        raise KeySmoothingUnsupported(f"RoPE rotary_dim {rotary_dim!r} / head_size {head_size!r} do not cover "
                                      f"head_dim {d}")


@torch.no_grad()
def smooth_fused_layer(layer: torch.nn.Module, power: float = 0.5, fold_qkv_rows: bool = True,
                       tp: TensorParallelHeads | None = None) -> torch.Tensor:
    """Fold key smoothing into one vLLM-style decoder layer in place; returns s ([n_kv, d] or [1, d]) of
    this rank's KV heads.

    Raises ``KeySmoothingUnsupported`` (a ValueError), with the layer untouched, when it cannot be done
    exactly. ``fold_qkv_rows=False`` refuses layers without q/k norms (whose scale would go into the
    qkv_proj rows), e.g. when LoRA adapters on qkv_proj would not see it. ``tp``: the layer's heads are
    split over tensor-parallel ranks; every rank calls this for the same layers in the same order (the
    decisions to refuse depend only on the layer's structure, the same on every rank)."""
    attn, in_norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
    if attn is None or in_norm is None:
        raise KeySmoothingUnsupported("no self_attn / input_layernorm")
    qkv = getattr(attn, "qkv_proj", None)
    if qkv is None:
        raise KeySmoothingUnsupported("self_attn has no fused qkv_proj")
    n_q, n_kv = _int_attr(attn, "num_heads", "self_attn"), _int_attr(attn, "num_kv_heads", "self_attn")
    d = _int_attr(attn, "head_dim", "self_attn")
    q_size, kv_size = _int_attr(attn, "q_size", "self_attn"), _int_attr(attn, "kv_size", "self_attn")
    if d % 2:
        raise KeySmoothingUnsupported(f"odd head_dim {d}: no rotate-half RoPE pairs")
    if q_size != n_q * d or kv_size != n_kv * d or n_q % n_kv:
        raise KeySmoothingUnsupported(f"q_size {q_size} / kv_size {kv_size} do not match {n_q} query and "
                                      f"{n_kv} KV heads of {d} channels")
    w = getattr(qkv, "weight", None)
    rows = q_size + 2 * kv_size
    decode = getattr(getattr(qkv, "quant_method", None), "dequantized_weight", None)
    if decode is not None and isinstance(w, torch.Tensor) and not w.is_meta and w.dtype == torch.uint8:
        # A weight-quantized qkv_proj (--quantization tq4): its row norms come from the weight it computes with;
        # the scale can only go into q/k-norm gains, never into its packed rows.
        if getattr(attn, "q_norm", None) is None:
            raise KeySmoothingUnsupported("qkv_proj is weight-quantized and the layer has no q/k norms to fold into")
        w = decode(qkv)
    if not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES:
        desc = "absent" if not isinstance(w, torch.Tensor) else str(w.dtype).removeprefix("torch.")
        raise KeySmoothingUnsupported(f"qkv_proj.weight is {desc}, not float16/bfloat16/float32 "
                                      "(quantized checkpoint?)")
    if w.is_meta or w.dim() != 2 or w.shape[0] != rows:
        raise KeySmoothingUnsupported(f"qkv_proj.weight has shape {tuple(w.shape)}{' (meta)' if w.is_meta else ''}, "
                                      f"expected ({rows}, hidden)")
    bias = getattr(qkv, "bias", None)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype not in FLOAT_DTYPES
                             or bias.shape != (rows,)):
        raise KeySmoothingUnsupported(f"qkv_proj.bias is not a float tensor of shape ({rows},)")
    _check_rope(attn, d)
    in_gain, _ = _norm_gain(in_norm, "input_layernorm", w.shape[1], foldable=False)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        raise KeySmoothingUnsupported("only one of q_norm / k_norm")
    w_q, w_k = w[:q_size], w[q_size:q_size + kv_size]
    q_gain = k_gain = None
    if q_norm is not None:
        q_gain, q_one_plus = _norm_gain(q_norm, "self_attn.q_norm", d, foldable=True)
        k_gain, k_one_plus = _norm_gain(k_norm, "self_attn.k_norm", d, foldable=True)
        if q_norm is k_norm or q_norm.weight.data_ptr() == k_norm.weight.data_ptr():
            raise KeySmoothingUnsupported("q_norm and k_norm share one weight")
    elif not fold_qkv_rows:
        raise KeySmoothingUnsupported("no q/k norms, and folding into the qkv_proj rows is off")
    g = in_gain.detach().float().to(w.device)
    row_q, row_k = _row_norms(w_q, g), _row_norms(w_k, g)
    layer_q, layer_kv, first_kv = n_q, n_kv, 0
    if tp is not None and tp.size > 1:
        row_q, row_k, layer_kv, first_kv = _layer_row_norms(row_q, row_k, attn, n_kv, d, tp)
        layer_q = row_q.numel() // d
    s = _scales_from_row_norms(row_q, row_k, layer_q, layer_kv, d, q_gain, k_gain, power)
    if q_norm is not None:
        _fold_into_gain(k_norm, s[0], k_one_plus)
        _fold_into_gain(q_norm, 1.0 / s[0], q_one_plus)
        return s
    s = s[first_kv:first_kv + n_kv]
    k_rows, q_rows = _row_factors(s, n_q)
    _fold_into_rows(w_k, None if bias is None else bias[q_size:q_size + kv_size], k_rows)
    _fold_into_rows(w_q, None if bias is None else bias[:q_size], q_rows)
    return s


@torch.no_grad()
def apply_key_smoothing_fused(model: torch.nn.Module, power: float = 0.5, fold_qkv_rows: bool = True,
                              tp: TensorParallelHeads | None = None) -> SmoothingSummary:
    """Fold key smoothing into every vLLM-style decoder layer of ``model`` (modules with ``.self_attn``
    and ``.input_layernorm``) in place. Layers that cannot be smoothed exactly are left untouched and
    listed with the reason; see ``smooth_fused_layer`` (and for ``tp``)."""
    summary = SmoothingSummary()
    for name, module in model.named_modules():
        if getattr(module, "self_attn", None) is None or getattr(module, "input_layernorm", None) is None:
            continue
        try:
            smooth_fused_layer(module, power, fold_qkv_rows, tp)
        except KeySmoothingUnsupported as e:
            summary.skipped.append((name, str(e)))
        else:
            summary.smoothed.append(name)
    return summary


__all__ = ["KeySmoothingUnsupported", "SmoothedLayer", "SmoothingSummary", "TensorParallelHeads",
           "apply_key_smoothing", "apply_key_smoothing_fused", "pair_rms", "smooth_fused_layer", "smoothing_scales",
           "weight_scales"]

# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face transformers ``Cache`` that holds K/V compressed with a TurboQuant format.

Usage::

    cache = TurboQuantCache(model.config, preset="turboquant_k3v4_nc")
    model.generate(**inputs, **cache_kwargs(model, cache))
    cache.memory_bytes()  # bytes actually held

Design (transformers 5 builds caches from per-layer objects, see ``transformers/cache_utils.py``):
the cache is a list of layers derived from the model config exactly as ``DynamicCache`` does
(``layer_types`` / ``sliding_window``). Full-attention layers are ``TurboQuantLayer`` (a
``DynamicLayer``), sliding/chunked layers are ``TurboQuantSlidingWindowLayer`` (a
``DynamicSlidingWindowLayer``: keeps at most ``sliding_window - 1`` past tokens, like stock).

Per layer, what is stored is the format's bytes and nothing else: packed K and V codebook indices
(``uint8 [batch, kv_heads, tokens, index_bytes]``) and one fp16 scale per vector
(``[batch, kv_heads, tokens]``; fp8 keys have none). ``update()`` appends the new tokens and returns
what attention sees, decoded on demand from the stored bytes. Optional full-precision parts:
``residual_tokens`` (the most recent N tokens, as transformers' ``QuantizedCache`` does) and
``skip_layers`` (whole layers, e.g. the first and last).

Two attention modes:

- ``fresh_full_precision=True`` (the default, as served): ``update()`` returns the dequantized history
  stored *before* the call followed by the new tokens themselves in full precision, then compresses
  the new tokens. A prompt therefore attends to itself in full precision (what vLLM's prefill does
  with a TurboQuant KV cache, chunk by chunk, and what transformers' ``QuantizedCache`` does), and
  every later step reads the earlier tokens through the compressed cache.
- ``fresh_full_precision=False`` (decode-faithful, the strict bound): the tokens of the current
  forward are returned as their dequantized bytes too, so every position attends to the quantized
  K/V of itself and all earlier positions (``tq eval-ppl``'s default decode mode).

On CUDA the fused Triton codec (``turboquant_core.ops.codec.encode/decode``) is used; elsewhere the
plain-torch references, which produce the same bytes.

``key_centering`` (``turboquant_core.ops.key_centering``, the encoding the patched vLLM serves): on
full-attention layers with MSE keys the first ``page`` compressed tokens are stored plain, the pre-RoPE key
mean is derived from their decoded keys, and later keys are stored minus their page's centre and read back
with it added; ``key_centering_for_model(model)`` builds the tables from the model's rotary embedding.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from ..formats import ComponentFormat, KVFormat, get_format
from ..ops.key_centering import (
    KeyCentering,
    center_sums_from_keys_ref,
    center_vectors_ref,
    key_centering_tables,
    page_center_rows,
)
from ..rotation import SUPPORTED_HEAD_DIMS

DEFAULT_PRESET = "turboquant_k3v4_nc"
FULL_ATTENTION_TYPES = ("full_attention",)
SLIDING_ATTENTION_TYPES = ("sliding_attention", "chunked_attention")


# ---------------------------------------------------------------------------------------------
# Codec: one entry point that picks the fused kernels on CUDA and the references elsewhere.
# ---------------------------------------------------------------------------------------------


def encode_component(component: ComponentFormat, x: torch.Tensor,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., d] -> (codes uint8 [..., bytes], scale fp16 [...] or None for fp8)."""
    head_dim = x.shape[-1]
    if not component.has_codebook:
        return component.quantizer(head_dim, seed).quantize(x), None
    if x.is_cuda:
        from ..ops.codec import encode

        return encode(x, component.bits, seed, component.norm_correction)
    from ..ops.codec import encode_ref

    return encode_ref(x, component.bits, seed, component.norm_correction)


def decode_component(component: ComponentFormat, codes: torch.Tensor, scale: torch.Tensor | None, head_dim: int,
                     seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``encode_component``: -> [..., head_dim] in ``dtype``."""
    if not component.has_codebook:
        return component.quantizer(head_dim, seed).dequantize(codes).to(dtype)
    if codes.is_cuda:
        from ..ops.codec import decode

        return decode(codes, scale, head_dim, component.bits, seed, dtype)
    from ..ops.codec import decode_ref

    return decode_ref(codes, scale, head_dim, component.bits, seed, dtype)


# ---------------------------------------------------------------------------------------------
# Storage of one layer
# ---------------------------------------------------------------------------------------------


def config_head_dim(config) -> int:
    """head_dim of a (text) config: explicit ``head_dim`` (Qwen3, Gemma 3) or hidden_size / heads."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        head_dim = config.hidden_size // config.num_attention_heads
    return int(head_dim)


def check_cache_head_dim(head_dim: int, preset: str | None = None) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        what = f" for {preset}" if preset else ""
        raise ValueError(
            f"TurboQuantCache: head_dim {head_dim} is not supported{what}; supported head dims: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}. Keep this model on DynamicCache."
        )


class CompressedKVStore:
    """The compressed K/V history of one layer plus an optional full-precision tail.

    Token axis is dim 2 of every tensor. Compressed part first (oldest tokens), then the
    full-precision tail of at most ``residual_tokens`` tokens.
    """

    _COMPRESSED = ("key_codes", "key_scales", "value_codes", "value_scales")
    _RECENT = ("recent_keys", "recent_values")

    def __init__(self, kv_format: KVFormat, head_dim: int, residual_tokens: int = 0,
                 centering: KeyCentering | None = None):
        check_cache_head_dim(head_dim, kv_format.name)
        self.kv_format, self.head_dim, self.residual_tokens = kv_format, head_dim, residual_tokens
        if centering is not None and (not kv_format.key.centerable or centering.head_dim != head_dim):
            raise ValueError(f"key centering needs MSE keys of head_dim {centering.head_dim}; got "
                             f"{kv_format.name} at head_dim {head_dim}")
        self.centering = centering
        # (mu, mup) [B, H, dim_pad] float64 once the first page is stored (key centering only)
        self.center: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key_codes: torch.Tensor | None = None  # uint8 [B, H, T, key index bytes]
        self.key_scales: torch.Tensor | None = None  # fp16 [B, H, T] (None for fp8 keys)
        self.value_codes: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        self.recent_keys: torch.Tensor | None = None  # full precision [B, H, R, D], R <= residual_tokens
        self.recent_values: torch.Tensor | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def compressed_tokens(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.shape[2]

    @property
    def recent_tokens(self) -> int:
        return 0 if self.recent_keys is None else self.recent_keys.shape[2]

    @property
    def tokens(self) -> int:
        return self.compressed_tokens + self.recent_tokens

    def compressed_nbytes(self) -> int:
        return sum(_nbytes(getattr(self, n)) for n in self._COMPRESSED)

    def full_precision_nbytes(self) -> int:
        return sum(_nbytes(getattr(self, n)) for n in self._RECENT)

    # -- writes ----------------------------------------------------------------------------------
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[-1] != self.head_dim or value_states.shape[-1] != self.head_dim:
            raise ValueError(
                f"TurboQuantCache: expected head_dim {self.head_dim}, got keys {tuple(key_states.shape)} "
                f"and values {tuple(value_states.shape)}"
            )
        if self.residual_tokens == 0:
            self._compress(key_states, value_states)
            return
        keys = key_states if self.recent_keys is None else torch.cat([self.recent_keys, key_states], dim=2)
        values = value_states if self.recent_values is None else torch.cat([self.recent_values, value_states], dim=2)
        spill = keys.shape[2] - self.residual_tokens
        if spill > 0:
            self._compress(keys[:, :, :spill], values[:, :, :spill])
            keys, values = keys[:, :, spill:], values[:, :, spill:]
        # A copy: a view would keep the caller's whole tensor alive.
        self.recent_keys, self.recent_values = keys.clone(), values.clone()

    def _compress(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        f = self.kv_format
        p0 = self.compressed_tokens
        plain = keys.shape[2] if self.centering is None else max(min(self.centering.page - p0, keys.shape[2]), 0)
        v_codes, v_scales = encode_component(f.value, values, f.value_seed)
        self._append_codes(("value_codes", "value_scales"), (v_codes, v_scales))
        if plain:
            self._append_codes(("key_codes", "key_scales"), encode_component(f.key, keys[:, :, :plain], f.key_seed))
        if plain < keys.shape[2]:  # key centering: tokens after the first page, minus their page's centre
            if self.center is None:
                self.center = self._first_page_center()
            pos = torch.arange(p0 + plain, p0 + keys.shape[2], device=keys.device)
            rest = keys[:, :, plain:].double() - self._centers(pos)
            self._append_codes(("key_codes", "key_scales"), encode_component(f.key, rest.float(), f.key_seed))

    def _append_codes(self, names: tuple[str, str], new: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        for name, t in zip(names, new):
            if t is None:
                continue
            old = getattr(self, name)
            setattr(self, name, t.contiguous() if old is None else torch.cat([old, t], dim=2))

    def _first_page_center(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, mup) from the decoded keys of the first page (stored plain)."""
        c, f = self.centering, self.kv_format
        first = decode_component(f.key, self.key_codes[:, :, : c.page], self.key_scales[:, :, : c.page],
                                 self.head_dim, f.key_seed, torch.float32)
        return center_vectors_ref(center_sums_from_keys_ref(first, c), c)

    def _centers(self, positions: torch.Tensor) -> torch.Tensor:
        """Centres [B, H, n, D] float64 of compressed tokens at ``positions`` [n] (zero on the first page)."""
        mu, mup = self.center
        pc, ps = page_center_rows(positions.to(mu.device), self.centering)
        return (mu[:, :, None, :] * pc + mup[:, :, None, :] * ps)[..., : self.head_dim]

    # -- reads -----------------------------------------------------------------------------------
    def states(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole stored history, dequantized: keys, values [B, H, T, D] in ``dtype``."""
        f, d = self.kv_format, self.head_dim
        keys, values = [], []
        if self.compressed_tokens:
            if self.center is not None:
                k = decode_component(f.key, self.key_codes, self.key_scales, d, f.key_seed, torch.float32)
                pos = torch.arange(self.compressed_tokens, device=k.device)
                keys.append((k.double() + self._centers(pos)).to(dtype))
            else:
                keys.append(decode_component(f.key, self.key_codes, self.key_scales, d, f.key_seed, dtype))
            values.append(decode_component(f.value, self.value_codes, self.value_scales, d, f.value_seed, dtype))
        if self.recent_tokens:
            keys.append(self.recent_keys.to(dtype))
            values.append(self.recent_values.to(dtype))
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    # -- token-axis edits ------------------------------------------------------------------------
    def keep_last(self, n: int) -> None:
        """Drop the oldest tokens so that at most ``n`` remain."""
        drop = self.tokens - max(n, 0)
        if drop <= 0:
            return
        if self.centering is not None:
            raise RuntimeError("key centering needs the first page: a store that drops its oldest tokens has none")
        from_compressed = min(drop, self.compressed_tokens)
        self._slice(self._COMPRESSED, from_compressed, self.compressed_tokens)
        self._slice(self._RECENT, drop - from_compressed, self.recent_tokens)

    def drop_last(self, n: int) -> None:
        """Remove the ``n`` most recent tokens."""
        n = min(max(n, 0), self.tokens)
        from_recent = min(n, self.recent_tokens)
        self._slice(self._RECENT, 0, self.recent_tokens - from_recent)
        self._slice(self._COMPRESSED, 0, self.compressed_tokens - (n - from_recent))
        if self.centering is not None and self.compressed_tokens < self.centering.page:
            self.center = None  # the first page is incomplete again

    def _slice(self, names: tuple[str, ...], start: int, stop: int) -> None:
        for name in names:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[:, :, start:stop].contiguous() if (start, stop) != (0, t.shape[2]) else t)

    # -- whole-tensor edits ----------------------------------------------------------------------
    def apply(self, fn) -> None:
        """Apply ``fn`` to every stored tensor (batch reorder, device moves)."""
        for name in self._COMPRESSED + self._RECENT:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.center is not None:
            self.center = (fn(self.center[0]), fn(self.center[1]))

    def clear(self) -> None:
        for name in self._COMPRESSED + self._RECENT:
            setattr(self, name, None)
        self.center = None


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _absolute_crop(tokens_to_remove: int, current: int) -> int:
    """transformers' crop convention -> number of most recent tokens to remove.

    Negative: remove that many; positive (legacy): the length to keep.
    """
    if tokens_to_remove > 0:
        return max(current - tokens_to_remove, 0)
    return -tokens_to_remove


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class _TurboQuantStorage:
    """Behaviour shared by the full-attention and sliding-window TurboQuant layers."""

    is_compileable = False
    store: CompressedKVStore | None

    def _init_storage(self, kv_format: KVFormat, head_dim: int | None, residual_tokens: int,
                      fresh_full_precision: bool, centering: KeyCentering | None = None) -> None:
        self.kv_format, self.head_dim, self.residual_tokens = kv_format, head_dim, residual_tokens
        self.fresh_full_precision = bool(fresh_full_precision)
        self.centering = centering
        self.store = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        head_dim = key_states.shape[-1]
        if self.head_dim is not None and head_dim != self.head_dim:
            raise ValueError(f"TurboQuantCache: config says head_dim {self.head_dim}, got states with {head_dim}")
        self.head_dim = head_dim
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = CompressedKVStore(self.kv_format, head_dim, self.residual_tokens, self.centering)
        self.is_initialized = True
        if hasattr(self, "_sliding_window_tensor"):
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def _append_and_read(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Store the new tokens; return the K/V that attention sees: [B, H, stored before + new, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.fresh_full_precision:
            self.store.append(key_states, value_states)
            return self.store.states(self.dtype)
        # Prefill-faithful: the history as stored before this call (compressed part + full-precision
        # tail), then the new tokens as given; only then are the new tokens compressed.
        fresh_keys, fresh_values = key_states.to(self.dtype), value_states.to(self.dtype)
        if self.store.tokens:
            past_keys, past_values = self.store.states(self.dtype)
            fresh_keys = torch.cat([past_keys, fresh_keys], dim=2)
            fresh_values = torch.cat([past_values, fresh_values], dim=2)
        self.store.append(key_states, value_states)
        return fresh_keys, fresh_values

    def stored_tokens(self) -> int:
        return 0 if self.store is None else self.store.tokens

    def compressed_nbytes(self) -> int:
        return 0 if self.store is None else self.store.compressed_nbytes()

    def full_precision_nbytes(self) -> int:
        return 0 if self.store is None else self.store.full_precision_nbytes()

    def offload(self):
        if self.is_initialized:
            self.store.apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self.store.apply(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        if self.store is not None:
            self.store.clear()
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.stored_tokens():
            self.store.apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.stored_tokens():
            self.store.apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.stored_tokens():
            self.store.apply(lambda t: t[indices, ...])

    def __repr__(self):
        fresh = ", fresh_full_precision=True" if self.fresh_full_precision else ""
        return f"{self.__class__.__name__}({self.kv_format.name}, tokens={self.stored_tokens()}{fresh})"


class TurboQuantLayer(_TurboQuantStorage, DynamicLayer):
    """Full-attention layer with TurboQuant-compressed storage."""

    def __init__(self, kv_format: KVFormat, head_dim: int | None = None, residual_tokens: int = 0, *,
                 fresh_full_precision: bool = True, centering: KeyCentering | None = None, **kwargs):
        DynamicLayer.__init__(self)
        self._init_storage(kv_format, head_dim, residual_tokens, fresh_full_precision, centering)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._append_and_read(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.stored_tokens()

    def crop(self, tokens_to_remove: int) -> None:
        if self.store is not None:
            self.store.drop_last(_absolute_crop(tokens_to_remove, self.store.tokens))


class TurboQuantSlidingWindowLayer(_TurboQuantStorage, DynamicSlidingWindowLayer):
    """Sliding-window (or chunked) layer: compressed storage of at most ``sliding_window - 1`` past tokens."""

    def __init__(self, kv_format: KVFormat, sliding_window: int, head_dim: int | None = None,
                 residual_tokens: int = 0, *, fresh_full_precision: bool = True, **kwargs):
        DynamicSlidingWindowLayer.__init__(self, sliding_window=sliding_window)
        self._init_storage(kv_format, head_dim, residual_tokens, fresh_full_precision)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        full_keys, full_values = self._append_and_read(key_states, value_states)
        # As in DynamicSlidingWindowLayer: the next step needs only the last window - 1 tokens.
        if not self.record_past:
            self.store.keep_last(self.sliding_window - 1)
        return full_keys, full_values

    def crop(self, tokens_to_remove: int) -> None:
        if self.store is None:
            return
        if self.get_seq_length() >= self.sliding_window:
            if not self.record_past:
                raise RuntimeError(
                    "`crop` was called, but this sliding-window layer does not track past states and the window was "
                    "already reached. Call `activate_past_recording` before `crop` to be able to roll back."
                )
            if tokens_to_remove > 0:
                raise RuntimeError("Once the sliding window is reached, crop only accepts a negative number of tokens.")
            removed = -tokens_to_remove
            self.store.drop_last(removed)
            self.store.keep_last(self.sliding_window - 1)
            self.cumulative_length -= removed
        else:
            self.store.drop_last(_absolute_crop(tokens_to_remove, self.store.tokens))
            self.cumulative_length = self.store.tokens


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


class TurboQuantCache(Cache):
    """A transformers ``Cache`` storing K/V in a TurboQuant format (see module docstring).

    Args:
        config: the model config (``model.config``); its ``layer_types``/``sliding_window`` decide which
            layers slide, and its head_dim is checked. Without it, every layer is full attention and is
            created on first use (like ``DynamicCache()``).
        preset: a name from ``turboquant_core.formats.format_names()``.
        skip_layers: layer indices kept in full precision (negative indices count from the end).
        residual_tokens: the most recent N tokens of each layer stay in full precision (0: none).
        fresh_full_precision: True (default, as served): the tokens of the current call are returned
            as given (full precision) after the dequantized earlier history, and compressed only for
            later calls; a prompt attends to itself in full precision, as in vLLM's (chunked) prefill
            with a TurboQuant KV cache. False (decode-faithful): ``update()`` returns every token, the
            current ones included, as decoded from its compressed bytes.
        key_centering: tables from ``key_centering_for_model`` (or ``ops.key_centering``): full-attention
            layers with MSE keys store keys centred as the patched vLLM does (first page plain, later keys
            minus their page's share of the pre-RoPE key mean); fp8-key formats and sliding layers ignore it.
    """

    def __init__(self, config=None, preset: str = DEFAULT_PRESET, *, skip_layers: Iterable[int] = (),
                 residual_tokens: int = 0, fresh_full_precision: bool = True, offloading: bool = False,
                 offload_only_non_sliding: bool = True, key_centering: KeyCentering | None = None):
        self.kv_format = get_format(preset)
        self.key_centering = key_centering if self.kv_format.key.centerable else None
        if int(residual_tokens) < 0:
            raise ValueError(f"residual_tokens must be >= 0, got {residual_tokens}")
        self.residual_tokens = int(residual_tokens)
        self.fresh_full_precision = bool(fresh_full_precision)
        self.head_dim: int | None = None
        skip = [int(i) for i in skip_layers]
        layers = []
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            self.head_dim = config_head_dim(text_config)
            check_cache_head_dim(self.head_dim, preset)
            layer_types, layer_kwargs = _layer_types_and_kwargs(text_config)
            self.skip_layers = _normalize_layer_indices(skip, len(layer_types))
            layers = [self._make_layer(i, t, kw) for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        else:
            if any(i < 0 for i in skip):
                raise ValueError("negative skip_layers need the model config (to know the number of layers)")
            self.skip_layers = frozenset(skip)
        self._lazy_layers = config is None
        # ``layers=[]`` with no class to replicate: layers are appended in ``update`` (they need their index).
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def _make_layer(self, layer_idx: int, layer_type: str, layer_kwargs: dict):
        sliding = layer_type in SLIDING_ATTENTION_TYPES
        if not sliding and layer_type not in FULL_ATTENTION_TYPES:
            raise ValueError(
                f"TurboQuantCache: layer {layer_idx} has type {layer_type!r}; supported layer types: "
                f"{', '.join(FULL_ATTENTION_TYPES + SLIDING_ATTENTION_TYPES)}"
            )
        if layer_idx in self.skip_layers:
            if sliding:
                return DynamicSlidingWindowLayer(sliding_window=layer_kwargs["sliding_window"])
            return DynamicLayer()
        if sliding:
            return TurboQuantSlidingWindowLayer(self.kv_format, layer_kwargs["sliding_window"], self.head_dim,
                                                self.residual_tokens, fresh_full_precision=self.fresh_full_precision)
        return TurboQuantLayer(self.kv_format, self.head_dim, self.residual_tokens,
                               fresh_full_precision=self.fresh_full_precision, centering=self.key_centering)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._lazy_layers:
            while len(self.layers) <= layer_idx:
                self.layers.append(self._make_layer(len(self.layers), "full_attention", {}))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # -- accounting ------------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held, split into compressed storage and full-precision parts (skipped layers, residual tail)."""
        compressed = full = 0
        for layer in self.layers:
            if isinstance(layer, _TurboQuantStorage):
                compressed += layer.compressed_nbytes()
                full += layer.full_precision_nbytes()
            elif layer.is_initialized:
                full += _nbytes(layer.keys) + _nbytes(layer.values)
        return {"compressed": compressed, "full_precision": full, "total": compressed + full}

    def memory_bytes(self) -> int:
        """Bytes of K/V storage actually held by this cache (compressed + any full-precision parts)."""
        return self.memory_breakdown()["total"]

    def stored_tokens(self) -> list[int]:
        """Tokens held per layer (sliding layers: at most ``sliding_window - 1``)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, _TurboQuantStorage):
                out.append(layer.stored_tokens())
            else:
                out.append(0 if not layer.is_initialized or layer.keys.numel() == 0 else layer.keys.shape[-2])
        return out

    def __repr__(self):
        return (f"TurboQuantCache(preset={self.kv_format.name!r}, layers={len(self.layers)}, "
                f"skip_layers={sorted(self.skip_layers)}, residual_tokens={self.residual_tokens}, "
                f"fresh_full_precision={self.fresh_full_precision})")


def _layer_types_and_kwargs(text_config) -> tuple[list[str], list[dict]]:
    """transformers' layer types with one kwargs dict per layer. Up to 5.17 ``get_layer_types_and_kwargs``
    returns one dict shared by every layer; later releases return a list with a dict per layer."""
    layer_types, kwargs = get_layer_types_and_kwargs(text_config)
    layer_types = list(layer_types)
    if isinstance(kwargs, dict):
        return layer_types, [kwargs] * len(layer_types)
    kwargs = list(kwargs)
    if len(kwargs) != len(layer_types):
        raise ValueError(f"transformers returned {len(kwargs)} layer kwargs for {len(layer_types)} layer types")
    return layer_types, kwargs


def _normalize_layer_indices(indices: list[int], num_layers: int) -> frozenset[int]:
    out = set()
    for i in indices:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f"skip_layers index {i} is out of range for a model with {num_layers} layers")
        out.add(j)
    return frozenset(out)


def cache_kwargs(model, cache: Cache) -> dict[str, Cache]:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)``, under the name the installed transformers
    takes: ``cache`` where the model's forward has that parameter (newer 5.x releases, which deprecate the old
    name), else ``past_key_values``."""
    forward = getattr(model, "forward", None)
    params = inspect.signature(forward).parameters if forward is not None else {}
    return {"cache" if "cache" in params else "past_key_values": cache}


def key_centering_for_model(model, page: int = 16) -> KeyCentering:
    """Key-centering tables for a transformers decoder: RoPE angles of its full-attention layers from its
    rotary embedding (``full_attention_inv_freq`` where layer types have their own, as in Gemma 3, else
    ``inv_freq``; rotate-half pairs, as transformers' Llama, Qwen and Gemma families apply them), pages of
    ``page`` tokens (the serving block size), positions up to ``max_position_embeddings``."""
    inv_freq = None
    for name, module in model.named_modules():
        if name.split(".")[-1] != "rotary_emb":
            continue
        for attr in ("full_attention_inv_freq", "inv_freq"):
            if isinstance(getattr(module, attr, None), torch.Tensor):
                inv_freq = getattr(module, attr)
                break
        if inv_freq is not None:
            break
    if inv_freq is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding with inv_freq: key centering needs RoPE")
    config = model.config.get_text_config(decoder=True)
    return key_centering_tables(inv_freq.double().cpu(), config_head_dim(config), page,
                                int(getattr(config, "max_position_embeddings", 0) or 32768), neox=True,
                                device=inv_freq.device)

# SPDX-License-Identifier: Apache-2.0
"""Serving options of TurboQuant (the KV cache's, and the weights' of ``--quantization tq3|tq4``): one frozen
object, carried in vLLM's ``CacheConfig.turboquant`` and set from the command line (``vllm serve ...
--tq-key-centering / --tq-key-smoothing / --tq-boundary-layers / --tq-attention-workspace-mb / --tq-prefill-from-cache
/ --tq-compile-workers / --tq-decode-kernel / --tq-weights-lm-head / --tq-weights-decode-int8``). The vLLM glue reads
it at construction; nothing reads the environment.

The ``TQ_*`` environment variables of earlier releases are read once, when the engine's configuration is made, with a
deprecation warning naming the option that replaces each; an explicitly set option wins over them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

KEY_SMOOTHING_MODES = ("auto", "all", "off")
DECODE_KERNELS = ("auto", "register-tile", "wgmma")  # ops.paged_attention.TQAttentionConfig.decode_kernel


@dataclass(frozen=True)
class TQConfig:
    """TurboQuant options of one engine.

    key_centering: store keys minus their sequence's pre-RoPE mean, taken from its first page, on full-attention
        layers with MSE keys and a plain rotary embedding; attention adds it back exactly. No bytes are added.
    key_smoothing: fold a per-RoPE-pair scale into the keys and its inverse into the queries at load time: ``auto``
        on layers with q/k-norm gains (Qwen3, Gemma 3), ``all`` on every layer it can fold exactly, ``off``.
    boundary_layers: keep the first and last N layers' KV cache unquantized (stock vLLM's TurboQuant keeps 2).
    attention_workspace_mb: split-KV scratch of the decode attention per KV-cache group, in MiB; the kernels cap their
        split count to what fits.
    prefill_from_cache: prefill chunks attend to their own tokens as stored (read back from the compressed pages, as
        decode does) instead of in bf16. A request's keys and values then do not depend on how its prompt was
        chunked or served from the prefix cache, so temperature-0 answers repeat under load; prompts are processed
        at the strict regime's quality (``tq eval-ppl``), lower than the default's at 3-bit keys.
    compile_workers: processes that compile the kernel variants at start-up, in parallel, before the warm-up runs
        them (``ops.compile_ahead``): 0 picks the CPUs this engine process may use, shared among the node's ranks
        (at most 16); 1 compiles them one after another in the engine process.
    decode_kernel: the decode attention kernel: ``wgmma`` e4m3 operands through Hopper warpgroup MMA
        (``ops.paged_decode_wgmma``) where it applies (sm_90, turboquant_k3v4_nc, head size 128, GQA group <= 8,
        one query per request), elsewhere the register-tile kernel (``ops.paged_decode``); ``register-tile`` that
        kernel everywhere; ``auto`` (the default) as ``wgmma``.
    weights_lm_head: with ``--quantization tq3|tq4``, the output head (lm_head) is encoded in the same format as the
        linear layers (``vllm.quant_config``); off by default. A head that shares the input embedding's weight
        (``tie_word_embeddings``) is refused; the input embedding stays as it is.
    weights_decode_int8: with TurboQuant weights (``--quantization tq3|tq4`` or a ``tq quantize`` checkpoint),
        decode-sized products (``ops.linear``: the register-tile kernel, the warpgroup kernel up to 8 rows) multiply
        the codebook's bytes by the rotated activation rounded to int8 per group of 128 at a power-of-two step (on by
        default: faster); off, by the fp16 activation. Prefill and other large batches decode the weight for cuBLAS
        either way.
    """

    key_centering: bool = True
    key_smoothing: str = "auto"
    boundary_layers: int = 0
    attention_workspace_mb: int = 32
    prefill_from_cache: bool = False
    compile_workers: int = 0
    decode_kernel: str = "auto"
    weights_lm_head: bool = False
    weights_decode_int8: bool = True

    def __post_init__(self):
        if not isinstance(self.key_centering, bool):
            raise ValueError(f"key_centering must be true or false, got {self.key_centering!r}")
        if self.key_smoothing not in KEY_SMOOTHING_MODES:
            raise ValueError(f"key_smoothing must be one of {', '.join(KEY_SMOOTHING_MODES)}, "
                             f"got {self.key_smoothing!r}")
        if not isinstance(self.boundary_layers, int) or isinstance(self.boundary_layers, bool) \
                or self.boundary_layers < 0:
            raise ValueError(f"boundary_layers must be an integer >= 0, got {self.boundary_layers!r}")
        if not isinstance(self.attention_workspace_mb, int) or isinstance(self.attention_workspace_mb, bool) \
                or self.attention_workspace_mb < 1:
            raise ValueError(f"attention_workspace_mb must be an integer >= 1, got {self.attention_workspace_mb!r}")
        if not isinstance(self.prefill_from_cache, bool):
            raise ValueError(f"prefill_from_cache must be true or false, got {self.prefill_from_cache!r}")
        if not isinstance(self.compile_workers, int) or isinstance(self.compile_workers, bool) \
                or self.compile_workers < 0:
            raise ValueError(f"compile_workers must be an integer >= 0 (0: automatic), got {self.compile_workers!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if not isinstance(self.weights_lm_head, bool):
            raise ValueError(f"weights_lm_head must be true or false, got {self.weights_lm_head!r}")
        if not isinstance(self.weights_decode_int8, bool):
            raise ValueError(f"weights_decode_int8 must be true or false, got {self.weights_decode_int8!r}")

    def uuid(self) -> str:
        """Stable identity (vLLM's config hashing accepts objects that provide one)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        return (f"key centering {'on' if self.key_centering else 'off'}, key smoothing {self.key_smoothing}, "
                f"{self.boundary_layers} boundary layers, attention workspace {self.attention_workspace_mb} MiB, "
                f"prefill {'from the cache' if self.prefill_from_cache else 'in bf16'}, "
                f"{self.compile_workers or 'automatic'} compile workers, decode kernel {self.decode_kernel}"
                + (", output head encoded" if self.weights_lm_head else "")
                + ("" if self.weights_decode_int8 else ", weight products in fp16 at decode"))

    @classmethod
    def from_vllm(cls, vllm_config) -> TQConfig:
        """The options a vLLM engine carries (``vllm_config.cache_config.turboquant``); the defaults without them."""
        cache_config = getattr(vllm_config, "cache_config", None)
        found = getattr(cache_config, "turboquant", None)
        return found if isinstance(found, cls) else cls()


# Environment variable -> (field, the option that replaces it, its parser). Read only by `with_deprecated_env`.
_DEPRECATED_ENV = {
    "TQ_KEY_CENTERING": ("key_centering", "--tq-key-centering / --no-tq-key-centering",
                         {"1": True, "0": False}),
    "TQ_KEY_SMOOTHING": ("key_smoothing", "--tq-key-smoothing {auto,all,off}",
                         {"auto": "auto", "1": "all", "0": "off"}),
    "TQ_BOUNDARY_LAYERS": ("boundary_layers", "--tq-boundary-layers N", None),
    "TQ_ATTN_WORKSPACE_MB": ("attention_workspace_mb", "--tq-attention-workspace-mb N", None),
}


def with_deprecated_env(config: TQConfig, environ: Mapping[str, str]) -> tuple[TQConfig, list[str]]:
    """``config`` with the deprecated ``TQ_*`` variables of ``environ`` applied where ``config`` has a field's default
    (an option set on the command line wins), and one warning per variable found."""
    defaults = TQConfig()
    changes, warnings = {}, []
    for var, (name, option, values) in _DEPRECATED_ENV.items():
        if var not in environ:
            continue
        raw = environ[var].strip().lower()
        if values is not None:
            if raw not in values:
                raise ValueError(f"{var} (deprecated: use {option}) must be one of {', '.join(values)}, got {raw!r}")
            value = values[raw]
        else:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{var} (deprecated: use {option}) must be an integer, got {raw!r}") from None
        if getattr(config, name) == getattr(defaults, name):
            changes[name] = value
            warnings.append(f"{var}={environ[var]} is deprecated and will stop being read: use {option}")
        else:
            warnings.append(f"{var}={environ[var]} is deprecated and ignored: {option} is set on the command line")
    return (dataclasses.replace(config, **changes) if changes else config), warnings


__all__ = ["KEY_SMOOTHING_MODES", "TQConfig", "with_deprecated_env"]

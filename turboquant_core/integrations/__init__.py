# SPDX-License-Identifier: Apache-2.0
"""Hugging Face transformers integration: a TurboQuant KV cache, model loading, perplexity evaluation.

Submodules import transformers; importing this package does not (names resolve on first use).
"""

from __future__ import annotations

_EXPORTS = {
    "TurboQuantCache": "transformers_cache",
    "TurboQuantLayer": "transformers_cache",
    "TurboQuantSlidingWindowLayer": "transformers_cache",
    "key_centering_for_model": "transformers_cache",
    "cache_kwargs": "transformers_cache",
    "load_model": "models",
    "add_eval_ppl_arguments": "perplexity",
    "run_eval_ppl": "perplexity",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

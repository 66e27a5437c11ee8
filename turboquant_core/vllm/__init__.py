# SPDX-License-Identifier: Apache-2.0
"""vLLM glue: the TURBOQUANT attention backend (``backend``), key centering attached at start-up (``centering``),
the start-up kernel warm-up (``warmup``), load-time key smoothing (``key_smoothing``), the KV-cache spec of
TurboQuant sliding-window layers (``spec``) and the ``tq3`` / ``tq4`` / ``turboquant`` weight quantization methods
(``quant_config``). The KV-cache options come from ``CacheConfig.turboquant`` (``turboquant_core.config.TQConfig``).

These modules import vLLM (0.26.0, patched by ``scripts/patches.py``); the patch series refers to them by their
dotted paths. Nothing else in turboquant_core imports them.
"""

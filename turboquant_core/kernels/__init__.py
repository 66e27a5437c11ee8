# SPDX-License-Identifier: Apache-2.0
"""Triton kernels only (``@triton.jit``). Launchers, checks and allocation live in ``turboquant_core.ops``."""

# SPDX-License-Identifier: Apache-2.0
"""Kernel launches without Triton's per-launch specialization.

``launch(kernel, grid, *args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does. Triton's own launch
specializes every argument, builds a cache key string and looks the compiled kernel up on each call: for kernels
with the argument counts of the paged store and attention that host work is most of an eager layer's time (the
work of a step that does not replay a CUDA graph: mixed batches, speculative verification with drafts of
different lengths). Here a launch site's compiled kernels are kept under a key of exactly the argument properties
Triton specializes on (``arg_key``): a tensor's dtype and 16-byte alignment; an int's equality to 1, divisibility
by 16 and integer type; the type of anything else. The first launch with a new key goes through Triton (which
compiles or finds the kernel); later ones call the compiled kernel's launcher directly.

Launches go through Triton unchanged where this cannot stand in for it: the interpreter, a launch hook installed
(a profiler's ``knobs.runtime.launch_enter_hook``), keyword values that are not hashable (``constexpr`` wrappers count by their values).
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.language import constexpr
from triton.runtime import driver
from triton.runtime.jit import JITFunction

_I32_MIN, _I32_END, _U64_MIN = -(1 << 31), 1 << 31, 1 << 63

# (kernel, device, keyword items, argument key) -> (compiled kernel, the values of the parameters after the positional
# ones, in signature order)
_compiled: dict[tuple, tuple] = {}


def arg_key(a) -> object:
    """What Triton's specialization of a non-constexpr argument depends on (``native_specialize_impl``)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if type(a) is int:
        return a == 1, (a & 15) == 0, _I32_MIN <= a < _I32_END, a >= _U64_MIN
    return type(a)


def kwargs_key(kwargs: dict) -> tuple:
    """The keyword arguments (constexprs, launch options) as a hashable key; ``constexpr`` wrappers (not hashable)
    by their values."""
    return tuple([(k, v.value) if type(v) is constexpr else (k, v) for k, v in kwargs.items()])


def launch(kernel, grid: tuple[int, ...], *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; returns the compiled kernel (None where Triton returns none)."""
    hooks = knobs.runtime
    if not isinstance(kernel, JITFunction) or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
        return kernel[grid](*args, **kwargs)
    try:
        device = driver.active.get_current_device()
    except RuntimeError:  # no driver (compiling for a GPU on a machine without one)
        return kernel[grid](*args, **kwargs)
    try:
        key = (kernel, device, kwargs_key(kwargs), tuple([arg_key(a) for a in args]))
        entry = _compiled.get(key)
    except TypeError:  # an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if compiled is not None and hasattr(compiled, "run"):
            names = list(kernel.signature.parameters)[len(args):]
            defaults = kernel.signature.parameters
            tail = tuple(kwargs[n] if n in kwargs else defaults[n].default for n in names)
            _compiled[key] = (compiled, tail)
        return compiled
    compiled, tail = entry
    stream = driver.active.get_current_stream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    return compiled


__all__ = ["arg_key", "kwargs_key", "launch"]

# SPDX-License-Identifier: Apache-2.0
"""Kernel launches seen and compiled for an sm_90 target on a machine without a GPU.

``install(on_launch)`` replaces ``JITFunction.run`` so that a launch neither compiles nor runs: it is bound with
Triton's own binder for the target and handed to ``on_launch`` as a ``ProbedLaunch`` (its cache key, and
``compile()`` to a cubin with Triton's bundled ptxas, reporting the kernel's spill stack and shared memory). Every
launch's constexprs are serialized the way Triton's compile hooks serialize them (vLLM installs one), so a
constexpr that is not JSON fails here. For the subprocess probes of test_paged_decode.py and test_kernel_variants.py
(Triton must not be interpreted there).
"""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.compiler import make_backend
from triton.runtime import jit as tjit

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
_binders = {}


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump ``flag`` (``-sass``, ``-res-usage``) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, stack frame per thread: register spills) of a cubin's kernel."""
    res = cuobjdump(cubin, "-res-usage")
    return int(re.search(r"REG:(\d+)", res).group(1)), int(re.search(r"STACK:(\d+)", res).group(1))


class ProbedLaunch:
    """One launch, bound for the sm_90 target: ``name``, ``key`` (Triton's compile-cache key) and ``compile()``."""

    def __init__(self, fn, args, kwargs):
        kwargs = dict(kwargs, debug=False, instrumentation_mode="")
        if fn not in _binders:
            _binders[fn] = tjit.create_function_from_signature(fn.signature, fn.params, BACKEND)
        bound_args, spec, options = _binders[fn](*args, **kwargs)
        self.fn, self.name = fn, fn.fn.__name__
        self.key = str(tjit.compute_cache_key({}, spec, options))
        self._packed = fn._pack_args(BACKEND, kwargs, bound_args, spec, options)
        options, signature, constexprs, attrs = self._packed
        tjit.serialize_specialization_data(self.name, signature, constexprs, attrs, options, "key")

    def compile(self) -> dict:
        """Compile to a cubin for sm_90: {kernel, regs, stack (spill bytes per thread), shared (bytes)}."""
        options, signature, constexprs, attrs = self._packed
        if getattr(self.fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource

            src = GluonASTSource(self.fn, signature, constexprs, attrs)
        else:
            src = triton.compiler.ASTSource(self.fn, signature, constexprs, attrs)
        k = triton_compile(src, target=TARGET, options=options.__dict__)
        self.ptx, self.cubin = k.asm["ptx"], k.asm["cubin"]
        regs, stack = resource_usage(k.asm["cubin"])
        return dict(kernel=self.name, regs=regs, stack=stack, shared=k.metadata.shared)

    def sass(self) -> str:
        """The kernel's sm_90 SASS (after ``compile()``)."""
        return cuobjdump(self.cubin, "-sass")

    def ptxas_notes(self) -> str:
        """What Triton's bundled ptxas says of the kernel in verbose mode (after ``compile()``): its performance
        notes, e.g. C7515 where warpgroup MMAs meant to overlap other work are serialized."""
        with tempfile.TemporaryDirectory() as d:
            ptx = os.path.join(d, "k.ptx")
            with open(ptx, "w") as f:
                f.write(self.ptx)
            p = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True, check=True)
        return p.stdout + p.stderr


class Sm90Driver:
    """A stand-in for Triton's active driver that reports an sm_90 device 0 and answers the calls a launch makes
    before it compiles (device, stream, target), so that launches take Triton's own path on a machine without a GPU
    (``triton.runtime.driver.driver.set_active(Sm90Driver())``): its binder specializes the real arguments and its
    ``jit_cache_hook`` sees the variants. Nothing can launch."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET


def install(on_launch) -> None:
    """Every later launch is handed to ``on_launch(ProbedLaunch)`` instead of compiling and running."""

    def probe_run(self, *args, grid, warmup, **kwargs):
        on_launch(ProbedLaunch(self, args, kwargs))
        return None

    tjit.JITFunction.run = probe_run


def install_printer() -> None:
    """Every later launch is compiled and printed as one line: kernel, registers, spill bytes, shared bytes (what
    the subprocess probes of the kernel tests parse)."""

    def on_launch(launch):
        res = launch.compile()
        print(res["kernel"], res["regs"], res["stack"], res["shared"], flush=True)

    install(on_launch)


def run_probe(script: str) -> list[tuple[str, int, int, int]]:
    """Run ``script`` (which calls ``install_printer`` and launches kernels) in a fresh interpreter with Triton
    compiling rather than interpreting: (kernel, registers, spill bytes, shared bytes) per launch."""
    import sys

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    rows = [line.split() for line in p.stdout.strip().splitlines()]
    return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

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


_SASS_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
# opcodes whose first operand is not a register they write
_NO_DEST = ("ST", "RED", "ATOM", "BAR", "BRA", "EXIT", "WARPGROUP", "HGMMA", "IGMMA", "DEPBAR", "LDGDEPBAR", "NOP",
            "WARPSYNC", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "SYNCS", "CALL", "RET", "YIELD", "BSYNC", "BSSY")


def _written_registers(op: str, operands: str) -> set[int]:
    """The registers an instruction writes: its first operand, widened by the opcode's size (.64, .WIDE, .128)."""
    if op.startswith(_NO_DEST):
        return set()
    m = re.fullmatch(r"R(\d+)(?:\.\w+)?", operands.split(",")[0].strip())
    if not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_register_hazards(sass: str) -> list[str]:
    """Instructions that write an A register of a warpgroup MMA in flight, i.e. before the ``WARPGROUP.DEPBAR``
    that retires its group: PTX leaves that undefined and ptxas neither prevents nor reports it (the MMA reads its A
    registers while it runs). Each loop body (a backward branch's range) is walked twice, the second walk as the
    next iteration, so that a loop decoding the next operand into the registers of a product still in flight is
    found. Groups end at the ``HGMMA`` marked ``gsb0``; ``DEPBAR.LE gsb0, N`` keeps the N newest."""
    insns = [(int(a, 16), op, ops) for a, op, ops in _SASS_INSN.findall(sass)]
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    found = []
    for i, (a, op, ops) in enumerate(insns):
        target = re.match(r"\s*0x([0-9a-f]+)", ops)
        if op != "BRA" or not target or int(target.group(1), 16) >= a or int(target.group(1), 16) not in index:
            continue
        body = insns[index[int(target.group(1), 16)]:i + 1]
        in_flight, group = [], set()
        for addr, bop, bops in body + body:
            if bop.startswith("HGMMA"):
                a_op = re.fullmatch(r"R(\d+)", bops.split(",")[1].strip())
                if a_op:
                    group |= set(range(int(a_op.group(1)), int(a_op.group(1)) + 4))
                if "gsb0" in bops:
                    in_flight.append(group)
                    group = set()
            elif bop.startswith("WARPGROUP.DEPBAR"):
                keep = int(bops.split(",")[-1].strip(), 16)
                in_flight = in_flight[len(in_flight) - keep:] if keep else []
            elif _written_registers(bop, bops) & set().union(*in_flight, group):
                found.append(f"{addr:#06x} {bop} {bops.strip()}")
    return found


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


def wgmma_report(launch: "ProbedLaunch") -> dict:
    """``launch.compile()``'s report plus what the warpgroup-MMA tests read in its SASS: ptxas's serialization note
    (``serialized``), the ``HGMMA`` and ``WARPGROUP.ARRIVE`` counts, and the writes to A registers of an MMA in flight
    (``hazards``, ``wgmma_register_hazards``)."""
    res = launch.compile()
    sass = launch.sass()
    return dict(res, serialized="serialized" in launch.ptxas_notes(), hgmma=sass.count("HGMMA."),
                arrive=sass.count("WARPGROUP.ARRIVE"), hazards=wgmma_register_hazards(sass))


def install(on_launch) -> None:
    """Every later launch is handed to ``on_launch(ProbedLaunch)`` instead of compiling and running."""

    def probe_run(self, *args, grid, warmup, **kwargs):
        on_launch(ProbedLaunch(self, args, kwargs))
        return None

    tjit.JITFunction.run = probe_run


def install_wgmma_reports(kernel: str) -> list[dict]:
    """Every later launch of ``kernel`` is compiled and its ``wgmma_report`` appended to the list returned (other
    launches neither compile nor run)."""
    seen = []
    install(lambda launch: seen.append(wgmma_report(launch)) if launch.name == kernel else None)
    return seen


def install_printer() -> None:
    """Every later launch is compiled and printed as one line: kernel, registers, spill bytes, shared bytes (what
    the subprocess probes of the kernel tests parse); a kernel that writes the A registers of a warpgroup MMA in
    flight (``wgmma_register_hazards``) ends the probe with its instructions."""

    def on_launch(launch):
        res = launch.compile()
        hazards = wgmma_register_hazards(launch.sass())
        if hazards:
            raise SystemExit(f"{res['kernel']} writes A registers of a warpgroup MMA in flight: {hazards[:4]}")
        print(res["kernel"], res["regs"], res["stack"], res["shared"], flush=True)

    install(on_launch)


def run_script(script: str) -> str:
    """Run ``script`` in a fresh interpreter with Triton compiling rather than interpreting; its stdout (the test
    fails with its stderr's tail if it does)."""
    import sys

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, cwd=root)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    return p.stdout


def run_probe(script: str) -> list[tuple[str, int, int, int]]:
    """Run ``script`` (which calls ``install_printer`` and launches kernels) with ``run_script``: (kernel,
    registers, spill bytes, shared bytes) per launch."""
    rows = [line.split() for line in run_script(script).strip().splitlines()]
    return [(r[0], int(r[1]), int(r[2]), int(r[3])) for r in rows]

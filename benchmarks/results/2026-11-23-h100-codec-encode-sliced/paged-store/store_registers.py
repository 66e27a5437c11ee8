# SPDX-License-Identifier: Apache-2.0
"""Registers, spill stack and SASS instruction count of the paged store kernel for one preset, compiled for
sm_90 on a machine without a GPU (Triton's bundled ptxas and cuobjdump; head_dim 128, 8 KV heads, bf16 K/V).

    PYTHONPATH=TREE python store_registers.py turboquant_k3v4_nc
"""
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.compiler import make_backend
from triton.runtime import jit as tjit

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
binders = {}
out = []


def probe_run(self, *args, grid, warmup, **kwargs):
    kwargs["debug"] = False
    kwargs["instrumentation_mode"] = ""
    if self not in binders:
        binders[self] = tjit.create_function_from_signature(self.signature, self.params, BACKEND)
    bound_args, spec, options = binders[self](*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound_args, spec, options)
    src = triton.compiler.ASTSource(self, signature, constexprs, attrs)
    k = triton_compile(src, target=TARGET, options=options.__dict__)
    path = os.path.join(tempfile.gettempdir(), f"store-probe-{len(out)}.cubin")
    open(path, "wb").write(k.asm["cubin"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    n = len([ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/\s+", ln)])
    out.append((self.fn.__name__, re.findall(r"REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+", res), n))
    return None


tjit.JITFunction.run = probe_run  # compile for sm_90 instead of launching

from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, tq_store  # noqa: E402

fmt = sys.argv[1]
layout = paged_layout(fmt, head_dim=128, block_size=16)
cache = allocate_kv_cache(64, 8, layout)
k = torch.randn(100, 8, 128).to(torch.bfloat16)
tq_store(k, k.clone(), cache, torch.arange(100), layout)
print(fmt, out)

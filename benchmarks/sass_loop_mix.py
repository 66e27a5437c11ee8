#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Instruction mix of a kernel's main loop in its sm_90 SASS, on a machine without a GPU: how many instructions of
each kind one iteration issues (for the decode kernel: per 16-token tile and thread). Kernels bound by an issue pipe
(the register-tile decode loop is bound by its ALU pipe) get faster as these counts fall, so a change can be weighed
here before it is timed on a GPU. ``load_leads`` gives, for each global load of the loop, how many instructions
come before the first that reads what it loaded (round the loop): where ptxas puts a load a few dozen instructions
before its use, the warp waits out the memory round trip there.

The launches of one serving configuration's start-up warm-up (``ops.kernel_warmup``, as the vLLM backend warms up by
default) go through Triton's own launch path with a stand-in sm_90 driver (``tests/ops/sm90_probe.Sm90Driver``); the
variants of ``--kernel`` are compiled with Triton's bundled ptxas and read with its cuobjdump. The loop is the longest
backward branch's body.

    python benchmarks/sass_loop_mix.py --kernel tq_paged_decode_kernel --out decode-mix.json
    python benchmarks/sass_loop_mix.py --kernel tq_paged_decode_kernel --centred --out decode-mix-centred.json
    python benchmarks/sass_loop_mix.py --linear tq4 --rows 1,8,16 --out linear-mix.json
    python benchmarks/sass_loop_mix.py --mla turboquant_k3v4_nc --out mla-mix.json

``--linear FORMAT`` reads the weight product instead, the kernel ``ops.linear`` launches on an H100 for each
``--rows`` (activation rows; a Qwen3-8B gate_up product, 24576 x 4096, split over the groups as the launcher splits
it for 132 SMs): the register-tile kernel (``tq_linear_mma_kernel``) or, from ``WGMMA_MIN_ROWS`` rows, the warpgroup
kernel (``tq_linear_wgmma_kernel``); its loop is one group of 128 inputs for the program's output rows.
``per_weight`` is the loop's instructions per thread times the program's threads over the weights it decodes per
group.

``--mla PRESET`` reads the MLA decode's loop over token tiles, per thread, 16 heads: by default the warpgroup-MMA
kernel Hopper serves (``tq_mla_decode_wgmma_kernel``, 64 tokens a tile), with ``--mla-kernel mma`` the register-tile
one (16 tokens a tile).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHT_FORMATS = ("tq4", "tq3")  # formats.WEIGHT_FORMATS (not imported: this script runs without the package)
COPY = re.compile(r"\s(?:IMAD\.MOV\.U32 R\d+, RZ, RZ,|IMAD\.U32 R\d+, RZ, RZ,|MOV R\d+,) (U?R\d+)(?:\.reuse)? ;")
SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")
# Pipes of the ops the decode loop issues (sm_90): ALU for logic, permutes, shifts, compares and integer adds; FMA for
# float and integer multiply-adds; the uniform datapath for U* ops (one value per warp); the rest named by what they
# do.
PIPE = {"PRMT": "alu", "LOP3": "alu", "SHF": "alu", "IADD3": "alu", "ISETP": "alu", "FSEL": "alu", "SEL": "alu",
        "FMNMX": "alu", "LEA": "alu", "VIADD": "alu", "SGXT": "alu", "FSETP": "alu", "PLOP3": "alu",
        "IMAD": "fma", "FMUL": "fma", "FFMA": "fma", "FADD": "fma", "HADD2": "fma", "HFMA2": "fma", "HMUL2": "fma",
        "HMMA": "tensor", "MOVM": "tensor", "LDG": "memory", "LDS": "memory", "STS": "memory", "LDSM": "memory",
        "SHFL": "memory", "LDC": "memory", "MUFU": "xu", "FRND": "xu", "F2FP": "alu", "VIMNMX": "alu",
        "BRA": "control", "BSSY": "control", "BSYNC": "control"}

CHILD = r'''
import json, sys
import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver

driver.set_active(Sm90Driver())
from turboquant_core.ops import paged_decode
from turboquant_core.ops.compile_ahead import compile_variant, recording_variants
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, warmup_kernels

paged_decode._gluon_runs = lambda device: True
preset, d, hq, hkv, centred, kernel = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5] == "1", sys.argv[6]
bs = 16
layout = paged_layout(preset, head_dim=d, block_size=bs)
cache = allocate_kv_cache(64, hkv, layout)
cent = key_centering_tables(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), d, bs, 8192) \
    if centred else None
with recording_variants() as found:
    warmup_kernels(cache, layout, hq, hkv, dtype=torch.bfloat16, centering=cent, paths=("decode", "context"))
names = sorted({v.name for v in found.values()})
out = []
for i, v in enumerate(v for v in found.values() if v.name == kernel):
    path = sys.argv[7] + f"-{i}.cubin"
    with open(path, "wb") as f:
        f.write(compile_variant(v).asm["cubin"])
    out.append(path)
print(json.dumps(dict(kernels=names, cubins=out)))
'''

CHILD_MLA = r'''
import json, sys
import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver, resource_usage

driver.set_active(Sm90Driver())
from turboquant_core.ops import mla
from turboquant_core.ops.compile_ahead import compile_variant, recording_variants
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout

mla._gluon_runs = lambda device: True
preset, kernel, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
lay = mla_paged_layout(preset, 16)
with recording_variants() as found:
    q, q_pe = torch.zeros(2, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    mla.mla_decode_attention(q, q_pe, allocate_mla_cache(4, lay), lay, torch.zeros(2, 4, dtype=torch.int32),
                             torch.tensor([10, 20], dtype=torch.int32), 0.1, num_splits=2, kernel=kernel)
name = f"tq_mla_decode_{kernel}_kernel"
out = []
for i, v in enumerate(v for v in found.values() if v.name == name):
    cubin = compile_variant(v).asm["cubin"]
    path = f"{prefix}-{i}.cubin"
    with open(path, "wb") as fh:
        fh.write(cubin)
    regs, stack = resource_usage(cubin)
    out.append(dict(kernel=name, registers=regs, spill_bytes=stack, cubin=path))
print(json.dumps(dict(variants=out)))
'''

CHILD_LINEAR = r'''
import json, sys
import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver, resource_usage

driver.set_active(Sm90Driver())
from turboquant_core.formats import get_weight_format
from turboquant_core.ops import linear
from turboquant_core.ops.compile_ahead import compile_variant, recording_variants
from turboquant_core.ops.weight_codec import TQWeight, served_layout

linear._gluon_runs = lambda device: True
linear._wgmma_runs = lambda device: True  # as on an H100 or H200
linear._pdl_runs = lambda device: True
fmt, out_features, in_features, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for name, value in json.loads(sys.argv[6]).items():  # --set
    setattr(linear, name, value)
f = get_weight_format(fmt)
groups = f.groups(in_features)
w = served_layout(TQWeight(fmt, torch.zeros(out_features, groups, 16 * f.bits, dtype=torch.uint8),
                           torch.zeros(out_features, groups, dtype=torch.float16), in_features))
out = []
for rows in map(int, sys.argv[5].split(",")):
    with recording_variants() as found:
        linear.tq_linear(torch.zeros(rows, in_features, dtype=torch.bfloat16), w)
    wgmma = rows >= linear.WGMMA_MIN_ROWS
    name = "tq_linear_wgmma_kernel" if wgmma else "tq_linear_mma_kernel"
    block_o = linear.WGMMA_BLOCK_O if wgmma else linear.mma_tiles(rows)[0]
    for i, v in enumerate(v for v in found.values() if v.name == name):
        path = f"{prefix}-{rows}-{i}.cubin"
        cubin = compile_variant(v).asm["cubin"]
        with open(path, "wb") as fh:
            fh.write(cubin)
        out.append(dict(rows=rows, kernel=name, block_o=block_o, threads=128 if wgmma else 32,
                        registers=resource_usage(cubin)[0], cubin=path))
print(json.dumps(dict(variants=out)))
'''


def loop_mix(sass: str, innermost: bool = False) -> dict:
    """{instructions, ops: {op: count}, pipes: {pipe: count}, copies: {register, from_uniform}} of the longest
    backward branch's body of one SASS listing (addresses in bytes, 16 per instruction); with ``innermost``, of the
    longest body that holds no other (a loop nested in another: the decode kernels' tile loop inside their loop over
    blocks)."""
    lines = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := SASS_LINE.match(line))]
    loops = []
    for addr, op, line in lines:
        if op != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", line.split("BRA", 1)[1])
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if innermost:
        loops = [(t, a) for t, a in loops if not any(t <= t2 and a2 <= a and (t2, a2) != (t, a) for t2, a2 in loops)]
    best = max(loops, key=lambda ta: ta[1] - ta[0], default=None)
    if best is None:
        return dict(instructions=0, ops={}, pipes={}, copies=dict(register=0, from_uniform=0), load_leads=[])
    body = [(op, line) for addr, op, line in lines if best[0] <= addr <= best[1]]
    ops = collections.Counter(op for op, _ in body)
    pipes = collections.Counter()
    for op, n in ops.items():
        pipes[PIPE.get(op, "uniform" if op.startswith("U") or op == "R2UR" else "other")] += n
    # Instructions that only copy a value: between registers (operand placement, e.g. an MMA's register quads), and
    # out of uniform registers (a kernel argument such as a codebook word, rematerialized where it is used).
    copies = collections.Counter()
    for _, line in body:
        if m := COPY.search(line):
            copies["from_uniform" if m.group(1).startswith("U") else "register"] += 1
    return dict(instructions=sum(ops.values()), ops=dict(ops.most_common()), pipes=dict(pipes.most_common()),
                copies=dict(register=copies["register"], from_uniform=copies["from_uniform"]),
                load_leads=load_leads([line for _, line in body]))


def load_leads(body: list[str]) -> list[int]:
    """For each global load into registers (``LDG``) of a loop body, in order: the instructions from it to the first
    one that reads a register it writes, going round the loop. A lead much shorter than a memory round trip's worth
    of issue is a wait the warp cannot hide (ptxas may place a load late to free its registers)."""
    insns = []
    for line in body:
        m = re.search(r"\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if m:
            insns.append((m.group(1), [o.strip() for o in re.split(r"[,\[\]]", m.group(2)) if o.strip()]))
    leads = []
    for i, (op, operands) in enumerate(insns):
        dest = re.fullmatch(r"R(\d+)", operands[0]) if op.startswith("LDG") and operands else None
        if not dest:
            continue
        width = 4 if ".128" in op else 2 if ".64" in op else 1
        regs = {f"R{r}" for r in range(int(dest.group(1)), int(dest.group(1)) + width)}
        for d in range(1, len(insns) + 1):
            later_op, later = insns[(i + d) % len(insns)]
            reads = later if later_op.startswith(("ST", "RED", "ATOM")) else later[1:]
            if any(o.split(".")[0].split("+")[0] in regs for o in reads):
                leads.append(d)
                break
    return leads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default="tq_paged_decode_kernel")
    ap.add_argument("--preset", default="turboquant_k3v4_nc")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=32, help="query heads (Qwen3-8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads (Qwen3-8B: 8)")
    ap.add_argument("--centred", action="store_true", help="keys stored with key centering (the serving default)")
    ap.add_argument("--linear", metavar="FORMAT", default=None, help="the weight product of tq4 or tq3 instead")
    ap.add_argument("--rows", default="1,8,16", help="with --linear: activation rows, one variant each")
    ap.add_argument("--set", default="", metavar="NAME=INT,...",
                    help="with --linear: launcher constants of ops.linear for a study, e.g. MMA_WORDS_AHEAD=2")
    ap.add_argument("--mla", metavar="PRESET", default=None, help="the MLA decode's tile loop for a latent preset")
    ap.add_argument("--mla-kernel", choices=("wgmma", "mma"), default="wgmma", help="with --mla: which decode kernel")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    scratch = tempfile.mkdtemp(prefix="sass-mix-")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=os.path.join(scratch, "c"))
    if args.linear:
        return linear_main(args, argv, cuobjdump, scratch, env)
    if args.mla:
        return mla_main(args, argv, cuobjdump, scratch, env)
    found = run_child(CHILD, [args.preset, str(args.head_dim), str(args.q_heads), str(args.kv_heads),
                              "1" if args.centred else "0", args.kernel, os.path.join(scratch, "k")], env)
    if not found["cubins"]:
        raise SystemExit(f"the warm-up launches no {args.kernel}; it launches {', '.join(found['kernels'])}")
    variants = [loop_mix(sass_of(cuobjdump, cubin)) for cubin in found["cubins"]]
    args.out.write_text(json.dumps(dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        kernel=args.kernel, preset=args.preset, head_dim=args.head_dim, q_heads=args.q_heads, kv_heads=args.kv_heads,
        centred=args.centred, target="sm_90", variants=variants), indent=1))
    for i, v in enumerate(variants):
        print(f"{args.kernel} variant {i}: loop of {v['instructions']} instructions; pipes {v['pipes']}; "
              f"copies {v['copies']}; ops {dict(list(v['ops'].items())[:10])}")
    return 0


def run_child(script: str, argv: list[str], env: dict) -> dict:
    """Run one of the compile scripts above in a fresh interpreter; its last line of output, as JSON."""
    p = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def sass_of(cuobjdump: str, cubin: str) -> str:
    return subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def linear_main(args, argv, cuobjdump: str, scratch: str, env: dict) -> int:
    """``--linear``: the weight product's loop per activation row count (module docstring)."""
    if args.linear not in WEIGHT_FORMATS:
        raise SystemExit(f"unknown weight format {args.linear!r}; valid: {', '.join(WEIGHT_FORMATS)}")
    out_features, in_features = 24576, 4096  # Qwen3-8B gate_up
    from turboquant_core.ops import linear

    knobs = {}
    for item in filter(None, (t.strip() for t in args.set.split(","))):
        name, _, value = item.partition("=")
        if not name.isupper() or not isinstance(getattr(linear, name, None), (bool, int)):
            raise SystemExit(f"--set {name!r}: not an integer launcher constant of turboquant_core.ops.linear")
        knobs[name] = int(value)
    found = run_child(CHILD_LINEAR, [args.linear, str(out_features), str(in_features), os.path.join(scratch, "k"),
                                     args.rows, json.dumps(knobs)], env)
    variants = []
    for v in found["variants"]:
        mix = loop_mix(sass_of(cuobjdump, v["cubin"]))
        variants.append(dict(rows=v["rows"], kernel=v["kernel"], block_o=v["block_o"], registers=v["registers"],
                             per_weight=mix["instructions"] * v["threads"] / (v["block_o"] * 128), **mix))
    args.out.write_text(json.dumps(dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        format=args.linear, shape=[out_features, in_features], target="sm_90", variants=variants), indent=1))
    for v in variants:
        print(f"{v['kernel']} {args.linear} rows {v['rows']}: {v['registers']} registers, loop of "
              f"{v['instructions']} instructions per group ({v['per_weight']:.2f} per weight); pipes {v['pipes']}; "
              f"copies {v['copies']}; ops {dict(list(v['ops'].items())[:10])}; global loads' leads "
              f"{sorted(v['load_leads'])}")
    return 0


def mla_main(args, argv, cuobjdump: str, scratch: str, env: dict) -> int:
    """``--mla``: the MLA decode kernel's tile loop for one latent preset (module docstring)."""
    found = run_child(CHILD_MLA, [args.mla, args.mla_kernel, os.path.join(scratch, "k")], env)
    if not found["variants"]:
        raise SystemExit(f"{args.mla} launches no tq_mla_decode_{args.mla_kernel}_kernel (its latent is not one "
                         "codebook segment)")
    variants = [dict({k: v[k] for k in ("kernel", "registers", "spill_bytes")}, **loop_mix(sass_of(cuobjdump,
                                                                                                v["cubin"])))
                for v in found["variants"]]
    args.out.write_text(json.dumps(dict(
        command=" ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        preset=args.mla, mla_kernel=args.mla_kernel, heads=16, target="sm_90", variants=variants), indent=1))
    for v in variants:
        print(f"{v['kernel']} {args.mla}: {v['registers']} registers, {v['spill_bytes']} spill bytes, loop of "
              f"{v['instructions']} instructions per tile; pipes {v['pipes']}; copies {v['copies']}; "
              f"ops {dict(list(v['ops'].items())[:10])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

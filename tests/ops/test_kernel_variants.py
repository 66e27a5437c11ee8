# SPDX-License-Identifier: Apache-2.0
"""Which compiled variants the paged kernels need, computed on the CPU for a Hopper target.

Triton compiles one variant per *specialization* of a launch: constexprs, options, and the value class
of every non-constexpr argument (an int == 1 or divisible by 16, a pointer 16-byte aligned or not).
A serving engine must not hit a variant its start-up warm-up (``ops.paged.warmup_kernels``) did not
compile. This test runs the real launchers with CPU tensors in a subprocess where Triton is *not*
interpreted, replaces ``JITFunction.run`` by a probe that computes the specialization key with
Triton's own binder for an sm_90 target (no compilation, no launch), and checks that serving-like
batches (sliced block tables, every token count, short and long cached contexts, odd strides) only
produce keys the warm-up produced, and that the warm-up produces no key they never reach. It also
compiles every warm-up variant to a cubin for sm_90 (Triton's bundled ptxas), which catches code that
the interpreter accepts and the GPU compiler rejects, a variant over the shared-memory limit, and a
store-path variant that spills registers. The MLA kernels (``ops.mla.mla_warmup_kernels``) get the same coverage
check against stores, decode batches and context gathers shaped as vLLM's MLA layer makes them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r'''
import json, sys
import torch
from tests.ops import sm90_probe

MODE = sys.argv[1]
seen = []
compiled = {}


def on_launch(launch):
    seen.append((launch.name, launch.key))
    if MODE == "compile" and launch.key not in compiled:
        compiled[launch.key] = launch.compile()


sm90_probe.install(on_launch)

from turboquant_core.ops import paged_decode
from turboquant_core.ops.paged import TQAttentionPlan, allocate_kv_cache, paged_layout, tq_store, warmup_kernels

paged_decode._gluon_runs = lambda device: True  # plan as on a GPU: decode batches take the register-tile kernels
if "wgmma" in sys.argv[7:]:  # as on an H100 / H200: decode batches the wgmma kernel serves take it
    from turboquant_core.ops import paged_decode_wgmma
    paged_decode_wgmma._sm90 = lambda device: True

fmt, hq, hkv, d, window = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
window = None if window == "none" else int(window)
bs = 16
layout = paged_layout(fmt, head_dim=d, block_size=bs)
cache = allocate_kv_cache(64, hkv, layout)
cent = None
if "center" in sys.argv[7:]:
    from turboquant_core.ops.key_centering import key_centering_tables
    from turboquant_core.ops.paged import new_block_epochs, new_center_sums
    cent = key_centering_tables(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), d, bs, 8192)
    sums = new_center_sums(70, hkv, cent, "cpu")
    # sums kept across steps, as the vLLM backend keeps them: a layer's tags are a slice of one allocation for
    # all layers, at an offset that need not be 16-byte aligned
    kept = dict(center_tags=torch.full((3, 69, hkv, 2), -1, dtype=torch.int32)[1],
                block_epochs=new_block_epochs(64, "cpu"))
# "spec": speculative decoding with 3 draft tokens, verification planned as decode of 4 queries per request
QL = 4 if "spec" in sys.argv[7:] else 1
# "prefill": TQConfig.prefill_from_cache, chunks attend to their own stored tokens (causal over the sequence) and
# never take the context path; the builder's warm-up then compiles the prefill variants instead of the context ones
PREFILL = "prefill" in sys.argv[7:]
# Long chunks of layers without a window read their context as dense rows (the builder's gather workspace).
GATHER = not PREFILL and window is None
warmup_kernels(cache, layout, hq, hkv, dtype=torch.bfloat16, sliding_window=window, centering=cent,
               decode_query_lens=(1, QL) if QL > 1 else (1,),
               paths=("decode", "prefill") if PREFILL else ("decode", "context") + (("gather",) if GATHER else ()))
warm = set(seen)
if MODE == "compile":
    print(json.dumps(dict(compiled=list(compiled.values()))))
    sys.exit(0)

seen.clear()
# Serving-like launches: qkv-shaped query views, a persistent block table with 530 columns whose row
# slices start anywhere, every token count up to 130 for the context path, many batch sizes for decode.
max_blocks, max_tokens = 530, 600
table = torch.zeros(70, max_blocks, dtype=torch.int32)
qkv = torch.zeros(max_tokens, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
query = qkv[:, : hq * d].view(max_tokens, hq, d)
key = qkv[:, hq * d : (hq + hkv) * d].view(max_tokens, hkv, d)
value = qkv[:, (hq + hkv) * d :].view(max_tokens, hkv, d)
output = torch.zeros(max_tokens, hq, d, dtype=torch.bfloat16)
seq = torch.full((70,), 40, dtype=torch.int32)
plan = TQAttentionPlan(layout, hq, hkv, "cpu", workspace_bytes=32 << 20)
cen = {}
for n in (1, 3, 7, 16, 33, 64, 128, 300, 600):  # store: any number of tokens
    if cent is not None:
        reqs = min(n, 5)
        qsl = torch.tensor([0] + [n * (i + 1) // reqs for i in range(reqs)], dtype=torch.int32)
        cen = dict(centering=cent, query_start_loc=qsl, seq_lens=seq[:reqs] + n, block_table=table[:reqs],
                   center_sums=sums, **kept)
    tq_store(key[:n], value[:n], cache, torch.arange(n), layout, **cen)
cen = {} if cent is None else dict(centering=cent)
for reqs in (1, 2, 5, 8, 16, 31, 40, 64):  # decode, including CUDA-graph capture's long max_seq_len
    if cent is not None:  # a decode-only batch's store: sums first, then one pass
        tq_store(key[:reqs], value[:reqs], cache, torch.arange(reqs), layout, centering=cent,
                 query_start_loc=torch.arange(reqs + 1, dtype=torch.int32), seq_lens=seq[:reqs],
                 block_table=table[:reqs], center_sums=sums, single_token_requests=True, **kept)
    # (131072: centred wgmma batches whose centering logits no longer fit the workspace)
    for max_seq in (40, 8192, 131072):
        qsl = torch.arange(reqs + 1, dtype=torch.int32)
        plan.plan(table[:reqs], qsl, seq[:reqs], num_tokens=reqs, max_query_len=1, max_seq_len=max_seq,
                  causal=True, sliding_window=window)
        plan.run(query[:reqs], cache, out=output[:reqs], **cen, **({"center_sums": sums} if cen else {}))
    if QL > 1:  # verification: uniform drafts (CUDA-graph batches) and drafts of every length up to QL - 1
        for lens in ([QL] * reqs, [1 + (i % QL) for i in range(reqs)]):
            qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            ntok = int(qsl[-1])
            if cent is not None:
                tq_store(key[:ntok], value[:ntok], cache, torch.arange(ntok), layout, centering=cent,
                         query_start_loc=qsl, seq_lens=seq[:reqs], block_table=table[:reqs], center_sums=sums,
                         **kept)
            for max_seq in (40, 8192):
                plan.plan(table[:reqs], qsl, seq[:reqs], num_tokens=ntok, max_query_len=QL, max_seq_len=max_seq,
                          causal=True, sliding_window=window)
                plan.run(query[:ntok], cache, out=output[:ntok], **cen, **({"center_sums": sums} if cen else {}))
# Prefill chunks after `first` decode rows (table slices start at row `first`): after no cached context, a short
# one and a long one (a chunk of a long prefill or a prefix hit: the planner splits the KV range). By default the
# chunk's context part (the builder plans none without context); with PREFILL the whole sequence, causal, queries
# planned as at least PREFILL_MIN_QUERY_LEN (as the builder plans them).
from turboquant_core.ops.paged_attention import PREFILL_MIN_QUERY_LEN

for first in (0, 1, 3, 8):
    for ctx_len in (0, 24, 4096):
        for ntok in list(range(1, 131)) + [257, 512]:
            for reqs in (1, 2, 3):
                if ntok < reqs or (ctx_len == 0 and not PREFILL):
                    continue
                qsl = torch.tensor([0] + [ntok * (i + 1) // reqs for i in range(reqs)], dtype=torch.int32)
                q = query[first : first + ntok]
                out = torch.empty(q.shape, dtype=q.dtype)
                longest = int((qsl[1:] - qsl[:-1]).max())
                if PREFILL:
                    kv = torch.full((reqs,), ctx_len + longest, dtype=torch.int32)
                    plan.plan(table[first : first + reqs], qsl, kv, num_tokens=ntok,
                              max_query_len=max(longest, PREFILL_MIN_QUERY_LEN), max_seq_len=ctx_len + longest,
                              causal=True, sliding_window=window)
                else:
                    kv = torch.full((reqs,), ctx_len, dtype=torch.int32)
                    plan.plan(table[first : first + reqs], qsl, kv, num_tokens=ntok, max_query_len=longest,
                              max_seq_len=ctx_len, causal=False, sliding_window=window)
                plan.run(q, cache, out=out, return_lse=not PREFILL, **cen,
                         **({"center_sums": sums[first:]} if cen else {}))
# The gather workspace's leading rows: a step's prefill requests' contexts, then their fresh tokens.
if GATHER:
    from turboquant_core.ops.paged import tq_gather_dequant

    rows_k = torch.empty(4096 * 3 + 600, hkv, d, dtype=torch.bfloat16)
    rows_v = torch.empty_like(rows_k)
    for first in (0, 1, 3, 8):
        for ctx_len in (24, 4096):
            for reqs in (1, 2, 3):
                kv = torch.full((reqs,), ctx_len, dtype=torch.int32)
                cu = torch.arange(reqs + 1, dtype=torch.int32) * (ctx_len + 64)
                tq_gather_dequant(cache, layout, table[first : first + reqs], kv, cu, rows_k[: int(cu[-1])],
                                  rows_v[: int(cu[-1])], max_seq_len=ctx_len, **cen,
                                  **({"center_sums": sums[first:first + reqs]} if cen else {}))
serve = set(seen)
print(json.dumps(dict(warm=sorted(map(list, warm)), missing=sorted(map(list, serve - warm)),
                      unused=sorted(map(list, warm - serve)), kernels=sorted({k for k, _ in serve}))))
'''

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    ("turboquant_k3v4_nc", 32, 8, 128, "none"),  # Qwen3-8B heads
    ("turboquant_4bit_nc", 9, 3, 64, "none"),  # SmolLM2 heads
    ("turboquant_k8v4", 4, 1, 256, "512"),  # Gemma 3 sliding layers
]


def _probe(mode: str, case, *extra: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PROBE, mode, *map(str, case), *extra], env=env, capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# The kernels of the serving path (every batch stores; decode and context attend; a split launch merges).
SERVING_KERNELS = {"tq_paged_store_kernel", "tq_paged_attention_kernel", "tq_merge_splits_kernel"}
# Decode of the formats the register-tile kernel serves (``ops.paged_decode.decode_path_applies``).
DECODE_KERNELS = {"tq_rotate_queries_kernel", "tq_paged_decode_kernel", "tq_merge_unrotate_kernel"}
REGISTER_TILE_CASES = {"turboquant_k3v4_nc", "turboquant_4bit_nc"}  # of CASES (k8v4 has fp8 keys)
GATHER_KERNEL = "tq_paged_gather_dequant_kernel"  # long prefill chunks' context, layers without a window
# Kernels that run once per stored token: a stack frame here (register spills) slows every step down.
STORE_PATH_KERNELS = {"tq_paged_store_kernel", "tq_key_center_sums_kernel"}
DECODE_STACK_BYTES = 8
SM90_SHARED_BYTES = 232448  # H100/H200 limit per block


def _check_coverage(res: dict, kernels: set[str]) -> None:
    assert res["missing"] == [], f"variants compiled only while serving: {res['missing'][:3]}"
    # Warm-up compiles nothing that no serving batch reaches (each variant costs start-up compile time).
    assert res["unused"] == [], f"warm-up variants no serving batch launches: {res['unused'][:3]}"
    # Not vacuous: the probe saw the kernels of the serving path.
    assert set(res["kernels"]) >= kernels


def _check_compiled(res: dict) -> None:
    compiled = res["compiled"]
    assert {c["kernel"] for c in compiled} >= {"tq_paged_store_kernel", "tq_paged_attention_kernel"}
    too_big = [c for c in compiled if c["shared"] > SM90_SHARED_BYTES]
    assert not too_big, f"variants over the sm_90 shared-memory limit: {too_big}"
    spills = [c for c in compiled if c["kernel"] in STORE_PATH_KERNELS and c["stack"] != 0]
    assert not spills, f"store-path variants with a stack frame (spills): {spills}"
    # The centred decode kernel, loading a tile ahead, keeps two loop-invariant words on the stack (ptxas, at any
    # register limit); no more than that.
    spills = [c for c in compiled if c["kernel"] == "tq_paged_decode_kernel" and c["stack"] > DECODE_STACK_BYTES]
    assert not spills, f"register-tile decode variants with more than a {DECODE_STACK_BYTES}-byte stack: {spills}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_warmup_covers_every_serving_variant(case):
    decode = DECODE_KERNELS if case[0] in REGISTER_TILE_CASES else set()
    gather = {GATHER_KERNEL} if case[4] == "none" else set()
    _check_coverage(_probe("keys", case), SERVING_KERNELS | decode | gather)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_warmup_covers_every_centred_serving_variant(case):
    _check_coverage(_probe("keys", case, "center"),
                    SERVING_KERNELS | DECODE_KERNELS | {"tq_key_center_sums_kernel", "tq_center_queries_kernel",
                                                        GATHER_KERNEL})


@pytest.mark.slow
@pytest.mark.parametrize("center", [False, True], ids=["plain", "centred"])
def test_warmup_covers_every_wgmma_serving_variant(center):
    """On an H100 / H200 k3v4 decode at head_dim 128 takes the e4m3 warpgroup-MMA kernel: batches of every size,
    split count (16 at a long context) and table slice run the variants the warm-up compiled (its block table of one
    column and split counts of 1, 2, 9 and 17 once made variants that no serving batch reached)."""
    wgmma = {"tq_rotate_queries_kernel", "tq_paged_decode_wgmma_kernel", "tq_merge_unrotate_kernel"}
    centred = {"tq_key_center_sums_kernel", "tq_center_queries_kernel"} if center else set()
    _check_coverage(_probe("keys", CASES[0], "wgmma", *(("center",) if center else ())),
                    SERVING_KERNELS | wgmma | centred | {GATHER_KERNEL})


@pytest.mark.slow
@pytest.mark.parametrize("case,center", [(CASES[0], True), (CASES[1], False), (CASES[2], False)],
                         ids=["k3v4-centred", "4bit", "k8v4-window"])
def test_warmup_covers_speculative_verification(case, center):
    """With speculative decoding, verification batches (1 + 3 draft tokens per request, uniform or not) run
    as decode; the warm-up given those query lengths compiles what they launch."""
    extra = ("spec", "center") if center else ("spec",)
    kernels = SERVING_KERNELS | (DECODE_KERNELS if case[0] in REGISTER_TILE_CASES else set())
    _check_coverage(_probe("keys", case, *extra), kernels)


@pytest.mark.slow
@pytest.mark.parametrize("case,center", [(CASES[0], True), (CASES[1], False), (CASES[2], False)],
                         ids=["k3v4-centred", "4bit", "k8v4-window"])
def test_warmup_covers_prefill_from_cache(case, center):
    """With TQConfig.prefill_from_cache, prefill chunks of every length (after short and long cached contexts, in
    tables that start at any row) run only variants the warm-up compiled."""
    extra = ("prefill", "center") if center else ("prefill",)
    kernels = SERVING_KERNELS | (DECODE_KERNELS if case[0] in REGISTER_TILE_CASES else set())
    _check_coverage(_probe("keys", case, *extra), kernels)


@pytest.mark.slow
def test_verification_and_prefill_from_cache_variants_compile_for_sm90():
    _check_compiled(_probe("compile", CASES[0], "center", "spec", "prefill"))


@pytest.mark.slow
def test_centred_warmup_variants_compile_for_sm90():
    _check_compiled(_probe("compile", CASES[0], "center"))


@pytest.mark.slow
def test_warmup_variants_compile_for_sm90():
    _check_compiled(_probe("compile", CASES[0]))


@pytest.mark.slow
def test_fp8_key_store_compiles_without_spills_for_sm90():
    """fp8 keys + 4-bit values at head_dim 128: an encoder variant that held the rotation rows of 8 products
    as register operands took this store kernel to 255 registers and a 112-byte spill stack on sm_90
    (25 % slower on an H100)."""
    _check_compiled(_probe("compile", ("turboquant_k8v4", 32, 8, 128, "none")))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["turboquant_3p5bit_nc", "turboquant_2p5bit_nc"])
def test_two_segment_formats_at_head_dim_64_compile_for_sm90(fmt):
    """Two 32-wide segments (head_dim 64) in a 64-row block make Triton 3.6's dot-operand pass fail or
    miscompile into illegal addresses (SmolLM2, GQA group 3). The planner keeps such formats at <= 32 rows;
    this compiles every warm-up variant (decode and every context shape)."""
    _check_compiled(_probe("compile", (fmt, 9, 3, 64, "none")))


# ---- MLA latent caches: ops.mla.mla_warmup_kernels against serving-like launches

MLA_PROBE = r'''
import json, sys
import torch
from tests.ops import sm90_probe

seen = []
sm90_probe.install(lambda launch: seen.append((launch.name, launch.key)))

from turboquant_core.ops import mla as mla_ops
from turboquant_core.ops.mla_layout import allocate_mla_cache, mla_paged_layout

fmt, kernel = sys.argv[1], sys.argv[2]
mla_ops._gluon_runs = lambda device: kernel != "triton"  # plan as on a GPU of that kind
mla_ops._sm90 = lambda device: kernel == "wgmma"
heads, lr, r, bs = 16, 512, 64, 16
lay = mla_paged_layout(fmt, bs)
cache = allocate_mla_cache(64, lay)
mla_ops.mla_warmup_kernels(cache, lay, torch.bfloat16, heads, 0.1, rotated=kernel != "triton")
warm = set(seen)
seen.clear()
# Serving-like launches, in vLLM's tensors: kv_c the normed latent rows, k_pe a view of the kv_a projection's output,
# slot mappings and block tables slices of persistent buffers, the absorbed queries a transposed bmm output and q_pe a
# view of the queries, the prefill context in rows of the chunked-context workspace, its offsets rows of 2-D tables.
most = 8192 + 7
kv_a = torch.zeros(most, lr + r, dtype=torch.bfloat16)
kv_c = torch.zeros(most, lr, dtype=torch.bfloat16)
slot_buf = torch.full((most,), -1, dtype=torch.int64)
for n in (1, 3, 7, 16, 33, 64, 255, 256, 257, 300, 1016, 8192, 8199):
    mla_ops.mla_store(kv_c[:n], kv_a[:n, lr:], cache, slot_buf[:n], lay)
table = torch.zeros(300, 160, dtype=torch.int32)
seq = torch.full((300,), 40, dtype=torch.int32)
for b in (1, 2, 3, 5, 8, 16, 31, 64, 128, 257):
    ql = torch.zeros(heads, b, lr, dtype=torch.bfloat16).transpose(0, 1)
    q_pe = torch.zeros(b, heads, 128 + r, dtype=torch.bfloat16)[..., 128:]
    for first in (0, 1, 3):
        for splits in (1, 2, 3, 5, 8, 13, 16, 20, 33, 64):
            mla_ops.mla_decode_attention(ql, q_pe, cache, lay, table[first: first + b], seq[first: first + b], 0.1,
                                         num_splits=splits, rotated=kernel != "triton")
workspace = torch.empty(8192 * 2, lr + r, dtype=torch.bfloat16)
for chunks, n in ((1, 1), (2, 5), (1, 16), (3, 17), (2, 1016), (1, 8192)):
    cu = torch.zeros(chunks, 4, dtype=torch.int32)
    cu[:, 1:] = n
    to_seq = torch.zeros(chunks, n, dtype=torch.int32)
    starts = torch.zeros(chunks, 3, dtype=torch.int32)
    for i in range(chunks):
        mla_ops.mla_gather_dequant(cache, lay, workspace, table[1:4], cu[i], to_seq[i], n, seq_starts=starts[i])
serve = set(seen)
print(json.dumps(dict(missing=sorted(map(list, serve - warm)), unused=sorted(map(list, warm - serve)),
                      kernels=sorted({k for k, _ in serve}))))
'''

MLA_SERVING_KERNELS = {"tq_mla_store_kernel", "tq_mla_store_finish_kernel", "tq_merge_splits_kernel",
                       "tq_mla_gather_kernel"}
MLA_DECODE_KERNELS = {"wgmma": "tq_mla_decode_wgmma_kernel", "mma": "tq_mla_decode_mma_kernel",
                      "triton": "tq_mla_decode_kernel"}


@pytest.mark.slow
@pytest.mark.parametrize("fmt,kernel", [("turboquant_k3v4_nc", "wgmma"), ("turboquant_4bit_nc", "mma"),
                                        ("turboquant_k8v4", "triton")])
def test_mla_warmup_covers_every_serving_variant(fmt, kernel):
    """The MLA warm-up compiles every variant that stores of any token count, decode batches of any size, table
    slice and split count (on an H100 / H200 the warpgroup-MMA kernel, on other GPUs the register-tile kernel,
    fp8 latents the Triton kernel) and context gathers of any chunk launch, and nothing they never reach."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", MLA_PROBE, fmt, kernel], env=env, capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    if p.returncode != 0:
        pytest.fail(f"probe failed:\n{p.stderr[-4000:]}")
    _check_coverage(json.loads(p.stdout.strip().splitlines()[-1]),
                    MLA_SERVING_KERNELS | {MLA_DECODE_KERNELS[kernel]})

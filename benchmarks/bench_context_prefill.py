#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prefill chunks over cached context through the vLLM backend (``turboquant_core.vllm.backend``): the two paths
a chunk can take, timed per layer on one GPU, Qwen3-8B heads (32 query / 8 KV heads, head_dim 128, pages of 16),
keys centred as served.

- ``kernel``: the fresh tokens by FlashAttention, the context by the compressed kernel, merged by log-sum-exp;
- ``gather``: the context dequantized next to the fresh K/V, one causal FlashAttention pass;
- ``bf16``: FlashAttention over the same lengths from dense bf16 rows (what the bf16 cache's prefill costs,
  without its paged reads).

    python benchmarks/bench_context_prefill.py --cases 1x8192x16 1x8192x64 1x32768x8192 --out prefill.json

Each case is REQUESTSxCONTEXTxCHUNK. Needs CUDA and vLLM 0.26.0 patched by scripts/patches.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_paged_attention import build_batch, time_ms  # noqa: E402
from turboquant_core.formats import get_format  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.paged import new_center_sums, tq_key_center_sums  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
MAX_ROWS = 1 << 16  # TQAttentionMetadataBuilder.CONTEXT_GATHER_MAX_ROWS (not imported: that needs vLLM)


def parse_case(text: str) -> tuple[int, int, int]:
    try:
        reqs, context, chunk = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bad case {text!r}: expected REQUESTSxCONTEXTxCHUNK, e.g. 1x8192x1024") from None
    rows = reqs * (context + chunk)
    if min(reqs, context, chunk) < 1 or rows > MAX_ROWS:
        raise SystemExit(f"bad case {text!r}: needs requests, context and chunk >= 1 and at most {MAX_ROWS} rows "
                         f"(the backend's dense-row workspace); got {rows}")
    return reqs, context, chunk


def run_case(fmt: str, reqs: int, context: int, chunk: int) -> dict:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    from turboquant_core.vllm import backend

    dev = "cuda"
    b = build_batch(fmt, reqs, context + chunk, hq=HQ, hkv=HKV, d=D, block_size=PAGE, device=dev, keep_dense=False)
    cache, bt = b["cache"], b["block_table"]
    theta = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cent = key_centering_tables(theta, D, PAGE, context + chunk + PAGE, device=dev)
    ctx_lens = torch.full((reqs,), context, dtype=torch.int32, device=dev)
    sums = new_center_sums(reqs, HKV, cent, dev)
    tq_key_center_sums(cache, b["layout"], cent, bt, ctx_lens, sums)

    impl = backend.TQAttentionImpl(HQ, D, D ** -0.5, HKV, None, None, fmt)
    impl.key_centering = cent
    layer = SimpleNamespace(impl=impl, layer_name="layers.0.attn")
    config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=fmt),
        # a max_model_len that sizes the builder's dense-row workspace for all the case's rows
        model_config=SimpleNamespace(max_model_len=reqs * (context + chunk), dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1), speculative_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=max(reqs, 8), max_num_batched_tokens=max(8192, reqs * chunk)),
        compilation_config=SimpleNamespace(static_forward_context={"layers.0.attn": layer}))
    spec = TQFullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, head_size_v=D, dtype=torch.uint8,
                               tq_slot_size=get_format(fmt).bytes_per_token_per_head(D))
    n = reqs * chunk
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * chunk
    seq = torch.full((reqs,), context + chunk, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev), num_reqs=reqs,
        num_actual_tokens=n, max_query_len=chunk, max_seq_len=context + chunk, block_table_tensor=bt,
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev), seq_lens_cpu_upper_bound=seq)
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    row = dict(format=fmt, requests=reqs, context=context, chunk=chunk)
    for path, threshold in (("kernel", 1 << 30), ("gather", 1)):
        builder_cls = backend.TQAttentionMetadataBuilder
        saved = builder_cls.CONTEXT_GATHER_MIN_QUERY_LEN
        builder_cls.CONTEXT_GATHER_MIN_QUERY_LEN = threshold
        try:
            builder = builder_cls(spec, ["layers.0.attn"], config, torch.device(dev))
            md = builder.build(0, cam)
        finally:
            builder_cls.CONTEXT_GATHER_MIN_QUERY_LEN = saved
        assert (md.context_gather is not None) == (path == "gather")
        md.center_sums[:reqs] = sums
        row[f"{path}_ms"] = time_ms(lambda md=md: impl.forward(layer, q, k, v, cache, md, output=out))
        del builder, md
        torch.cuda.empty_cache()
    kd = torch.randn(reqs * (context + chunk), HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    cu_k = torch.arange(reqs + 1, dtype=torch.int32, device=dev) * (context + chunk)
    cu_q = qsl.to(dev)
    row["bf16_ms"] = time_ms(lambda: flash_attn_varlen_func(
        q=q, k=kd, v=kd, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=chunk, max_seqlen_k=context + chunk,
        softmax_scale=D ** -0.5, causal=True, out=out, fa_version=impl.fa_version))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", nargs="+", default=["turboquant_k3v4_nc"])
    ap.add_argument("--cases", nargs="+", required=True, help="REQUESTSxCONTEXTxCHUNK")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("timing needs a CUDA device")
    rows = []
    for fmt in args.formats:
        for case in args.cases:
            row = run_case(fmt, *parse_case(case))
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.write_text(json.dumps(dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), device=torch.cuda.get_device_name(),
        torch=torch.__version__, command="python benchmarks/bench_context_prefill.py " + " ".join(argv or sys.argv[1:]),
        rows=rows), indent=1))
    print("| format | requests x context x chunk | compressed kernel ms | gather + FlashAttention ms | bf16 rows ms |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['requests']} x {r['context']} x {r['chunk']} | {r['kernel_ms']:.3f} | "
              f"{r['gather_ms']:.3f} | {r['bf16_ms']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

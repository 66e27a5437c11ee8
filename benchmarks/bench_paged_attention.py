# SPDX-License-Identifier: Apache-2.0
"""Microbenchmark of the paged TurboQuant kernels on one GPU (torch + triton + this repo only).

Decode attention (one query per request) over a paged TurboQuant cache, Qwen3-8B head geometry
(32 query heads, 8 KV heads, head_dim 128, block size 16), against bf16 attention over the same
dense K/V with torch SDPA (and FlashAttention 3 when ``flash_attn_interface`` or
``vllm.vllm_flash_attn`` imports). Reports time, effective GB/s of compressed bytes read vs the
device's copy bandwidth, speed-up vs bf16, and the store kernel's time for 64k tokens.

    python benchmarks/bench_paged_attention.py --out results.json
    python benchmarks/bench_paged_attention.py --check          # GPU correctness vs the references

One failing configuration is recorded and skipped; the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turboquant_core.ops import paged_decode  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged import (  # noqa: E402
    TQAttentionConfig,
    TQAttentionPlan,
    allocate_kv_cache,
    merge_attn_states,
    paged_layout,
    tq_gather_dequant,
    tq_gather_dequant_ref,
    tq_paged_attention,
    tq_paged_attention_ref,
    tq_store,
    tq_store_ref,
)

DEFAULT_PRESETS = ("turboquant_k3v4_nc", "turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4",
                   "turboquant_2bit_nc")
DEFAULT_CASES = ((64, 1280), (32, 8448), (8, 32768))


def log(*a):
    print(*a, flush=True)


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written."""
    import triton.testing

    n = 1 << 28  # 1 GiB of fp32
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def build_batch(fmt, batch, context, hq=32, hkv=8, d=128, block_size=16, device="cuda", seed=0,
                keep_dense=True):
    """Random K/V stored through tq_store into a fragmented page pool; returns the pieces."""
    g = torch.Generator(device=device).manual_seed(seed)
    lay = paged_layout(fmt, d, block_size)
    blocks_per_req = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_req + 1
    cache = allocate_kv_cache(num_blocks, hkv, lay, device)
    perm = torch.randperm(num_blocks - 1, device=device, generator=g) + 1
    block_table = perm[: batch * blocks_per_req].view(batch, blocks_per_req).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    k_dense = torch.empty(batch, hkv, context, d, dtype=torch.bfloat16, device=device) if keep_dense else None
    v_dense = torch.empty_like(k_dense) if keep_dense else None
    chunk = max(1, (1 << 16) // context)
    for r0 in range(0, batch, chunk):
        r1 = min(batch, r0 + chunk)
        n = (r1 - r0) * context
        k = torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
        t = torch.arange(context, device=device).repeat(r1 - r0)
        r = torch.arange(r0, r1, device=device).repeat_interleave(context)
        slots = block_table[r, t // block_size].long() * block_size + t % block_size
        tq_store(k, v, cache, slots, lay)
        if keep_dense:
            k_dense[r0:r1] = k.view(r1 - r0, context, hkv, d).transpose(1, 2)
            v_dense[r0:r1] = v.view(r1 - r0, context, hkv, d).transpose(1, 2)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16, generator=g)
    return dict(layout=lay, cache=cache, block_table=block_table, seq_lens=seq_lens, qsl=qsl, q=q,
                k_dense=k_dense, v_dense=v_dense)


def time_ms(fn, graph=False):
    import triton.testing

    if graph:
        fn()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            fn()
        return triton.testing.do_bench(gr.replay, warmup=25, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def find_fa3():
    for mod, name in (("flash_attn_interface", "flash_attn_with_kvcache"),
                      ("vllm.vllm_flash_attn", "flash_attn_with_kvcache")):
        try:
            m = __import__(mod, fromlist=[name])
            return mod, getattr(m, name)
        except Exception:  # noqa: BLE001 - optional dependency, any import failure means "absent"
            continue
    return None, None


def bench_baselines(b, batch, context, results_row):
    q = b["q"]
    qs = q.view(batch, 32, 1, 128)
    kd, vd = b["k_dense"], b["v_dense"]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, kd, vd, enable_gqa=True)

    try:
        results_row["sdpa_bf16_ms"] = time_ms(sdpa)
    except Exception as e:  # noqa: BLE001
        results_row["sdpa_bf16_error"] = repr(e)
    mod, fa = find_fa3()
    if fa is not None:
        try:
            kc = kd.transpose(1, 2).contiguous()  # [B, L, Hkv, d]
            vc = vd.transpose(1, 2).contiguous()
            cache_seqlens = b["seq_lens"]
            qf = q.view(batch, 1, 32, 128)
            results_row["fa3_bf16_ms"] = time_ms(lambda: fa(qf, kc, vc, cache_seqlens=cache_seqlens, causal=True))
            results_row["fa3_module"] = mod
            del kc, vc
        except Exception as e:  # noqa: BLE001
            results_row["fa3_error"] = repr(e)


def bench_decode(args, out_rows, bw):
    dev = "cuda"
    configs = [None]
    if args.sweep:
        configs = [TQAttentionConfig(**c) for c in json.loads(args.sweep)]
    for batch, context in args.cases:
        baseline_done = {}
        for fmt in args.presets:
            log(f"[decode] batch={batch} context={context} {fmt} ...")
            try:
                b = build_batch(fmt, batch, context, device=dev, keep_dense=not args.no_baseline)
            except Exception as e:  # noqa: BLE001
                log("  build failed:", repr(e))
                out_rows.append(dict(kind="decode", batch=batch, context=context, preset=fmt, error=repr(e)))
                continue
            lay = b["layout"]
            kv_bytes = batch * context * 8 * lay.fmt.bytes_per_token_per_head(128)
            bf16_bytes = batch * context * 8 * 128 * 2 * 2
            if not args.no_baseline and not baseline_done:
                bench_baselines(b, batch, context, baseline_done)
                log("  baselines:", {k: v for k, v in baseline_done.items()})
            runs = [(c, k, bn) for c in configs for k in args.decode_kernels
                    for bn in (args.decode_block_ns if k in ("auto", "register-tile") else [None])]
            for cfg, kernel, bn in runs:
                if bn:
                    paged_decode.DECODE_BLOCK_N = bn
                row = dict(kind="decode", batch=batch, context=context, preset=fmt, kv_bytes=kv_bytes,
                           bf16_bytes=bf16_bytes, copy_bw_gbs=bw, **baseline_done)
                try:
                    if kernel in ("wgmma", "register-tile"):
                        cfg = dataclasses.replace(cfg or TQAttentionConfig(), decode_kernel=kernel)
                    plan = TQAttentionPlan(lay, 32, 8, dev, config=cfg)
                    plan.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1,
                              max_seq_len=context, num_splits=args.num_splits)
                    if kernel == "triton":
                        plan.decode_splits = 0  # the Triton kernel, which the plan uses where the other does not apply
                    out = torch.empty_like(b["q"])
                    row.update(config=repr(plan.config), num_splits=plan.decode_splits or plan.num_splits,
                               decode_kernel=plan.decode_kernel if plan.decode_splits else "triton",
                               decode_block_n=(paged_decode.DECODE_BLOCK_N if plan.decode_kernel == "register-tile"
                                               and plan.decode_splits else None),
                               block_m=plan.block_m, block_n=plan.block_n, num_warps=plan.num_warps,
                               maxnreg=plan.maxnreg)

                    cent = {}
                    if args.centering:
                        # Qwen3-8B's RoPE; the sums' values do not change the time (the keys were stored plain)
                        c = key_centering_tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128,
                                                 lay.block_size, context, device=dev)
                        sums = new_center_sums(batch, 8, c, dev).normal_()
                        cent = dict(centering=c, center_sums=sums)
                        row["key_centering"] = True

                    def run(plan=plan, out=out, q=b["q"], cache=b["cache"], cent=cent):
                        plan.run(q, cache, out=out, **cent)

                    t0 = time.time()
                    run()
                    torch.cuda.synchronize()
                    row["first_call_s"] = time.time() - t0
                    row.update(kernel_stats(plan, args.inspect, f"{fmt}_{batch}x{context}"))
                    ms = time_ms(run)
                    row["tq_ms"] = ms
                    row["tq_gbs"] = kv_bytes / (ms * 1e-3) / 1e9
                    row["frac_of_copy_bw"] = row["tq_gbs"] / bw
                    if args.graphs:
                        row["tq_graph_ms"] = time_ms(run, graph=True)
                    for base in ("sdpa_bf16_ms", "fa3_bf16_ms"):
                        if base in row:
                            row["speedup_vs_" + base[:-3]] = row[base] / ms
                    log("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                               if k not in ("kind",)})
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)
                    log("  FAILED:", repr(e))
                    traceback.print_exc()
                out_rows.append(row)
            del b
            torch.cuda.empty_cache()


def kernel_stats(plan, dump_dir, tag) -> dict:
    """Registers, spills, shared memory and layout conversions of the compiled attention kernel."""
    k = getattr(plan, "last_compiled", None)
    if k is None:
        return {}
    out = {}
    for name in ("n_regs", "n_spills"):
        if hasattr(k, name):
            out[name] = getattr(k, name)
    meta = getattr(k, "metadata", None)
    if meta is not None and hasattr(meta, "shared"):
        out["shared_bytes"] = meta.shared
    ttgir = k.asm.get("ttgir", "") if hasattr(k, "asm") else ""
    out["convert_layouts"] = ttgir.count("convert_layout")
    out["local_allocs"] = ttgir.count("local_alloc")
    if dump_dir:
        d = Path(dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{tag}.ttgir").write_text(ttgir)
        if "cubin" in k.asm:
            (d / f"{tag}.cubin").write_bytes(k.asm["cubin"])
    return out


def _context_prefill_row(fmt, batch, context, chunk, row):
    dev = "cuda"
    b = build_batch(fmt, batch, context, device=dev, keep_dense=False)
    lay, cache, bt, sl = b["layout"], b["cache"], b["block_table"], b["seq_lens"]
    q = torch.randn(batch * chunk, 32, 128, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=dev)
    plan = TQAttentionPlan(lay, 32, 8, dev)
    plan.plan(bt, qsl, sl, num_tokens=batch * chunk, max_query_len=chunk, max_seq_len=context, causal=False)
    out = torch.empty_like(q)
    row["tq_ms"] = time_ms(lambda: plan.run(q, cache, out=out, return_lse=True))
    cu = torch.arange(0, batch * context + 1, context, dtype=torch.int32, device=dev)
    kd = torch.empty(batch * context, 8, 128, device=dev, dtype=torch.bfloat16)
    vd = torch.empty_like(kd)
    row["gather_dequant_ms"] = time_ms(
        lambda: tq_gather_dequant(cache, lay, bt, sl, cu, kd, vd, max_seq_len=context))
    qs = q.view(batch, chunk, 32, 128).transpose(1, 2)
    ks = kd.view(batch, context, 8, 128).transpose(1, 2)
    vs = vd.view(batch, context, 8, 128).transpose(1, 2)
    row["sdpa_bf16_ms"] = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs,
                                                                                              enable_gqa=True))


def bench_context_prefill(args, out_rows):
    """Context part of a chunked prefill: each request's chunk of queries over its cached prefix
    (non-causal, with lse), vs dequantizing the prefix to bf16 (tq_gather_dequant) + SDPA."""
    batch, context, chunk = 4, 8192, 512
    for fmt in args.presets[:2]:
        row = dict(kind="context_prefill", preset=fmt, batch=batch, context=context, chunk=chunk)
        try:
            _context_prefill_row(fmt, batch, context, chunk, row)
            log(f"[context prefill] {fmt}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k.endswith("ms")))
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
            log("  FAILED:", repr(e))
        out_rows.append(row)
        torch.cuda.empty_cache()


def bench_store(args, out_rows):
    dev = "cuda"
    n = 1 << 16
    for fmt in args.presets:
        row = dict(kind="store", preset=fmt, tokens=n, kv_heads=8, head_dim=128)
        try:
            lay = paged_layout(fmt, 128, 16)
            nb = n // 16 + 1
            cache = allocate_kv_cache(nb, 8, lay, dev)
            k = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16)
            slots = torch.randperm(nb * 16 - 16, device=dev)[:n] + 16
            ms = time_ms(lambda k=k, v=v, cache=cache, slots=slots, lay=lay: tq_store(k, v, cache, slots, lay))
            row["store_ms"] = ms
            row["bf16_read_gbs"] = 2 * k.numel() * 2 / (ms * 1e-3) / 1e9
            log(f"[store] {fmt}: {ms:.4f} ms for {n} tokens x 8 heads")
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
            log("  FAILED:", repr(e))
        out_rows.append(row)


# ----------------------------------------------------------------------------------------------
# --check: the unit tests' shapes on the GPU against the references
# ----------------------------------------------------------------------------------------------


def _paged_setup(fmt, d, hkv, group, seq_lens, nq, block_size=16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    lay = paged_layout(fmt, d, block_size)
    r = len(seq_lens)
    maxb = max(-(-s // block_size) for s in seq_lens) + 1
    nb = r * maxb + 3
    perm = torch.randperm(nb, device=device, generator=g)
    bt = perm[: r * maxb].view(r, maxb).to(torch.int32).contiguous()
    cache = torch.randint(0, 256, (nb, hkv, lay.head_page_bytes), dtype=torch.uint8, device=device,
                          generator=g)
    for i, s in enumerate(seq_lens):
        t = torch.arange(s, device=device)
        slots = bt[i, t // block_size].long() * block_size + t % block_size
        k = torch.randn(s, hkv, d, device=device, generator=g) * 1.5
        v = torch.randn(s, hkv, d, device=device, generator=g)
        tq_store(k.bfloat16(), v.bfloat16(), cache, slots, lay)
    qsl = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), hkv * group, d, device=device, generator=g).bfloat16()
    return lay, cache, bt, qsl, torch.tensor(seq_lens, dtype=torch.int32, device=device), q


def run_checks(out_rows) -> int:
    dev = "cuda"
    failures = 0
    from turboquant_core.formats import format_names

    def record(name, ok, **info):
        nonlocal failures
        failures += 0 if ok else 1
        out_rows.append(dict(kind="check", name=name, ok=bool(ok), **info))
        log(("  ok   " if ok else "  FAIL ") + name, {k: v for k, v in info.items()})

    # store vs reference (all presets, d in 64/128/256); compare decoded vectors (bytes may differ
    # only at decision boundaries).
    for fmt in format_names():
        for d in (64, 128, 256):
            try:
                lay = paged_layout(fmt, d, 16)
                n, hkv = 301, 3
                k = torch.randn(n, hkv, d, device=dev).bfloat16()
                v = torch.randn(n, hkv, d, device=dev).bfloat16()
                nb = n // 16 + 4
                slots = torch.randperm(nb * 16, device=dev)[:n]
                slots[::7] = -1
                c1 = torch.randint(0, 256, (nb, hkv, lay.head_page_bytes), dtype=torch.uint8, device=dev)
                c2 = c1.clone()
                tq_store(k, v, c1, slots, lay)
                tq_store_ref(k, v, c2, slots, lay)
                frac = (c1 != c2).float().mean().item()
                record(f"store {fmt} d={d}", frac < 1e-3, mismatched_byte_fraction=frac)
            except Exception as e:  # noqa: BLE001
                record(f"store {fmt} d={d}", False, error=repr(e))

    cases = []
    i = 0
    for fmt in ("turboquant_k3v4_nc", "turboquant_k8v4", "turboquant_2p5bit_nc", "turboquant_4bit_nc"):
        for d in (64, 128, 256, 96):
            for causal, nq in ((True, [1, 1, 1]), (False, [3, 1, 7]), (True, [2, 4, 1])):
                i += 1
                cases.append((fmt, d, (1, 3, 4)[i % 3], causal, nq, (None, 40)[i % 2], (1, 4)[(i // 2) % 2]))
    for fmt, d, group, causal, nq, window, splits in cases:
        if True:
            if True:
                if True:
                    name = f"attn {fmt} d={d} gqa={group} causal={causal} nq={nq} window={window} splits={splits}"
                    try:
                        lay, cache, bt, qsl, sl, q = _paged_setup(fmt, d, 2, group, [1, 17, 100], nq)
                        out, lse = tq_paged_attention(q, cache, lay, bt, qsl, sl, max_query_len=max(nq),
                                                      max_seq_len=100, causal=causal, sliding_window=window,
                                                      return_lse=True, num_splits=splits)
                        ro, rl = tq_paged_attention_ref(q, cache, lay, bt, qsl, sl, causal=causal,
                                                        sliding_window=window)
                        err_o = (out.float() - ro.float()).abs().max().item()
                        fin = torch.isfinite(rl)
                        err_l = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
                        same_inf = torch.equal(torch.isfinite(lse), fin)
                        record(name, err_o < 3e-2 and err_l < 2e-3 and same_inf, err_out=err_o, err_lse=err_l)
                    except Exception as e:  # noqa: BLE001
                        record(name, False, error=repr(e))

    # merge: context part (non-causal over cached prefix) + fresh part == attention over the union
    try:
        fmt, d = "turboquant_k3v4_nc", 128
        lay, cache, bt, qsl, sl, q = _paged_setup(fmt, d, 2, 4, [40, 70], [6, 6])
        ctx = torch.tensor([30, 50], dtype=torch.int32, device=dev)
        o1, l1 = tq_paged_attention(q, cache, lay, bt, qsl, ctx, max_query_len=6, max_seq_len=70, causal=False,
                                    return_lse=True)
        # fresh part: the chunk's own tokens, causal, from the same cache (positions ctx .. ctx+5)
        o2, l2 = _fresh_part_ref(q, cache, lay, bt, qsl, ctx)
        om, lm = merge_attn_states(o1, l1, o2, l2)
        seq = ctx + 6
        ro, rl = tq_paged_attention_ref(q, cache, lay, bt, qsl, seq, causal=True)
        err = (om.float() - ro.float()).abs().max().item()
        record("merge_attn_states", err < 3e-2 and (lm - rl).abs().max().item() < 2e-3, err_out=err)
    except Exception as e:  # noqa: BLE001
        record("merge_attn_states", False, error=repr(e))

    # gather-dequant vs reference
    for fmt in ("turboquant_k3v4_nc", "turboquant_k8v4", "turboquant_3p5bit_nc"):
        try:
            lay, cache, bt, qsl, sl, q = _paged_setup(fmt, 128, 2, 1, [1, 17, 100], [1, 1, 1])
            cu = torch.zeros(4, dtype=torch.int32, device=dev)
            cu[1:] = sl.cumsum(0)
            ok = torch.empty(118, 2, 128, device=dev, dtype=torch.float32)
            ov = torch.empty_like(ok)
            tq_gather_dequant(cache, lay, bt, sl, cu, ok, ov, max_seq_len=100)
            rk, rv = tq_gather_dequant_ref(cache, lay, bt, sl)
            e = max((ok - rk).abs().max().item(), (ov - rv).abs().max().item())
            record(f"gather_dequant {fmt}", e < 1e-3, err=e)
        except Exception as e:  # noqa: BLE001
            record(f"gather_dequant {fmt}", False, error=repr(e))
    return failures


def _fresh_part_ref(q, cache, lay, bt, qsl, ctx):
    """Attention of each chunk query over the chunk tokens at positions >= ctx (causal), via the
    reference on a shifted block table view: tokens [ctx, ctx+nq) of each request."""
    from turboquant_core.ops.paged import dequant_cached_ref

    tq, hq, d = q.shape
    hkv = cache.shape[1]
    out = torch.zeros(tq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64, device=q.device)
    for r in range(bt.shape[0]):
        q0, q1, c = int(qsl[r]), int(qsl[r + 1]), int(ctx[r])
        k, v = dequant_cached_ref(cache, lay, bt[r], c + (q1 - q0))
        k = k[c:].double().repeat_interleave(hq // hkv, 1)
        v = v[c:].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) / math.sqrt(d)
        n = q1 - q0
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)[None], float("-inf"))
        lr = torch.logsumexp(s, -1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        lse[:, q0:q1] = lr
    return out.to(q.dtype), lse.float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_paged_attention.json"))
    ap.add_argument("--check", action="store_true", help="run correctness checks vs the references and exit")
    ap.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    ap.add_argument("--cases", nargs="+", default=[f"{b}x{c}" for b, c in DEFAULT_CASES],
                    help="batch x context pairs, e.g. 64x1280")
    ap.add_argument("--graphs", action="store_true", help="also time CUDA-graph replay")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bf16 SDPA / FA3 baselines")
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument("--no-prefill", action="store_true", help="skip the context-prefill timing")
    ap.add_argument("--num-splits", type=int, default=None, help="force the split count (default: heuristic)")
    ap.add_argument("--decode-kernels", default="auto",
                    help="comma-separated: auto (what TQAttentionPlan picks by default), register-tile (that kernel "
                         "where it applies), wgmma (the e4m3 warpgroup-MMA kernel where it applies: sm_90, k3v4, "
                         "head_dim 128), triton (the Triton kernel)")
    ap.add_argument("--decode-block-ns", default=str(paged_decode.DECODE_BLOCK_N),
                    help="comma-separated tokens per tile of the register-tile kernel (paged_decode.DECODE_BLOCK_N)")
    ap.add_argument("--wgmma-maxnreg", type=int, default=None,
                    help="register cap of the wgmma decode kernel (paged_decode_wgmma.WGMMA_MAXNREG; 0: none)")
    ap.add_argument("--centering", action="store_true",
                    help="decode as from a cache stored with key centering (the page centres' score terms)")
    ap.add_argument("--inspect", default=None, help="directory to dump the attention kernel's TTGIR into")
    ap.add_argument("--sweep", default=None,
                    help='JSON list of TQAttentionConfig kwargs to compare, e.g. [{"block_n":64,"num_warps":4}]')
    args = ap.parse_args(argv)
    args.cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.cases]
    args.decode_kernels = [k.strip() for k in args.decode_kernels.split(",")]
    args.decode_block_ns = [int(v) for v in args.decode_block_ns.split(",")]
    if args.wgmma_maxnreg is not None:
        from turboquant_core.ops import paged_decode_wgmma

        paged_decode_wgmma.WGMMA_MAXNREG = args.wgmma_maxnreg
    if bad := [k for k in args.decode_kernels if k not in ("auto", "register-tile", "wgmma", "triton")]:
        ap.error(f"unknown decode kernel {bad[0]!r}; choose from auto, register-tile, wgmma, triton")
    if not torch.cuda.is_available():
        log("needs a CUDA device")
        return 2
    torch.manual_seed(0)
    rows: list[dict] = []
    props = torch.cuda.get_device_properties(0)
    meta = dict(device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__)
    import triton

    meta["triton"] = triton.__version__
    log("device:", meta)
    if args.check:
        failures = run_checks(rows)
        meta["check_failures"] = failures
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        log(f"checks done: {failures} failures of {len(rows)}")
        return 1 if failures else 0
    bw = copy_bandwidth_gbs("cuda")
    meta["copy_bw_gbs"] = bw
    log(f"copy bandwidth (read+write): {bw:.0f} GB/s")
    bench_decode(args, rows, bw)
    if not args.no_store:
        bench_store(args, rows)
    if not args.no_prefill:
        bench_context_prefill(args, rows)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    log("\nsummary (decode):")
    log(f"{'case':>12} {'preset':>22} {'tq ms':>8} {'graph':>8} {'GB/s':>7} {'%bw':>5} {'sdpa':>8} {'fa3':>8} "
        f"{'x sdpa':>7} {'x fa3':>6} splits")
    for r in rows:
        if r.get("kind") != "decode":
            continue
        if "tq_ms" not in r:
            log(f"{r['batch']}x{r['context']:>6} {r['preset']:>22} ERROR {r.get('error', '')[:60]}")
            continue
        kern = r['decode_kernel'][:4] + str(r.get('decode_block_n') or '')
        log(f"{r['batch']:>4}x{r['context']:<7} {r['preset'] + ' ' + kern:>29} {r['tq_ms']:8.4f} "
            f"{r.get('tq_graph_ms', float('nan')):8.4f} "
            f"{r['tq_gbs']:7.0f} {100 * r['frac_of_copy_bw']:5.1f} {r.get('sdpa_bf16_ms', float('nan')):8.4f} "
            f"{r.get('fa3_bf16_ms', float('nan')):8.4f} {r.get('speedup_vs_sdpa_bf16', float('nan')):7.2f} "
            f"{r.get('speedup_vs_fa3_bf16', float('nan')):6.2f} {r['num_splits']:>3} regs={r.get('n_regs')} "
            f"spills={r.get('n_spills')} smem={r.get('shared_bytes')} cvt={r.get('convert_layouts')} "
            f"{r['config'].replace('TQAttentionConfig', '') if args.sweep else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

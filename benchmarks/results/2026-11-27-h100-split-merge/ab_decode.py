"""Decode split-count sweep: plan.run (rotate + attention + merge) at fixed split counts, plain and centred."""

import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("TQ_TREE") or Path(__file__).resolve().parents[3]).resolve()  # TQ_TREE: another checkout
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402


def main():
    out = sys.argv[1]
    cases = sys.argv[2:]
    rows = []
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    tc = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=10, rep=100, return_mode="median")
    copy_gbs = 2 * src.numel() / tc / 1e6
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    rows.append(dict(copy_gbs=copy_gbs))
    src = dst = None
    for case in cases:
        batch, ctx = map(int, case.split("x"))
        b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
        lay = b["layout"]
        kv_bytes = batch * ctx * 8 * lay.fmt.bytes_per_token_per_head(128)
        for centred in (False, True):
            cent = {}
            if centred:
                c = key_centering_tables(
                    1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128),
                    128,
                    lay.block_size,
                    ctx,
                    device="cuda",
                )
                cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
            plans = {}
            auto = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
            auto.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
            plans["auto"] = auto
            a = auto.decode_splits
            for s in [] if os.environ.get("AUTO_ONLY") else sorted({1, 2 * a, 3 * a, 4 * a, 6 * a, 8 * a, 64, 128}):
                if s > ctx // 64 or s > 128:
                    continue
                p = TQAttentionPlan(
                    lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"), max_num_splits=128
                )
                p.plan(
                    b["block_table"],
                    b["qsl"],
                    b["seq_lens"],
                    num_tokens=batch,
                    max_query_len=1,
                    max_seq_len=ctx,
                    num_splits=s,
                )
                plans[f"s{p.decode_splits}"] = p
            times = {n: [] for n in plans}
            for _ in range(3):
                for name, plan in plans.items():
                    o = torch.empty_like(b["q"])
                    fn = functools.partial(plan.run, b["q"], b["cache"], out=o, **cent)
                    fn()
                    torch.cuda.synchronize()
                    times[name].append(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))
            for name, plan in plans.items():
                t = sorted(times[name])[1]
                r = dict(
                    case=case,
                    centred=centred,
                    variant=name,
                    splits=plan.decode_splits,
                    ms=t,
                    all_ms=times[name],
                    gbs=kv_bytes / t / 1e6,
                    programs=batch * 8 * plan.decode_splits,
                )
                rows.append(r)
                print(
                    f"{case:>9} {'centred' if centred else 'plain  '} {name:5s} splits={plan.decode_splits:3d} "
                    f"progs={r['programs']:5d} {t * 1000:8.1f} us {r['gbs']:6.0f} GB/s",
                    flush=True,
                )
        b = None
        torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

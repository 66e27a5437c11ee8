"""Interleaved A/B of the wgmma decode kernel, in one process: the kernel modules of older commits against the working
tree's, with register caps, each variant timed 5 times in turn (the median of the 5 medians). Run from a directory
``abtest/`` in the repository root that holds the older commits' kernel modules:

    mkdir -p abtest/old && git archive fcced60 turboquant_core | tar -x -C abtest/old
    mkdir -p abtest/mid/turboquant_core/kernels && git show 9b25e2a:turboquant_core/kernels/paged_decode_wgmma_jit.py \
        > abtest/mid/turboquant_core/kernels/paged_decode_wgmma_jit.py
    cp <this file> abtest/ab.py
    AB_VARIANTS=old-64,new-64,new-72,new-80 python abtest/ab.py kernels-ab.json

(``kernels-ab.json`` was measured with the working tree at 9b25e2a; ``mid`` names that commit's kernel for later
comparisons.)
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

import turboquant_core.kernels.paged_decode_wgmma_jit as newmod  # noqa: E402
from turboquant_core.ops import paged_attention, paged_decode_wgmma  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402


def load_kernel(tree: str):
    path = ROOT / "abtest" / tree / "turboquant_core/kernels/paged_decode_wgmma_jit.py"
    spec = importlib.util.spec_from_file_location(f"{tree}jit", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tq_paged_decode_wgmma_kernel


def variants() -> dict:
    """name: (kernel, register cap, programs per SM the split count assumes)."""
    specs = {"old-64": ("old", 64, 8), "mid-64": ("mid", 64, 8), "new-64": (None, 64, 8), "new-72": (None, 72, 7),
             "new-80": (None, 80, 6)}
    sel = os.environ.get("AB_VARIANTS")
    return {k: (load_kernel(tree) if tree else newmod.tq_paged_decode_wgmma_kernel, nreg, per_sm)
            for k, (tree, nreg, per_sm) in specs.items() if not sel or k in sel.split(",")}


def time_case(batch: int, ctx: int, kernels: dict, rows: list) -> None:
    b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
    lay = b["layout"]
    kv_bytes = batch * ctx * 8 * lay.fmt.bytes_per_token_per_head(128)
    for centred in [False, True] if os.environ.get("AB_PLAIN", "1") == "1" else [True]:
        cent = {}
        if centred:
            c = key_centering_tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128,
                                     lay.block_size, ctx, device="cuda")
            cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
        runs = {}
        for name, (kern, nreg, per_sm) in kernels.items():
            paged_attention.WGMMA_PROGRAMS_PER_SM = per_sm
            plan = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
            plan.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
            runs[name] = (plan, torch.empty_like(b["q"]), kern, nreg)
        times = {n: [] for n in runs}
        outs = {}
        for _ in range(5):
            for name, (plan, out, kern, nreg) in runs.items():
                newmod.tq_paged_decode_wgmma_kernel = kern
                paged_decode_wgmma.WGMMA_MAXNREG = nreg

                def fn(plan=plan, out=out, cent=cent):
                    plan.run(b["q"], b["cache"], out=out, **cent)

                times[name].append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
                outs[name] = out.float().clone()
        first = outs[next(iter(outs))]
        for name in runs:
            t = sorted(times[name])[len(times[name]) // 2]
            row = dict(case=f"{batch}x{ctx}", centred=centred, variant=name, ms=t, all_ms=times[name],
                       splits=runs[name][0].decode_splits, gbs=kv_bytes / t / 1e6,
                       max_diff_vs_first=float((outs[name] - first).abs().max()))
            rows.append(row)
            print(f"{row['case']:>9} {'centred' if centred else 'plain  '} {name:7s} {t * 1000:8.1f} us "
                  f"{row['gbs']:6.0f} GB/s splits={row['splits']} diff={row['max_diff_vs_first']:.3g}", flush=True)


def main() -> None:
    kernels = variants()
    cases = sys.argv[2:] or ["8x32768", "384x2304", "64x1280", "32x8448"]
    rows: list = []
    for case in cases:
        batch, ctx = map(int, case.split("x"))
        time_case(batch, ctx, kernels, rows)
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

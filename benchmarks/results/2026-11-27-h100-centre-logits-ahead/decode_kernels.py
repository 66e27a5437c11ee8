"""Per-kernel device time of the decode path (``TQAttentionPlan.run``: query rotation, centering operands and
logits, attention, split merge) and its time as one CUDA graph, for one checkout, ``turboquant_k3v4_nc``, 32 query and
8 KV heads, default decode kernel (e4m3 warpgroup MMA).

    TQ_TREE=<checkout> python decode_kernels.py TAG OUT.json 8x32768 1x32768 32x8448 384x2304

Kernel times: torch profiler over 20 eager runs (device time per kernel, averaged). Graph: median of
``triton.testing.do_bench_cudagraph``, middle of three. Knobs for sweeps (environment, read here only): SC, BR, GF
set ``paged_decode``'s MERGE_SPLITS_PER_LOAD, MERGE_ROWS_PER_PROGRAM, MERGE_GROUPS_FROM; BG, HB the centering
logits' CENTER_LOGITS_GROUPS, CENTER_LOGITS_HEADS; CONLY / PONLY time centred or plain keys only.
"""
import functools
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(os.environ["TQ_TREE"]).resolve()
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

from turboquant_core.ops import paged_decode  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402

KNOBS = {"SC": "MERGE_SPLITS_PER_LOAD", "BR": "MERGE_ROWS_PER_PROGRAM", "GF": "MERGE_GROUPS_FROM",
         "BG": "CENTER_LOGITS_GROUPS", "HB": "CENTER_LOGITS_HEADS"}


def main():
    tag, out = sys.argv[1], sys.argv[2]
    for env, name in KNOBS.items():
        if os.environ.get(env):
            setattr(paged_decode, name, int(os.environ[env]))
    keys = (True,) if os.environ.get("CONLY") else (False,) if os.environ.get("PONLY") else (True, False)
    rows = []
    for case in sys.argv[3:]:
        batch, ctx = map(int, case.split("x"))
        b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
        lay = b["layout"]
        for centred in keys:
            cent = {}
            if centred:
                c = key_centering_tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128,
                                         lay.block_size, ctx, device="cuda")
                cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
            p = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
            p.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
            o = torch.empty_like(b["q"])
            fn = functools.partial(p.run, b["q"], b["cache"], out=o, **cent)
            fn()
            torch.cuda.synchronize()
            g = sorted(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") for _ in range(3))[1]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            k = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    k[e.name] += e.device_time / 20
            r = dict(tag=tag, case=case, centred=centred, graph_us=g * 1e3,
                     center_pages=getattr(p, "center_groups", None), kernels=dict(k))
            rows.append(r)
            print(f"{tag:10s} {case} {'centred' if centred else 'plain  '} graph {g * 1e3:7.1f} us  "
                  + "  ".join(f"{n[:28]}={t:.1f}" for n, t in sorted(k.items(), key=lambda x: -x[1])), flush=True)
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()

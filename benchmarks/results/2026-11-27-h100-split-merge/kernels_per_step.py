# ruff: noqa: B023  (each closure runs within its own loop iteration)
"""Per-kernel GPU times of plan.run and the decode-step store (torch profiler, eager)."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(os.environ.get("TQ_TREE") or Path(__file__).resolve().parents[3]).resolve()  # TQ_TREE: another checkout
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_block_epochs, new_center_sums, new_center_tags, tq_store  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402

rows = []
for case in sys.argv[2:]:
    batch, ctx = map(int, case.split("x"))
    b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
    lay = b["layout"]
    for centred in (False, True):
        cent = {}
        if centred:
            c = key_centering_tables(
                1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128, lay.block_size, ctx, device="cuda"
            )
            cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
        plan = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
        plan.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
        o = torch.empty_like(b["q"])
        k = torch.randn(batch, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t = b["seq_lens"].long() - 1
        slots = b["block_table"][torch.arange(batch, device="cuda"), t // 16].long() * 16 + t % 16
        store_kw = {}
        if centred:
            store_kw = dict(
                centering=cent["centering"],
                query_start_loc=b["qsl"],
                seq_lens=b["seq_lens"],
                block_table=b["block_table"],
                center_sums=cent["center_sums"],
                center_tags=new_center_tags(batch, 8, "cuda"),
                block_epochs=new_block_epochs(b["cache"].shape[0], "cuda"),
                single_token_requests=True,
            )

        def step():
            tq_store(k, v, b["cache"], slots, lay, **store_kw)
            plan.run(b["q"], b["cache"], out=o, **cent)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        agg = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                agg.setdefault(e.name, []).append(
                    e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                )
        print(f"== {case} {'centred' if centred else 'plain'} splits={plan.decode_splits}")
        for name, ts in sorted(agg.items(), key=lambda kv: -sum(kv[1])):
            per = sum(ts) / 20
            print(f"   {per:8.1f} us  x{len(ts) / 20:.0f}  {name[:90]}")
            rows.append(dict(case=case, centred=centred, kernel=name, us_per_step=per, calls=len(ts) / 20))
Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))

"""The wgmma decode path at one shape, run 3 times, for Nsight Compute (``--launch-skip 2 --launch-count 1`` profiles
the last): ``python prof.py BATCHxCONTEXT {0,1}`` (1: centred keys). Run from ``abtest/`` as ab_decode_kernels.py."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402


def main() -> None:
    batch, ctx = map(int, sys.argv[1].split("x"))
    b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
    lay = b["layout"]
    cent = {}
    if sys.argv[2] == "1":
        c = key_centering_tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128, lay.block_size,
                                 ctx, device="cuda")
        cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
    plan = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
    plan.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
    out = torch.empty_like(b["q"])
    for _ in range(3):
        plan.run(b["q"], b["cache"], out=out, **cent)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Study: where does the centred wgmma decode kernel's extra time go? Interleaved in one process, CUDA graphs, the
whole ``plan.run`` (k3v4, 32 query / 8 KV heads): plain keys, centred keys (the centre-term product once per 1024
tokens, as shipped) and centred keys with that product computed once per program (a variant made from the kernel's
source by replacing its condition; its scores are wrong past a program's first 1024 tokens, its time is what counts).

    python benchmarks/study_centre_block.py centre-ab.json 8x32768 32x8448 384x2304 1x32768
"""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

import turboquant_core.kernels.paged_decode_wgmma_jit as mod  # noqa: E402
from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402


def block_once_kernel():
    src = Path(mod.__file__).read_text()
    cond = "if (start == lo) | (start % 1024 == 0):"
    assert src.count(cond) == 1
    path = Path(tempfile.mkdtemp()) / "paged_decode_wgmma_once_jit.py"
    path.write_text(src.replace(cond, "if start == lo:"))
    spec = importlib.util.spec_from_file_location("paged_decode_wgmma_once_jit", path)
    once = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(once)
    return once.tq_paged_decode_wgmma_kernel


def main() -> None:
    kernels = {"product": mod.tq_paged_decode_wgmma_kernel, "block-once": block_once_kernel()}
    rows = []
    for case in sys.argv[2:]:
        batch, ctx = map(int, case.split("x"))
        b = build_batch("turboquant_k3v4_nc", batch, ctx, keep_dense=False)
        lay = b["layout"]
        freqs = 1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
        c = key_centering_tables(freqs, 128, lay.block_size, ctx, device="cuda")
        cent = dict(centering=c, center_sums=new_center_sums(batch, 8, c, "cuda").normal_())
        plan = TQAttentionPlan(lay, 32, 8, "cuda", config=TQAttentionConfig(decode_kernel="wgmma"))
        plan.plan(b["block_table"], b["qsl"], b["seq_lens"], num_tokens=batch, max_query_len=1, max_seq_len=ctx)
        out = torch.empty_like(b["q"])
        runs = [("plain", "product", {}), ("centred", "product", cent), ("centred-block-once", "block-once", cent)]
        times = {name: [] for name, _, _ in runs}
        for _ in range(3):
            for name, kern, kw in runs:
                mod.tq_paged_decode_wgmma_kernel = kernels[kern]

                def fn(kw=kw, plan=plan, b=b, out=out):
                    plan.run(b["q"], b["cache"], out=out, **kw)

                fn()
                torch.cuda.synchronize()
                times[name].append(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1000)
        for name, _, _ in runs:
            t = sorted(times[name])[1]
            rows.append(dict(case=case, variant=name, us=t, all_us=times[name], splits=plan.decode_splits))
            print(f"{case:>9} {name:20s} {t:7.1f} us splits={plan.decode_splits}", flush=True)
        b = None
        torch.cuda.empty_cache()
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

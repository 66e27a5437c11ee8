"""Study: does the centred wgmma decode kernel get faster with its centre-term block (the product run once per 1024
tokens) out of the tile loop? The variant computes the block once, before the loop (its scores are wrong past a
program's first 1024 tokens; its time is what counts), made from the kernel at a399616 by moving that block; timed
against plain and centred keys at a399616, interleaved in one process, CUDA graphs, the whole ``plan.run``:

    python benchmarks/study_centre_hoist.py hoist-ab.json 8x32768 32x8448 384x2304
"""

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402
from bench_paged_attention import build_batch  # noqa: E402

from turboquant_core.ops.key_centering import key_centering_tables  # noqa: E402
from turboquant_core.ops.kv_store import new_center_sums  # noqa: E402
from turboquant_core.ops.paged_attention import TQAttentionConfig, TQAttentionPlan  # noqa: E402

KERNEL = "turboquant_core/kernels/paged_decode_wgmma_jit.py"


def _module(name: str, src: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hoisted(src: str) -> str:
    """The kernel source with the in-loop centre block moved before the tile loop (computed for the first block)."""
    head = "        if CENTER:\n            if (start == lo) | (start % 1024 == 0):\n"
    i = src.index(head)
    j = src.index("        _stage_tile(head, bt_row, last_blk, start + 64, hi,", i)
    block = "\n".join(line[4:] for line in src[i + len(head) : j].rstrip("\n").split("\n"))
    block = block.replace("start // 1024 * 1024", "lo // 1024 * 1024").replace("2 - 2 * stage", "2")
    block = block.replace("3 - 2 * stage", "3")
    anchor = '    m_i = gl.full([8], float("-inf"), gl.float32, layout=col_l)\n'
    return (src[:i] + src[j:]).replace(anchor, "    if CENTER:\n        if True:\n" + block + "\n" + anchor)


def main() -> None:
    src = subprocess.run(
        ["git", "show", f"a399616:{KERNEL}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    old = _module("wgmma_a399616", src)
    kernels = {
        "a399616": old.tq_paged_decode_wgmma_kernel,
        "hoisted": _module("wgmma_hoisted", hoisted(src)).tq_paged_decode_wgmma_kernel,
    }
    import turboquant_core.kernels.paged_decode_wgmma_jit as mod

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
        runs = [("plain", "a399616", {}), ("centred", "a399616", cent), ("centred-hoisted", "hoisted", cent)]
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

"""Time one decode step's centred store (single-token requests, sums kept across steps) as a CUDA graph, for one
checkout (803e665 or its parent): TQ_TREE=<tree> python benchmarks/study_store_launches.py TAG OUT.json 8 64 384"""
import functools, json, os, sys
from pathlib import Path
ROOT = Path(os.environ["TQ_TREE"]).resolve()
sys.path[:0] = [str(ROOT)]
import torch, triton
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.kv_store import new_block_epochs, new_center_sums, new_center_tags, tq_store
from turboquant_core.ops.page_layout import allocate_kv_cache, paged_layout

tag, out = sys.argv[1], sys.argv[2]
lay = paged_layout("turboquant_k3v4_nc", head_dim=128, block_size=16)
rows = []
for reqs in map(int, sys.argv[3:]):
    ctx = 2048
    pages = ctx // 16
    cache = allocate_kv_cache(reqs * pages + 1, 8, lay, device="cuda")
    table = (1 + torch.arange(reqs * pages, dtype=torch.int32, device="cuda")).view(reqs, pages)
    cent = key_centering_tables(1e6 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 128, 16, ctx,
                                device="cuda")
    sums = new_center_sums(reqs, 8, cent, "cuda")
    tags = new_center_tags(reqs, 8, "cuda")
    epochs = new_block_epochs(cache.shape[0], "cuda")
    key = torch.randn(reqs, 8, 128, dtype=torch.bfloat16, device="cuda")
    val = torch.randn_like(key)
    seq = torch.full((reqs,), ctx - 7, dtype=torch.int32, device="cuda")
    slots = (table[:, (ctx - 8) // 16].long() * 16 + (ctx - 8) % 16)
    qsl = torch.arange(reqs + 1, dtype=torch.int32, device="cuda")
    fn = functools.partial(tq_store, key, val, cache, slots, lay, centering=cent, query_start_loc=qsl, seq_lens=seq,
                           block_table=table, center_sums=sums, center_tags=tags, block_epochs=epochs,
                           single_token_requests=True)
    fn(); fn(); torch.cuda.synchronize()  # the first computes every row's sums; later steps find the tags valid
    t = sorted(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") for _ in range(3))[1]
    rows.append(dict(tag=tag, reqs=reqs, us=t * 1e3))
    print(f"{tag:6s} store, {reqs} requests: {t * 1e3:.2f} us", flush=True)
json.dump(rows, open(out, "w"), indent=1)

"""Host time of one eager attention layer (store + attention) of the TurboQuant backend, SmolLM2 shape,
for a non-uniform verification batch and a plain decode batch; cProfile + torch profiler tables."""
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

from tests.vllm_patches.test_tq_backend_gpu import Batch, make_backend
from turboquant_core.ops.key_centering import key_centering_tables
from turboquant_core.ops.kv_store import new_block_epochs
from turboquant_core.vllm import backend as tq_attn

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
LAYERS = 30
res = {}
import turboquant_core.ops.launch as L


class NoStore(dict):
    def __setitem__(self, k, v):
        pass


for mode in ("triton-launch", "cached-launch"):
  L._compiled = NoStore() if mode == "triton-launch" else {}
  for name, reqs in [("verify", [(180, 4), (210, 1), (150, 4), (230, 1), (199, 1), (170, 4), (160, 1), (240, 1)]),
                     ("decode", [(180 + 7 * i, 1) for i in range(8)])]:
      for centred in (True, False):
          gen = torch.Generator().manual_seed(0)
          kw = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=16)
          impl, layer, builder = make_backend(tq_attn, "turboquant_k3v4_nc", num_speculative_tokens=3, **kw)
          if centred:
              theta = 100000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
              impl.key_centering = key_centering_tables(theta, 64, 16, 4096, device="cuda")
              builder.keep_center_sums(["layers.0.attn"], new_block_epochs(300, "cuda"))
          batch = Batch(reqs, num_blocks=300, gen=gen, **kw)
          cache = torch.zeros(tq_attn.TQAttentionBackend.get_kv_cache_shape(300, 16, 3, 64, "turboquant_k3v4_nc"),
                              dtype=torch.uint8, device="cuda")
          state = {}
          tq_attn._layer_metadata = lambda _layer: state.get("md")
          # context
          ctx = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
          from vllm.v1.attention.backend import CommonAttentionMetadata
          qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ctx.cumsum(0).to(torch.int32)])
          cam_ctx = CommonAttentionMetadata(
              query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=ctx.cuda(), num_reqs=len(reqs),
              num_actual_tokens=int(qsl[-1]), max_query_len=int(ctx.max()), max_seq_len=int(ctx.max()),
              block_table_tensor=batch.block_table.cuda(), slot_mapping=batch.context_slots, seq_lens_cpu_upper_bound=ctx)
          state["md"] = builder.build(0, cam_ctx)
          impl.do_kv_cache_update(layer, batch.k_ctx, batch.v_ctx, cache, batch.context_slots)
          out = torch.empty_like(batch.q)

          def step():
              md = builder.build(0, batch.cam)
              state["md"] = md
              for _ in range(LAYERS):
                  impl.do_kv_cache_update(layer, batch.k, batch.v, cache, batch.step_slots)
                  impl.forward(layer, batch.q, batch.k, batch.v, cache, md, output=out)

          for _ in range(3):
              step()
          torch.cuda.synchronize()
          n = 30
          t0 = time.perf_counter()
          for _ in range(n):
              step()
          t_host = (time.perf_counter() - t0) / n
          torch.cuda.synchronize()
          t_all = (time.perf_counter() - t0) / n
          key = f"{mode}-{name}-{'centred' if centred else 'plain'}"
          res[key] = dict(host_ms_per_step=1e3 * t_host, ms_per_step_synced=1e3 * t_all,
                          host_us_per_layer=1e6 * t_host / LAYERS)
          print(key, json.dumps(res[key]), flush=True)
          if mode != "cached-launch" or name != "verify":
              continue
          pr = cProfile.Profile()
          pr.enable()
          for _ in range(5):
              step()
          pr.disable()
          s = io.StringIO()
          pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
          open(f"{OUT}/cprofile-{key}.txt", "w").write(s.getvalue())
          torch.cuda.synchronize()
          with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) as prof:
              step()
              torch.cuda.synchronize()
          open(f"{OUT}/torchprof-{key}.txt", "w").write(
              prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=60))
  json.dump(res, open(f"{OUT}/eager.json", "w"), indent=1)

# Baseline: vLLM's bf16 path per layer (cache write + FlashAttention over the paged cache), same batch.
try:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    reqs = [(180, 4), (210, 1), (150, 4), (230, 1), (199, 1), (170, 4), (160, 1), (240, 1)]
    gen = torch.Generator().manual_seed(0)
    batch = Batch(reqs, num_blocks=300, gen=gen, num_heads=9, num_kv_heads=3, head_size=64, block_size=16)
    kc = torch.zeros(300, 16, 3, 64, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    one = torch.ones(1, device="cuda")
    out = torch.empty_like(batch.q)
    qsl = batch.cam.query_start_loc
    sl = batch.cam.seq_lens
    bt = batch.block_table.cuda()
    ver = get_flash_attn_version(head_size=64)

    def fa_step():
        for _ in range(LAYERS):
            ops.reshape_and_cache_flash(batch.k, batch.v, kc, vc, batch.step_slots, "auto", one, one)
            flash_attn_varlen_func(q=batch.q, k=kc, v=vc, cu_seqlens_q=qsl, max_seqlen_q=4, seqused_k=sl,
                                   max_seqlen_k=260, softmax_scale=0.125, causal=True, block_table=bt, out=out,
                                   fa_version=ver)

    for _ in range(3):
        fa_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        fa_step()
    t_host = (time.perf_counter() - t0) / 30
    torch.cuda.synchronize()
    t_all = (time.perf_counter() - t0) / 30
    res["bf16-flash-attn-verify"] = dict(host_ms_per_step=1e3 * t_host, ms_per_step_synced=1e3 * t_all,
                                         host_us_per_layer=1e6 * t_host / LAYERS, fa_version=ver)
    print("bf16", json.dumps(res["bf16-flash-attn-verify"]), flush=True)
except Exception as e:  # the baseline is a comparison only
    print("bf16 baseline failed:", repr(e), flush=True)
json.dump(res, open(f"{OUT}/eager.json", "w"), indent=1)

# SPDX-License-Identifier: Apache-2.0
"""scripts/profile_decode.py without a GPU: the kernel-family rules on real kernel names, the per-step aggregation
(busy time as a union), trace parsing, limits, argument errors, the markdown report, and the decode-window logic
against a scripted engine."""

import contextlib
import gzip
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from turboquant_core.formats import KV_FORMATS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("profile_decode", REPO / "scripts" / "profile_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNELS = [
    # FlashAttention 2 decode (split-KV) and its combine, FA3 on Hopper and its combine
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
     "false>(Flash_fwd_params)", "attention"),
    ("void flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, 4, 3, true>(Flash_fwd_params)",
     "split_merge"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
     "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<112>, cute::C<128> >, "
     "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false> > > >(flash::FlashAttnFwdSm90<>::Params)",
     "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, "
     "cute::C<128> >, 7, 256, 1, false, true, cutlass::bfloat16_t, float, cutlass::arch::Sm90> > >(Params)",
     "split_merge"),
    ("void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*, int const*, int*)", "attention"),
    # ours
    ("tq_paged_attention_kernel", "attention"),
    ("tq_paged_decode_kernel", "attention"),
    ("tq_rotate_queries_kernel", "attention"),
    ("tq_merge_unrotate_kernel", "split_merge"),
    ("tq_center_queries_kernel", "key_centering"),
    ("tq_center_logits_kernel", "key_centering"),
    ("tq_merge_split_groups_kernel", "split_merge"),
    ("tq_paged_gather_dequant_kernel", "attention"),
    ("tq_merge_splits_kernel", "split_merge"),
    ("tq_paged_store_kernel", "kv_store"),
    ("tq_key_center_sums_kernel", "key_centering"),
    # stock vLLM 0.26's TurboQuant (stock-<preset> configs)
    ("_tq_decode_stage1", "attention"),
    ("_fwd_kernel_stage2", "split_merge"),
    ("_tq_fused_store_mse", "kv_store"),
    ("_tq_full_dequant_kv", "attention"),
    # vLLM's bf16 / fp8 store (it says "flash", it is not attention)
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>"
     "(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, "
     "long, int, int, int, float const*, float const*)", "kv_store"),
    ("void vllm::merge_attn_states_kernel<__nv_bfloat16, 128u>(__nv_bfloat16*, float*, __nv_bfloat16 const*)",
     "split_merge"),
    # GEMMs: cuBLASLt's nvjet and xmma, CUTLASS
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
     "_cublas", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)", "gemm"),
    # weight products: vLLM's Marlin (awq-marlin), ours (--quantization tq4 / tq3) with the activation's rotation and
    # the larger batches' dequantization
    ("void marlin::Marlin<(vllm::ScalarTypeId)5, (vllm::ScalarTypeId)5, 256, 1, 8, 8, true, 4, 8, false>(int4 const*)",
     "gemm"),
    ("tq_linear_mma_kernel", "gemm"),
    ("tq_linear_wgmma_kernel", "gemm"),
    ("tq_rotate_fp16_kernel", "gemm"),
    ("tq_rotate_kernel", "gemm"),
    ("tq_moe_linear_kernel", "gemm"),
    ("tq_dequant_kernel", "gemm"),
    # Inductor-fused and vLLM custom elementwise (named after the ops they fuse, ours included)
    ("triton_red_fused_fused_add_rms_norm_tq_linear_0", "elementwise"),
    ("triton_red_fused_fused_add_rms_norm_machete_mm_2", "elementwise"),
    ("triton_poi_fused_add_mul_silu_slice_0", "elementwise"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "elementwise"),
    ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 3>(c10::BFloat16*, c10::BFloat16 const*, long, long, float, int, "
     "int)", "elementwise"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*)",
     "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >(int, "
     "at::native::FillFunctor<int>, std::array<char*, 1ul>)", "elementwise"),
    # greedy sampling: an argmax reduction
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
     "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)", "sampling"),
    # copies, and what no rule names
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("_compute_slot_mapping_kernel", "other"),
]


@pytest.mark.parametrize("name,family", KERNELS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(KERNELS)])
def test_kernel_families(prof, name, family):
    assert prof.classify(name) == family


def test_family_table_is_complete(prof):
    assert set(prof.FAMILIES) == {f for f, _ in prof.FAMILY_RULES} | {"other"}
    assert set(prof.FAMILY_LABELS) == set(prof.FAMILIES) | {"gaps"}


def test_busy_union_counts_overlap_once(prof):
    assert prof.busy_union([]) == 0
    assert prof.busy_union([(0, 10), (5, 10)]) == 15  # overlapping
    assert prof.busy_union([(0, 10), (2, 3)]) == 10  # nested
    assert prof.busy_union([(10, 5), (0, 10)]) == 15  # touching, unsorted
    assert prof.busy_union([(0, 1), (5, 1)]) == 2  # apart


def test_aggregate_per_step(prof):
    gemm = "nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT"
    events = [  # two steps, microseconds
        ("tq_paged_attention_kernel", 0, 10),
        (gemm, 10, 20),
        ("triton_poi_fused_add_0", 25, 10),  # overlaps the GEMM by 5 us (another stream)
        ("tq_merge_splits_kernel", 40, 5),
        ("Memcpy DtoH (Device -> Pinned)", 50, 2),
        ("tq_paged_attention_kernel", 100, 10),
        (gemm, 110, 20),
        ("tq_merge_splits_kernel", 130, 5),
    ]
    agg = prof.aggregate(events, steps=2, top=3)
    fam = agg["family_ms"]
    assert fam["attention"] == pytest.approx(0.010)  # 20 us over 2 steps
    assert fam["gemm"] == pytest.approx(0.020)
    assert fam["elementwise"] == pytest.approx(0.005)
    assert fam["split_merge"] == pytest.approx(0.005)
    assert fam["memcpy"] == pytest.approx(0.001)
    assert fam["other"] == fam["kv_store"] == 0
    assert set(fam) == set(prof.FAMILIES)
    assert agg["kernel_ms"] == pytest.approx(sum(fam.values()))
    # union: 0-35 (35) + 40-45 (5) + 50-52 (2) + 100-135 (35) = 77 us -> 38.5 us per step
    assert agg["busy_ms"] == pytest.approx(0.0385)
    assert agg["kernels_per_step"] == 3.5 and agg["copies_per_step"] == 0.5
    top = agg["top_kernels"]
    assert [t["name"] for t in top] == [gemm, "tq_paged_attention_kernel", "triton_poi_fused_add_0"]
    assert top[0]["family"] == "gemm" and top[0]["calls_per_step"] == 1 and top[0]["ms_per_step"] == pytest.approx(0.02)
    assert top[0]["share_of_kernel_time"] == pytest.approx(40 / 82)


def _trace():
    """A Chrome trace as torch.profiler writes it: two annotated steps, each a cudaGraphLaunch whose kernels run
    after the host range ends (async scheduling), plus one eager launch."""
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]
    for i, t0 in enumerate((1000.0, 2000.0)):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"tq_decode_step_{i}", "ts": t0, "dur": 100.0})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": t0 + 5, "dur": 10.0})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0 + 20, "dur": 5.0,
                   "args": {"correlation": 10 * i + 1}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 40, "dur": 3.0,
                   "args": {"correlation": 10 * i + 2}})
        ev.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 10 * i + 1, "ts": t0 + 20})
        for k, name in enumerate(("tq_paged_attention_kernel", "nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT")):
            # torch 2.11.0+cu130 writes no "graph id": a graph's kernels carry their cudaGraphLaunch's correlation
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t0 + 500 + 100 * k, "dur": 90.0,
                       "args": {"correlation": 10 * i + 1, "stream": 7}})
        ev.append({"ph": "X", "cat": "kernel", "name": "void at::native::reduce_kernel<ArgMaxOps<float> >",
                   "ts": t0 + 700, "dur": 10.0, "args": {"correlation": 10 * i + 2, "stream": 7}})
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": t0 + 715,
                   "dur": 2.0, "args": {"correlation": 10 * i + 3}})
    return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": ev}


def test_gpu_events_and_graph_counts(prof):
    g = prof.gpu_events(_trace())
    assert len(g["events"]) == 8
    assert g["graph_launches"] == 2 and g["launch_calls"] == 2 and g["graph_kernels"] == 4
    # Where kineto writes a "graph id", that counts too; a launch whose kernels never came back shows as 0.
    tagged = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 1,
                               "args": {"correlation": 5, "graph id": 3}},
                              {"ph": "X", "cat": "kernel", "name": "k", "ts": 2, "dur": 1,
                               "args": {"correlation": 6, "graph id": 0}}]}
    assert prof.gpu_events(tagged)["graph_kernels"] == 1
    lost = {"traceEvents": [e for e in _trace()["traceEvents"] if e.get("args", {}).get("correlation") not in (1, 11)
                            or e.get("cat") != "kernel"]}
    g = prof.gpu_events(lost)
    assert g["graph_launches"] == 2 and g["graph_kernels"] == 0


def test_one_step_trace_follows_correlation(prof, tmp_path):
    one = prof.one_step_trace(_trace(), 1)
    names = [(e.get("name"), e.get("ts")) for e in one["traceEvents"]]
    assert ("tq_decode_step_1", 2000.0) in names
    assert ("tq_paged_attention_kernel", 2500.0) in names  # runs after the step's host range: kept by correlation
    assert ("tq_decode_step_0", 1000.0) not in names
    assert not any(e.get("ts", 0) < 2000 and e.get("ph") == "X" for e in one["traceEvents"])
    assert any(e.get("ph") == "M" for e in one["traceEvents"]) and one["schemaVersion"] == 1
    assert prof.one_step_trace(_trace(), 5) is None
    path = tmp_path / "t.json.gz"
    assert prof.write_trace(one, path, 1 << 20) == "written"
    assert json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] == one["traceEvents"]
    assert prof.write_trace(one, tmp_path / "big.json.gz", 10).startswith("skipped")
    assert not (tmp_path / "big.json.gz").exists()


def test_pure_decode_and_steady(prof):
    assert prof.is_pure_decode({"a": 1, "b": 1}, 0)
    assert not prof.is_pure_decode({"a": 1, "b": 300}, 0)  # a prefill chunk
    assert not prof.is_pure_decode({"a": 1}, 1)  # a new request
    assert not prof.is_pure_decode({}, 0)
    recs = [dict(pure=p) for p in (False, False, True, True, True)]
    assert prof.steady(recs, 2) and not prof.steady(recs, 3) and prof.steady(recs[-1:], 0)


def test_kv_bytes_and_limits(prof):
    assert prof.kv_bytes_per_token_per_head("auto", 128) == 512
    assert prof.kv_bytes_per_token_per_head("fp8", 128) == prof.kv_bytes_per_token_per_head("fp8_e4m3", 128) == 256
    k3v4 = KV_FORMATS["turboquant_k3v4_nc"].bytes_per_token_per_head(128)
    assert prof.kv_bytes_per_token_per_head("turboquant_k3v4_nc", 128) == k3v4
    assert prof.kv_bytes_per_token_per_head("nonsense", 128) is None
    # MLA: one latent entry per token (DeepSeek: kv_lora_rank 512 + rope 64 = one "head" of 576)
    mla = (512, 64)
    assert prof.kv_bytes_per_token_per_head("auto", 576, mla) == 1152
    assert prof.kv_bytes_per_token_per_head("fp8", 576, mla) == 576
    assert prof.kv_bytes_per_token_per_head("turboquant_k3v4_nc", 576, mla) == 322
    lim_mla = prof.hardware_limits(running=64, mean_context=1000, layers=27, kv_heads=1, head_dim=576,
                                   kv_cache_dtype="turboquant_k3v4_nc", gemm_weight_bytes=None,
                                   copy_bytes_per_s=1e12, mla=mla)
    assert lim_mla["attention"]["bytes"] == 64 * 1000 * 27 * 322
    assert lim_mla["kv_store"]["bytes"] == 64 * 27 * (1152 + 322)
    lim = prof.hardware_limits(running=64, mean_context=1000, layers=36, kv_heads=8, head_dim=128,
                               kv_cache_dtype="auto", gemm_weight_bytes=15e9, copy_bytes_per_s=3e12)
    assert lim["attention"]["bytes"] == 64 * 1000 * 36 * 8 * 512
    assert lim["attention"]["ms"] == pytest.approx(1e3 * 64 * 1000 * 36 * 8 * 512 / 3e12)
    assert lim["kv_store"]["bytes"] == 64 * 36 * 8 * (512 + 512)
    assert lim["gemm"]["ms"] == pytest.approx(5.0)
    ours = prof.hardware_limits(running=64, mean_context=1000, layers=36, kv_heads=8, head_dim=128,
                                kv_cache_dtype="turboquant_k3v4_nc", gemm_weight_bytes=None, copy_bytes_per_s=3e12)
    assert ours["attention"]["bytes"] == 64 * 1000 * 36 * 8 * k3v4 and "gemm" not in ours
    assert prof.hardware_limits(running=1, mean_context=1, layers=1, kv_heads=1, head_dim=128, kv_cache_dtype="auto",
                                gemm_weight_bytes=1, copy_bytes_per_s=None) == {}


def test_weight_bytes_leave_out_the_input_embedding(prof):
    torch = pytest.importorskip("torch")

    class VocabParallelEmbedding(torch.nn.Embedding):  # vLLM's class name
        pass

    class Model(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(100, 8)
            self.proj = torch.nn.Linear(8, 16, bias=True)
            self.norm = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    w = prof.weight_bytes(Model(tied=False).to(torch.bfloat16))
    assert w["params"] == 800 + 8 * 16 + 16 + 16 + 800
    assert w["weight_bytes"] == 2 * w["params"]
    assert w["gemm_weight_bytes"] == 2 * (8 * 16 + 800)  # projection and LM head matrices: no embedding, bias, norm
    tied = prof.weight_bytes(Model(tied=True).to(torch.bfloat16))
    assert tied["params"] == 800 + 8 * 16 + 16 + 16 and tied["gemm_weight_bytes"] == 2 * (8 * 16 + 800)


def _raw(step_ms, running, busy, fam, **kw):
    family_ms = dict.fromkeys(("attention", "split_merge", "kv_store", "key_centering", "gemm", "elementwise",
                               "sampling", "memcpy", "other"), 0.0)
    family_ms.update(fam)
    return dict(scenario="S1", input_len=1024, output_len=256, batch=64, step_ms=step_ms, step_ms_profiled=step_ms + 1,
                running_seqs=running, mean_context=1100.0, busy_ms=busy, family_ms=family_ms,
                kernels_per_step=600.0, graph_kernels_per_step=590.0, graph_launches_per_step=1.0,
                launch_calls_per_step=10.0, top_kernels=[dict(name="tq_paged_attention_kernel", family="attention",
                                                               ms_per_step=fam.get("attention", 0.0))],
                warnings=[], pure_decode=True, **kw)


SHAPE = dict(layers=36, kv_heads=8, head_dim=128)


def test_finish_run_and_warnings(prof):
    run = prof.finish_run(_raw(20.0, 64, 18.0, dict(attention=8.0, gemm=9.0, elementwise=1.0)), kv_cache_dtype="auto",
                          shape=SHAPE, gemm_weight_bytes=15e9, copy_bytes_per_s=3e12)
    f = run["families"]
    assert list(f) == list(prof.FAMILIES) + ["gaps"]
    assert f["attention"]["share"] == pytest.approx(0.4) and f["attention"]["ms_per_100_seqs"] == pytest.approx(12.5)
    assert f["gaps"]["ms"] == pytest.approx(2.0) and run["gaps_ms"] == pytest.approx(2.0)
    assert f["gemm"]["limit_ms"] == pytest.approx(5.0) and f["elementwise"]["limit_ms"] is None
    assert run["limit_ms"] == pytest.approx(sum(v["ms"] for v in prof.hardware_limits(
        running=64, mean_context=1100.0, kv_cache_dtype="auto", gemm_weight_bytes=15e9, copy_bytes_per_s=3e12,
        **SHAPE).values()))
    assert run["warnings"] == [] and "family_ms" not in run
    # Busy far below the step, and graph launches without their kernels: both reported.
    low = prof.finish_run(_raw(20.0, 64, 2.0, dict(gemm=2.0)), kv_cache_dtype="auto",
                          shape=SHAPE, gemm_weight_bytes=None, copy_bytes_per_s=None)
    assert len(low["warnings"]) == 1 and "covers only 10%" in low["warnings"][0]
    nog = dict(low, graph_kernels_per_step=0)
    assert any("inside CUDA graphs are missing" in w for w in prof.coverage_warnings(nog))
    assert prof.finish_run(dict(scenario="S2", error="boom"), kv_cache_dtype="auto", shape=SHAPE,
                           gemm_weight_bytes=None, copy_bytes_per_s=None) == dict(scenario="S2", error="boom")


def _doc(prof):
    def run(cfg, dtype, scenario, raw):
        raw = dict(raw, scenario=scenario)
        return dict(config=cfg, install="patched", kv_cache_dtype=dtype, **prof.finish_run(
            raw, kv_cache_dtype=dtype, shape=SHAPE, gemm_weight_bytes=15e9, copy_bytes_per_s=3e12))

    bf16_s1 = _raw(20.0, 64, 18.0, dict(attention=8.0, gemm=9.0, kv_store=0.2, elementwise=0.8))
    ours_s1 = _raw(24.0, 64, 23.0, dict(attention=11.0, split_merge=1.0, kv_store=0.5, key_centering=0.5, gemm=9.0,
                                        elementwise=1.0))
    bf16_s2 = dict(_raw(40.0, 170, 38.0, dict(attention=25.0, gemm=10.0, elementwise=3.0)), batch=384,
                   input_len=2048, output_len=512, pure_decode=False)
    ours_s2 = dict(_raw(70.0, 384, 66.0, dict(attention=50.0, gemm=11.0, elementwise=5.0)), batch=384,
                   input_len=2048, output_len=512)
    return dict(date="2026-11-24T00:00:00+00:00", command="profile_decode.py --configs bf16,ours-k3v4",
                settings=dict(steps=10),
                configs=[dict(name="bf16", kv_cache_dtype="auto", device="NVIDIA H100 80GB HBM3",
                              copy_bandwidth_gbs=3000.0, vllm_version="0.26.0", torch_version="2.11.0"),
                         dict(name="ours-k3v4", kv_cache_dtype="turboquant_k3v4_nc"),
                         dict(name="fp8", kv_cache_dtype="fp8", error="CUDA out of memory")],
                runs=[run("bf16", "auto", "S1", bf16_s1), run("ours-k3v4", "turboquant_k3v4_nc", "S1", ours_s1),
                      run("bf16", "auto", "S2", bf16_s2), run("ours-k3v4", "turboquant_k3v4_nc", "S2", ours_s2),
                      dict(config="fp8", scenario="S2", error="RuntimeError: no steady state")])


def test_markdown_report(prof):
    md = prof.render_markdown(_doc(prof))
    assert "NVIDIA H100 80GB HBM3; copy bandwidth 3000 GB/s" in md
    assert "## S1: 1024 in / 256 out / 64 requests" in md and "## S2: 2048 in / 512 out / 384 requests" in md
    assert ("| per step | bf16 ms (share) | bf16 ms/100 seqs | bf16 limit ms | ours-k3v4 ms (share) | "
            "ours-k3v4 ms/100 seqs | ours-k3v4 limit ms | ours-k3v4 / bf16, per seq |") in md
    s1, s2 = md.split("## S2")
    # attention: 8.0 ms of 20 (40%), 12.50 ms per 100 seqs; ours 11.0 (46%), 17.19; ratio 1.38x
    assert "| attention | 8.00 (40%) | 12.50 |" in s1 and "| 11.00 (46%) | 17.19 |" in s1 and "| 1.38x |" in s1
    assert "| **step (host wall)** | **20.00** | 31.25 |" in s1
    assert "| key centring | 0.00 (0%) | 0.00 | - | 0.50 (2%) | 0.78 | - | - |" in s1
    assert "| gaps (step - busy) | 2.00 (10%) |" in s1
    assert "| kernels / step (in graphs) | 600 (590) |" in s1
    assert "| host launch calls / step (graph launches) | 10 (1) |" in s1
    assert "memcpy / memset" not in s1  # zero everywhere: no row
    # different running counts compare per sequence: bf16 40 ms / 170 seqs, ours 70 ms / 384 seqs
    assert "| running seqs (mean context) | 170 (1100 tok), not pure decode |" in s2
    assert "| **step (host wall)** | **40.00** | 23.53 |" in s2 and "| 18.23 |" in s2 and "| 0.77x |" in s2
    assert "- fp8: failed: RuntimeError: no steady state" in s2
    assert "- fp8 (fp8): failed: CUDA out of memory" in md
    assert "- bf16 top kernels: `tq_paged_attention_kernel` (attention) 8.00 ms" in s1


def test_report_only_rewrites_markdown(prof, tmp_path, capsys):
    src = tmp_path / "profile.json"
    src.write_text(json.dumps(_doc(prof)))
    assert prof.main(["--report-only", str(src)]) == 0
    assert (tmp_path / "profile.md").read_text().startswith("# One steady-state decode step, by kernel family")
    assert "## S2" in capsys.readouterr().out


def test_argument_errors_name_the_choices(prof, tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown config 'bf17'.*bf16, fp8.*ours-k3v4"):
        prof.main(["--configs", "bf17"])
    with pytest.raises(SystemExit, match="S1, S2, S3, sweep"):
        prof.main(["--scenarios", "S9"])
    with pytest.raises(SystemExit) as e:
        prof.main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prof.main(["--model", str(tmp_path)])
    assert "benchmarks/configs/qwen3-8b" in capsys.readouterr().err
    assert prof.scenario_label((1024, 256, 64)) == "S1" and prof.scenario_label((100, 10, 2)) == "100x10x2"
    assert Path(REPO, prof._default_model()).resolve() == REPO / "benchmarks" / "configs" / "qwen3-8b"


# ---- the decode-window logic against a scripted engine (no vLLM, no GPU)


class _Sched:
    """A scheduler that admits ``per_step`` prompts per step (their whole prompt), then decodes one token per running
    request; steps listed in ``prefill_at`` (0-based schedule() calls) re-prefill the last running request, as a
    preemption would."""

    def __init__(self, per_step=2, prefill_at=()):
        self.running, self.waiting, self.per_step, self.prefill_at, self.calls = [], [], per_step, set(prefill_at), 0

    def schedule(self):
        new = [self.waiting.pop(0) for _ in range(min(self.per_step, len(self.waiting)))]
        nst = {r.rid: 1 for r in self.running}
        if self.calls in self.prefill_at and self.running:
            nst[self.running[-1].rid] = 50
        for r in new:
            nst[r.rid] = r.prompt
        self.running += new
        for r in self.running:
            r.num_computed_tokens += nst[r.rid]
        self.calls += 1
        return SimpleNamespace(num_scheduled_tokens=nst, total_num_scheduled_tokens=sum(nst.values()),
                               scheduled_new_reqs=new)

    def has_requests(self):
        return bool(self.running or self.waiting)


class _LLM:
    def __init__(self, sched):
        self.sched, self.aborted = sched, []
        self.llm_engine = SimpleNamespace(step=self._step, has_unfinished_requests=sched.has_requests,
                                          abort_request=self._abort)

    def enqueue(self, prompts, sp, use_tqdm=False):
        reqs = [SimpleNamespace(rid=str(i), prompt=len(p["prompt_token_ids"]), num_computed_tokens=0)
                for i, p in enumerate(prompts)]
        self.sched.waiting += reqs
        return [r.rid for r in reqs]

    def _step(self):
        self.sched.schedule()
        return []

    def _abort(self, ids, internal=False):
        assert internal
        self.aborted += ids
        self.sched.running, self.sched.waiting = [], []


@pytest.mark.parametrize("prefill_at,pure,attempts", [
    ((), True, 1),
    ((8,), True, 1),  # in the first timed window: timed again
    ((11,), True, 2),  # in the first profiled window: profiled again
    (range(0, 10_000, 5), False, 3),  # never 4 decode steps in a row: the last window is kept, flagged
])
def test_profile_scenario_windows(prof, monkeypatch, tmp_path, prefill_at, pure, attempts):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    sched = _Sched(per_step=2, prefill_at=prefill_at)
    rec = prof.ScheduleRecorder(sched)
    llm = _LLM(sched)
    args = SimpleNamespace(config_name="bf16", warm_steps=2, timed_steps=4, steps=3, max_attempts=3,
                           trace_dir=str(tmp_path), trace_max_mb=5.0)
    out = prof._profile_scenario(llm, fake_torch, sched, SimpleNamespace(batch_queue=None), rec, (8, 16, 6), args,
                                 "8x16x6")
    # 6 prompts at 2 per step: 3 prefill steps, then 3 pure-decode steps make it steady
    assert out["steps_to_steady"] == 6 if not prefill_at else out["steps_to_steady"] >= 6
    assert out["pure_decode"] is pure and out["timed_window_pure"] is pure and out["attempts"] == attempts
    assert out["running_seqs"] == 6 and out["profiled_steps"] == 3 and out["timed_steps"] == 4
    assert out["mean_context"] > 8
    assert out["warnings"] == ([] if pure else ["no pure-decode window in 3 attempts: the profiled steps include "
                                                "about 49 prefill tokens"])
    # a CPU-only profile has no GPU events; the aggregation still runs and the step's trace is written
    assert out["kernels_per_step"] == 0 and out["busy_ms"] == 0 and set(out["family_ms"]) == set(prof.FAMILIES)
    assert out["trace"] == "trace-bf16-8x16x6.json.gz" and (tmp_path / out["trace"]).is_file()
    assert sorted(llm.aborted) == [str(i) for i in range(6)] and not sched.has_requests()


def test_report_only_moves_top_kernels_classified_under_older_rules(prof):
    pd = prof
    run = dict(step_ms=10.0, running_seqs=50, warnings=[],
               families={f: dict(ms=0.0, share=0.0, ms_per_100_seqs=0.0, limit_ms=None) for f in pd.FAMILIES},
               top_kernels=[dict(name="tq_paged_decode_kernel", family="other", ms_per_step=3.0),
                            dict(name="nvjet_sm90_tst_192x64", family="gemm", ms_per_step=2.0)])
    run["families"]["other"]["ms"] = 3.5
    run["families"]["gemm"]["ms"] = 2.0
    doc = dict(runs=[run])
    assert pd.reclassify_top_kernels(doc)
    assert run["families"]["attention"]["ms"] == 3.0 and run["families"]["attention"]["ms_per_100_seqs"] == 6.0
    assert abs(run["families"]["other"]["ms"] - 0.5) < 1e-9 and run["families"]["gemm"]["ms"] == 2.0
    assert run["top_kernels"][0]["family"] == "attention" and "reclassified" in run["warnings"][0]
    assert not pd.reclassify_top_kernels(doc)


# ---- --timeline: a whole scenario step by step


def test_summarize_timeline_splits_steps_by_kind(prof):
    steps = [dict(ms=100.0, tokens=8192, reqs=8, pure=False), dict(ms=90.0, tokens=8200, reqs=16, pure=False),
             dict(ms=6.0, tokens=16, reqs=16, pure=True), dict(ms=5.0, tokens=16, reqs=16, pure=True),
             dict(ms=0.5, tokens=0, reqs=0, pure=True)]
    t = prof.summarize_timeline(steps)
    assert t["steps"] == 5 and t["total_s"] == pytest.approx(0.2015)
    assert (t["prefill_steps"], t["prefill_tokens"], t["decode_steps"], t["decode_tokens"], t["idle_steps"]) == (
        2, 16392, 2, 32, 1)
    assert t["prefill_s"] == pytest.approx(0.19) and t["decode_ms_mean"] == pytest.approx(5.5)
    assert prof.summarize_timeline([])["decode_ms_mean"] is None


class _FinishingSched(_Sched):
    """``_Sched`` whose requests leave once they have their prompt and ``n_out`` tokens."""

    def __init__(self, n_out, **kw):
        super().__init__(**kw)
        self.n_out = n_out

    def schedule(self):
        out = super().schedule()
        self.running = [r for r in self.running if r.num_computed_tokens < r.prompt + self.n_out]
        return out


def test_timeline_scenario_times_every_step_to_the_last_token(prof, monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    syncs = []
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: syncs.append(1)))
    sched = _FinishingSched(n_out=5, per_step=2, prefill_at=(4,))
    rec = prof.ScheduleRecorder(sched)
    llm = _LLM(sched)
    args = SimpleNamespace(config_name="ours-k3v4", profile_prefill=False, host_profile=False)
    out = prof._timeline_scenario(llm, fake_torch, sched, SimpleNamespace(batch_queue=None), rec, (8, 5, 6), args,
                                  "8x5x6")
    # 6 prompts at 2 per step: 3 prefill steps (the first decode tokens ride along), the re-prefill of step 4, and
    # decode steps until the last request has its 5 tokens; every step synchronized
    t = out["timeline"]
    assert out["complete"] and not sched.has_requests() and llm.aborted == []
    assert t["steps"] == len(out["steps"]) == len(syncs) - 1
    assert t["prefill_steps"] == 4 and t["idle_steps"] == 0 and t["decode_steps"] == t["steps"] - 4
    assert t["prefill_tokens"] + t["decode_tokens"] == sum(x["tokens"] for x in out["steps"])
    assert all(x["ms"] >= 0 for x in out["steps"])


def test_timeline_report_compares_whole_runs(prof):
    doc = dict(scenarios=["1024x256x64"], date="d", command="c", settings=dict(timeline=True),
               configs=[dict(name="bf16", device="H100", vllm_version="0.26.0", torch_version="2.11"),
                        dict(name="ours-k3v4", device="H100")],
               runs=[dict(config=c, scenario="1024x256x64", complete=True,
                          timeline=prof.summarize_timeline([dict(ms=ms, tokens=10, reqs=2, pure=False),
                                                            dict(ms=4.0, tokens=2, reqs=2, pure=True)]))
                     for c, ms in (("bf16", 96.0), ("ours-k3v4", 196.0))])
    md = prof.render_timeline(doc)
    assert "## 1024x256x64" in md and "| bf16 | 0.10 | 1.00x | 1 | 0.10 | 10 | 1 | 0.00 | 4.00 | 0 |" in md
    assert "| ours-k3v4 | 0.20 | 2.00x |" in md


# ---- --profile-prefill: the GPU time of a timeline's prefill steps


def test_events_of_steps_keeps_the_marked_steps_launches(prof):
    ev = prof.events_of_steps(_trace(), {"tq_decode_step_1"})
    # step 1's graph kernels (run after its host range) and its eager argmax; not step 0's, not the memcpy whose
    # launch is not in the trace
    assert sorted((n, ts) for n, ts, _ in ev) == [
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT", 2600.0), ("tq_paged_attention_kernel", 2500.0),
        ("void at::native::reduce_kernel<ArgMaxOps<float> >", 2700.0)]
    assert len(prof.events_of_steps(_trace(), {"tq_decode_step_0", "tq_decode_step_1"})) == 6
    assert prof.events_of_steps(_trace(), set()) == []


class _Profiler:
    """torch.profiler.profile's surface that _timeline_scenario uses; its trace is ``_trace()``."""

    instances: list = []

    def __init__(self, activities):
        self.started = self.stopped = 0
        _Profiler.instances.append(self)

    def start(self):
        self.started += 1

    def stop(self):
        self.stopped += 1

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps(_trace()))


def test_timeline_scenario_profiles_its_prefill_steps(prof, monkeypatch, tmp_path):
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    profiler = types.ModuleType("torch.profiler")
    profiler.profile, profiler.ProfilerActivity = _Profiler, SimpleNamespace(CPU="cpu", CUDA="cuda")
    profiler.record_function = lambda name: contextlib.nullcontext()
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    _Profiler.instances.clear()
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    sched = _FinishingSched(n_out=5, per_step=2, prefill_at=())
    rec = prof.ScheduleRecorder(sched)
    args = SimpleNamespace(config_name="ours-k3v4", profile_prefill=True, host_profile=True,
                           trace_dir=str(tmp_path))
    out = prof._timeline_scenario(_LLM(sched), fake_torch, sched, SimpleNamespace(batch_queue=None), rec, (8, 5, 6),
                                  args, "8x5x6")
    (p,) = _Profiler.instances
    assert p.started == p.stopped == 1  # stopped at the first pure-decode step, not again at the end
    pre = out["prefill_profile"]
    # 3 prefill steps (6 prompts at 2 per step): the trace's marks 0 and 1 are two of them
    assert pre["steps"] == 3 and out["timeline"]["prefill_steps"] == 3
    assert pre["wall_ms"] == pytest.approx(sum(s["ms"] for s in out["steps"][:3]))
    assert pre["kernels_per_step"] == 6 and pre["family_ms"]["attention"] == pytest.approx(0.18)
    host = (tmp_path / out["host_profile"]).read_text()
    assert out["host_profile"] == "host-ours-k3v4-8x5x6.txt" and "schedule" in host and "cumulative" in host
    md = prof.render_prefill_profile([dict(config="ours-k3v4", prefill_profile=pre)])
    assert "| prefill steps | 3 |" in md and "| attention | 0.2 |" in md
    assert any("tq_paged_attention_kernel" in line for line in md)
    assert prof.render_prefill_profile([]) == []

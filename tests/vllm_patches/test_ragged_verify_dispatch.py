# SPDX-License-Identifier: Apache-2.0
"""Patch 0009 without a GPU: the V1 runner's CUDA-graph dispatch of speculative verification batches whose drafts
differ in length. vLLM's own dispatcher (CudagraphDispatcher, FULL_AND_PIECEWISE keys for 3 speculative tokens) and
the runner's own ``_determine_batch_execution_and_padding`` run on a stand-in runner that carries only the attributes
that method reads.

With every attention builder setting ``supports_ragged_uniform_decode``, a decode batch of R requests with 1..4
queries each replays the full graph captured for R x 4 tokens (R requests); a batch with a prefill, too many
requests for the captured graphs, or a backend without the flag is dispatched as before. Runs only where a patched
vLLM imports (vllm_patches/README.md's CPU recipe); skips otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

NUM_SPEC = 3
QL = 1 + NUM_SPEC
CAPTURE_SIZES = [4, 8, 12, 16, 24, 32, 48, 64]
MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def vllm_runner():
    from test_config_layer import _patched_imports

    runner, dispatcher, config = _patched_imports("its V1 runner", "vllm.v1.worker.gpu_model_runner",
                                                  "vllm.v1.cudagraph_dispatcher", "vllm.config")
    return runner.GPUModelRunner, dispatcher.CudagraphDispatcher, config.CUDAGraphMode


def _runner(vllm_runner, *, ragged: bool):
    """The runner's state after ``_check_and_update_cudagraph_mode`` for FULL_AND_PIECEWISE, 3 speculative tokens."""
    runner_cls, dispatcher_cls, mode = vllm_runner
    compilation = SimpleNamespace(
        cudagraph_mode=mode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=CAPTURE_SIZES,
        max_cudagraph_capture_size=max(CAPTURE_SIZES), compile_sizes=None,
        pass_config=SimpleNamespace(enable_sp=False), is_attention_compiled_piecewise=lambda: True)
    config = SimpleNamespace(
        compilation_config=compilation, num_speculative_tokens=NUM_SPEC, lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
        parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1),
        observability_config=SimpleNamespace(cudagraph_metrics=False))
    dispatcher = dispatcher_cls(config)
    dispatcher.initialize_cudagraph_keys(mode.FULL_AND_PIECEWISE, QL)
    runner = SimpleNamespace(
        vllm_config=config, compilation_config=compilation, cudagraph_dispatcher=dispatcher,
        uniform_decode_query_len=QL, ragged_decode_in_uniform_graph=ragged,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        _is_uniform_decode=runner_cls._is_uniform_decode, _pad_for_sequence_parallelism=lambda n: n)
    return runner


def _dispatch(vllm_runner, query_lens: list[int], *, ragged: bool = True):
    runner_cls = vllm_runner[0]
    q = np.array(query_lens, dtype=np.int32)
    mode, desc, _, _, _ = runner_cls._determine_batch_execution_and_padding(
        _runner(vllm_runner, ragged=ragged), num_tokens=int(q.sum()), num_reqs=len(q), num_scheduled_tokens_np=q,
        max_num_scheduled_tokens=int(q.max()), use_cascade_attn=False)
    return mode, desc


@pytest.mark.parametrize("query_lens", [[4, 1, 4], [1, 1, 1, 1, 1], [2, 4, 3, 1, 4, 4, 1], [1] * MAX_NUM_SEQS])
def test_ragged_verification_replays_the_uniform_graph_of_as_many_requests(vllm_runner, query_lens):
    mode = vllm_runner[2]
    got, desc = _dispatch(vllm_runner, query_lens)
    want = min(s for s in CAPTURE_SIZES if s >= QL * len(query_lens))
    assert got == mode.FULL and desc.uniform, (got, desc)
    assert desc.num_tokens == want and desc.num_reqs == want // QL >= len(query_lens), desc
    # the same graph a uniform batch of as many requests replays
    assert (got, desc) == _dispatch(vllm_runner, [QL] * len(query_lens))


@pytest.mark.parametrize("query_lens", [[4, 1, 4], [1, 1, 1, 1, 1]])
def test_without_the_builder_flag_ragged_batches_run_piecewise(vllm_runner, query_lens):
    mode = vllm_runner[2]
    got, desc = _dispatch(vllm_runner, query_lens, ragged=False)
    assert got == mode.PIECEWISE and not desc.uniform and desc.num_reqs is None, (got, desc)
    assert desc.num_tokens == min(s for s in CAPTURE_SIZES if s >= sum(query_lens)), desc


def test_a_prefill_in_the_batch_keeps_the_mixed_dispatch(vllm_runner):
    mode = vllm_runner[2]
    for ragged in (True, False):
        got, desc = _dispatch(vllm_runner, [4, 1, 9], ragged=ragged)
        assert got == mode.PIECEWISE and not desc.uniform and desc.num_tokens == 16, (ragged, got, desc)


def test_more_requests_than_the_uniform_graphs_hold_keep_the_mixed_dispatch(vllm_runner):
    # 17 requests x 4 > 64 tokens (the largest graph) and > max_num_seqs: no full graph holds them
    mode = vllm_runner[2]
    query_lens = [1, 4] * 8 + [2]
    got, desc = _dispatch(vllm_runner, query_lens)
    assert got == mode.PIECEWISE and not desc.uniform, (got, desc)
    assert desc.num_tokens == min(s for s in CAPTURE_SIZES if s >= sum(query_lens)), desc

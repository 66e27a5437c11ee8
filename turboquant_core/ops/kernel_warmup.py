# SPDX-License-Identifier: Apache-2.0
"""Start-up compilation of the paged TurboQuant kernels: ``warmup_kernels`` launches once every variant
of the store (``ops.kv_store``) and of attention (``ops.paged_attention``) that a serving engine reaches."""

from __future__ import annotations

import torch

from .key_centering import KeyCentering
from .kv_store import new_block_epochs, new_center_sums, new_center_tags, tq_store
from .page_layout import PagedTQLayout
from .paged_attention import PREFILL_MIN_QUERY_LEN, TQAttentionConfig, TQAttentionPlan, tq_gather_dequant
from .paged_decode import MERGE_GROUPS_FROM, MERGE_SPLITS_PER_LOAD, MERGE_WIDE_FROM


def warmup_kernels(cache: torch.Tensor, layout: PagedTQLayout, num_q_heads: int, num_kv_heads: int, *,
                   dtype: torch.dtype = torch.bfloat16, sliding_window: int | None = None,
                   softmax_scale: float | None = None, paths: tuple[str, ...] = ("decode", "context"),
                   block_id: int = 0, config: TQAttentionConfig | None = None,
                   centering: KeyCentering | None = None, decode_query_lens: tuple[int, ...] = (1,)) -> list[dict]:
    """Launch every kernel variant a serving engine reaches once, so Triton compiles them at start-up
    and not inside the first requests. Returns the launches made (their plan parameters).

    Variants follow from ``TQAttentionPlan.plan``: the store; for "decode" (causal, no lse; the queries per
    request of ``decode_query_lens``: 1, and 1 + the draft tokens where speculative verification runs as
    decode) split and unsplit; for "context" (queries after cached context, with lse: chunked prefill, prefix
    hits) every (query block size, one-block) shape the query length can select, split and unsplit; for
    "prefill" (chunks that attend to their own stored tokens too, ``TQConfig.prefill_from_cache``: causal over
    the whole sequence, queries planned as at least ``PREFILL_MIN_QUERY_LEN``, no lse) likewise; for "gather"
    (long chunks' context dequantized into rows of ``dtype``) the gather-dequant; the split merge with and
    without lse. Batch sizes and sequence lengths are run-time arguments, so these cover every
    batch. Writes one block (``block_id``; vLLM's block 0 is its never-read null block) of ``cache`` and reads
    only it: call before serving. With ``centering`` the centred variants (the store's two passes and its
    single pass for single-token batches, both sums launches, centred attention; on the wgmma decode kernel with its
    centering logits computed ahead and, where they would not fit the workspace, without) are compiled instead, with
    the sums kept across steps (tags and block epochs, as a serving engine keeps them per layer)."""
    dev = cache.device
    d, bs = layout.head_dim, layout.block_size
    if any(n < 1 or n > bs for n in decode_query_lens):
        raise ValueError(f"decode_query_lens {decode_query_lens} must lie in [1, block size {bs}]")
    if not 0 <= block_id < cache.shape[0]:
        raise ValueError(f"block_id {block_id} outside the cache's {cache.shape[0]} blocks")
    zeros = torch.zeros(bs, num_kv_heads, d, dtype=dtype, device=dev)
    block_table = torch.full((1, 1), block_id, dtype=torch.int32, device=dev)
    seq_lens = torch.full((1,), bs, dtype=torch.int32, device=dev)
    sums = None
    if centering is not None:
        sums = new_center_sums(1, num_kv_heads, centering, dev)
        kept = dict(center_tags=new_center_tags(1, num_kv_heads, dev),
                    block_epochs=new_block_epochs(cache.shape[0], dev))
        tq_store(zeros, zeros, cache, torch.arange(bs, device=dev) + block_id * bs, layout, centering=centering,
                 query_start_loc=torch.tensor([0, bs], dtype=torch.int32, device=dev), seq_lens=seq_lens,
                 block_table=block_table, center_sums=sums, **kept)
        # decode-only batches: sums first, then K and V in one pass (the block's last slot again)
        tq_store(zeros[:1], zeros[:1], cache, torch.full((1,), (block_id + 1) * bs - 1, device=dev), layout,
                 centering=centering, query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
                 seq_lens=seq_lens, block_table=block_table, center_sums=sums, single_token_requests=True, **kept)
    else:
        tq_store(zeros, zeros, cache, torch.arange(bs, device=dev) + block_id * bs, layout)
    launches = [dict(kernel="store")]
    plan = TQAttentionPlan(layout, num_q_heads, num_kv_heads, dev, workspace_bytes=2 * (d + 1) * 4 * num_q_heads * 160,
                           config=config)

    def first_query_lens(shortest: int, causal: bool) -> list[int]:
        """The first query length of every (block_m, one_qblock) the planner can choose from ``shortest`` on."""
        shapes: dict[tuple[int, bool], int] = {}
        scan_qsl = seq_lens.new_tensor([0, 1])  # contents are not read while planning
        for qlen in range(shortest, 2 * 128 + 2):
            plan.plan(block_table, scan_qsl, seq_lens, num_tokens=qlen, max_query_len=qlen, max_seq_len=bs,
                      causal=causal)
            shapes.setdefault((plan.block_m, plan.one_qblock), qlen)
        return sorted(shapes.values())

    runs = [("decode", qlen, True) for qlen in decode_query_lens] if "decode" in paths else []
    if "context" in paths:
        runs += [("context", qlen, False) for qlen in first_query_lens(1, causal=False)]
    if "prefill" in paths:
        runs += [("prefill", qlen, True) for qlen in first_query_lens(PREFILL_MIN_QUERY_LEN, causal=True)]
    if "gather" in paths:
        rows = torch.empty(bs, num_kv_heads, d, dtype=dtype, device=dev)
        tq_gather_dequant(cache, layout, block_table, seq_lens, seq_lens.new_tensor([0, bs]), rows, rows,
                          max_seq_len=bs, centering=centering, center_sums=sums)
        launches.append(dict(kernel="gather"))
    # decode merges many splits in two levels, 4 or, past MERGE_WIDE_FROM splits, 8 per load
    # (``paged_decode.merge_unrotate``)
    grouped = (1 + MERGE_GROUPS_FROM * MERGE_SPLITS_PER_LOAD, 1 + MERGE_WIDE_FROM)
    for path, qlen, causal in runs:
        q = torch.zeros(qlen, num_q_heads, d, dtype=dtype, device=dev)
        for splits in (1, 2, *grouped) if path == "decode" else (1, 2):
            plan.plan(block_table, seq_lens.new_tensor([0, qlen]), seq_lens, num_tokens=qlen, max_query_len=qlen,
                      max_seq_len=bs, causal=causal, sliding_window=sliding_window, softmax_scale=softmax_scale,
                      num_splits=splits)
            plan.run(q, cache, return_lse=path == "context", centering=centering, center_sums=sums)
            launches.append(dict(kernel=path, query_len=qlen, block_m=plan.block_m, one_qblock=plan.one_qblock,
                                 num_splits=plan.num_splits))
            if path == "decode" and centering is not None and plan.center_groups and splits == 1:
                # the wgmma kernel's own centre-term product, where a batch's logits do not fit the workspace
                plan.center_groups = 0
                plan.run(q, cache, centering=centering, center_sums=sums)
                launches.append(dict(kernel=path, query_len=qlen, block_m=plan.block_m, one_qblock=plan.one_qblock,
                                     num_splits=plan.num_splits, center_logits=False))
    return launches


__all__ = ["warmup_kernels"]

# SPDX-License-Identifier: Apache-2.0
"""Attention over a paged TurboQuant cache (page layout: ``ops.page_layout``; store: ``ops.kv_store``).

Ops
---
- ``TQAttentionPlan`` (plan once per batch, ``run`` once per layer) and the functional
  ``tq_paged_attention``: attention of queries over the cached tokens, in the rotated domain, with
  GQA sharing, tensor cores and split-KV; returns out and optionally the log-sum-exp.
- ``merge_attn_states``: combine two partial attentions (out, lse), e.g. cached context + fresh chunk.
- ``tq_gather_dequant``: cached tokens -> dense bf16/fp16 K, V (a fallback path and a test aid).
A cache stored with key centering (``ops.key_centering``) is read with the same ``centering`` and the
sums the store wrote. Plain-torch references: ``ops.paged_reference`` (``tq_paged_attention_ref``,
``tq_gather_dequant_ref``).

Which path to use
-----------------
- Decode (one query per request) and speculative verification (each request's few last tokens):
  ``TQAttentionPlan`` with ``causal=True``. Where ``ops.paged_decode`` serves the batch (one-segment 2- to
  4-bit formats, head_dim 64 or 128, no sliding window, queries x GQA group <= 16, on CUDA) it runs the
  register-tile kernel, otherwise the Triton kernel below; both read each compressed page once per GQA group
  and query block.
- Context part of a long prefill chunk (hundreds of queries per request): ``tq_gather_dequant`` into a
  bounded bf16 workspace, then FlashAttention with lse and ``merge_attn_states``. The paged kernel
  also serves it (``causal=False``), but re-dequantizes the context once per query block; use it for
  short chunks only. Measurements: benchmarks/results/ (``bench_paged_attention.py``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from ..config import DECODE_KERNELS
from ..kernels.paged_attention_jit import (
    tq_merge_splits_kernel,
    tq_paged_attention_kernel,
    tq_paged_gather_dequant_kernel,
)
from .codec import permute_lookup_applies
from .key_centering import KeyCentering
from .page_layout import (
    ATTENTION_HEAD_DIMS,
    PagedTQLayout,
    _cache_views,
    _centering_args,
    _check_centering,
    _check_sums,
    _ComponentTables,
    _layout_tables,
)
from .paged_decode import (
    CENTER_GROUP_TOKENS,
    DECODE_MAX_COLUMNS,
    LN2,
    codebook_permute_words,
    decode_path_applies,
    decode_workspace_floats,
    num_decode_splits,
    run_decode,
)
from .paged_decode_wgmma import (
    run_decode_wgmma,
    wgmma_decode_applies,
    wgmma_decode_splits,
    wgmma_table_words,
)

# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TQAttentionConfig:
    """Fixed kernel configuration (no autotuning: nothing here depends on the batch size, so CUDA-graph
    capture at many batch sizes compiles one variant per (format, head_dim, mode), not per size).

    Zeros mean "chosen by ``plan``"; the choices come from an H200 sweep (64 x 1280, 32 x 8448 and
    8 x 32768 decode, Qwen3-8B heads): decode-sized blocks (block_m 16, d <= 128) use 128-token tiles,
    4 warps and a 128-register cap (occupancy over spills); larger blocks use 64-token tiles, no cap."""

    block_n: int = 0  # cached tokens per tile (0: 128 for decode-sized blocks, 64 otherwise, 32 for d > 128)
    num_warps: int = 0  # 0: 4 (8 for block_m 128)
    num_stages: int = 2
    block_m: int = 0  # 0: chosen from GQA group size x queries per request (16 for decode)
    maxnreg: int = 0  # register cap per thread, GPU only (0: 128 for decode-sized blocks, else none)
    # Decode batches: "wgmma" and "auto" run the e4m3 warpgroup-MMA kernel where it serves them
    # (``ops.paged_decode_wgmma``: sm_90, k3v4, head_dim 128, one query per request), else the register-tile kernel
    # where it serves them (``ops.paged_decode``); "register-tile" that kernel wherever it serves them.
    decode_kernel: str = "auto"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


MIN_TOKENS_PER_SPLIT = 256
# Query length a prefill chunk that attends to its own stored tokens is planned with at least (``causal=True``):
# past the register-tile kernel's 16 columns, so such chunks take the Triton kernel's few query-block shapes
# (``kernel_warmup``) and never a register-tile variant per chunk length.
PREFILL_MIN_QUERY_LEN = DECODE_MAX_COLUMNS + 1
DEFAULT_WORKSPACE_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def _sm_count(device: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 132  # H100/H200: keeps the CPU interpreter exercising the same split decisions


class TQAttentionPlan:
    """Paged attention over a TurboQuant cache: ``plan`` once per batch, ``run`` once per layer.

    Construction takes the split-KV workspace: ``workspace``, a contiguous 1-D float32 tensor that
    several plans may share (plans whose runs do not overlap, e.g. the layers of one stream), or else
    a new one of ``workspace_bytes``; ``plan`` caps the split count to what fits in it. ``plan``
    takes the batch metadata tensors (device, read only inside the kernels) plus host ints that bound
    them, and fixes every launch parameter, so ``run`` makes no host synchronization and can be
    captured in a CUDA graph (keep the metadata tensors' storage alive and update them in place
    between replays).

    >>> plan = TQAttentionPlan(layout, num_q_heads=32, num_kv_heads=8, device="cuda")   # doctest: +SKIP
    >>> plan.plan(block_table, query_start_loc, seq_lens, num_tokens=64, max_query_len=1,
    ...           max_seq_len=8192)                                                       # doctest: +SKIP
    >>> out = plan.run(q, cache)                                                          # doctest: +SKIP
    """

    def __init__(self, layout: PagedTQLayout, num_q_heads: int, num_kv_heads: int, device, *,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, max_num_splits: int = 64,
                 config: TQAttentionConfig | None = None, workspace: torch.Tensor | None = None):
        if layout.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"paged attention supports head_dim in {ATTENTION_HEAD_DIMS}, got {layout.head_dim}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.layout, self.num_q_heads, self.num_kv_heads = layout, num_q_heads, num_kv_heads
        self.group = num_q_heads // num_kv_heads
        if self.group > 128:
            raise ValueError(f"GQA group size {self.group} > 128 is not supported")
        self.device = torch.device(device)
        self.config = config or TQAttentionConfig()
        if self.config.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"unknown decode kernel {self.config.decode_kernel!r}; choose from {DECODE_KERNELS}")
        self.max_num_splits = max_num_splits
        if workspace is None:
            workspace = torch.empty(max(workspace_bytes // 4, 1), dtype=torch.float32, device=self.device)
        elif (workspace.dtype != torch.float32 or workspace.dim() != 1 or workspace.stride(0) != 1
              or workspace.numel() == 0):
            raise ValueError(f"workspace must be a non-empty contiguous 1-D float32 tensor, got {workspace.dtype} "
                             f"{tuple(workspace.shape)} strides {workspace.stride()}")
        self.workspace = workspace
        self.k_tables, self.v_tables = _layout_tables(layout, self.device)
        # Triton 3.6 cannot build a 64-row block whose segment products are 32 wide (two-segment
        # formats at head_dim 64: its dot-operand pass fails, and the inline-PTX variant compiles
        # into illegal addresses on an H100); such formats use blocks of at most 32 rows.
        cx = {**self.k_tables.constexprs("K", layout.key_is_fp8), **self.v_tables.constexprs("V")}
        widths = [8 * cx[f"{c}GP{s}"] for c in "KV" for s in "01" if cx[f"{c}G{s}"] > 0]
        self.max_auto_block_m = 32 if min(widths) < 64 else 64
        # The register-tile decode kernel's codebook words (host values, computed once: ``run`` never syncs).
        self.decode_words = None
        if decode_path_applies(layout, self.group, self.device, max_query_len=1, causal=True, sliding_window=None):
            self.decode_words = (codebook_permute_words(self.k_tables.cent_f16[0]),
                                 codebook_permute_words(self.v_tables.cent_f16[0]))
        # The e4m3 warpgroup-MMA kernel's codebook registers, where the configuration allows it and it applies.
        self.wgmma_words = None
        if self.config.decode_kernel != "register-tile" and wgmma_decode_applies(
                layout, self.group, self.device, max_query_len=1, causal=True, sliding_window=None):
            self.wgmma_words = wgmma_table_words(layout)
        self._planned = False

    def plan(self, block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
             num_tokens: int, max_query_len: int, max_seq_len: int, causal: bool = True,
             sliding_window: int | None = None, softmax_scale: float | None = None,
             num_splits: int | None = None) -> TQAttentionPlan:
        """Fix the launch for one batch.

        block_table [R, max_blocks] int32; query_start_loc [R+1] int32 (cumulative query counts);
        seq_lens [R] int32: cached tokens request r's queries may see. ``causal``: the queries are
        the last tokens of the cached sequence (decode, speculative verification); otherwise they
        follow the cached context (context part of a chunked prefill / prefix hit). ``num_tokens``,
        ``max_query_len`` and ``max_seq_len`` are host ints bounding the batch (upper bounds are
        fine; CUDA-graph capture plans with the graph's sizes)."""
        if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(1) != 1:
            raise ValueError("block_table must be int32 [num_reqs, max_blocks] with a contiguous last dim")
        num_reqs = block_table.shape[0]
        if query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
            raise ValueError(f"query_start_loc needs {num_reqs + 1} entries and seq_lens {num_reqs}")
        if query_start_loc.dtype != torch.int32 or seq_lens.dtype != torch.int32:
            raise ValueError("query_start_loc and seq_lens must be int32")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
        d, g = self.layout.head_dim, self.group
        cfg = self.config
        requested_splits = num_splits
        max_query_len = max(int(max_query_len), 1)
        g_pad = triton.next_power_of_2(g)  # rows per query in a block (see the kernel's docstring)
        block_m = cfg.block_m or min(max(16, triton.next_power_of_2(g_pad * max_query_len)),
                                     self.max_auto_block_m)
        block_m = max(block_m, g_pad, 16)
        if block_m & (block_m - 1):
            raise ValueError(f"block_m must be a power of two, got {cfg.block_m}")
        qpb = block_m // g_pad
        one_qblock = max_query_len <= qpb
        est_qblocks = num_reqs if one_qblock else num_reqs + num_tokens // qpb
        if num_splits is None:
            span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len)
            target = 4 * _sm_count(str(self.device))
            num_splits = min(triton.cdiv(target, max(est_qblocks * self.num_kv_heads, 1)),
                             max(span // MIN_TOKENS_PER_SPLIT, 1), self.max_num_splits)
        per_split = max(num_tokens, 1) * self.num_q_heads * (d + 1)
        num_splits = max(1, min(int(num_splits), self.workspace.numel() // per_split))
        self.block_table, self.query_start_loc, self.seq_lens = block_table, query_start_loc, seq_lens
        self.num_reqs, self.num_tokens, self.max_query_len = num_reqs, num_tokens, max_query_len
        self.causal, self.sliding_window = causal, sliding_window
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
        self.block_m, self.qpb, self.one_qblock, self.num_splits = block_m, qpb, one_qblock, num_splits
        decode_sized = block_m == 16 and d <= 128
        self.block_n = cfg.block_n or (128 if decode_sized else 64 if d <= 128 else 32)
        self.num_warps = cfg.num_warps or (4 if block_m <= 64 else 8)
        self.maxnreg = cfg.maxnreg or (128 if decode_sized else 0)
        # Decode batches run on the e4m3 warpgroup-MMA kernel where the configuration allows it and it serves them,
        # else on the register-tile kernel where it serves them (``ops.paged_decode``).
        self.decode_splits, self.decode_kernel, self.center_groups = 0, None, 0
        wgmma = self.wgmma_words is not None and wgmma_decode_applies(
            self.layout, g, self.device, max_query_len=max_query_len, causal=causal, sliding_window=sliding_window)
        if wgmma or (self.decode_words is not None and decode_path_applies(
                self.layout, g, self.device, max_query_len=max_query_len, causal=causal,
                sliding_window=sliding_window)):
            splits = wgmma_decode_splits if wgmma else num_decode_splits
            ds = requested_splits if requested_splits is not None else splits(
                num_reqs, self.num_kv_heads, max_seq_len, self.device, MIN_TOKENS_PER_SPLIT, self.max_num_splits)
            while ds > 1 and decode_workspace_floats(max(num_tokens, 1), self.num_q_heads, d, ds) > \
                    self.workspace.numel():
                ds -= 1
            if decode_workspace_floats(max(num_tokens, 1), self.num_q_heads, d, ds) <= self.workspace.numel():
                self.decode_splits, self.decode_kernel = ds, "wgmma" if wgmma else "register-tile"
                # With key centering the wgmma kernel reads each 16-token group's logits, computed ahead, where the
                # workspace holds them next to the splits' outputs (``ops.paged_decode_wgmma``).
                groups = triton.cdiv(max(max_seq_len, 1), CENTER_GROUP_TOKENS)
                if wgmma and decode_workspace_floats(max(num_tokens, 1), self.num_q_heads, d, ds, groups,
                                                     self.num_kv_heads) <= self.workspace.numel():
                    self.center_groups = groups
        self._planned = True
        return self

    def run(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False, lse: torch.Tensor | None = None, *,
            centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None):
        """q [Tq, Hq, d] (fp16/bf16, contiguous last dim) -> out [Tq, Hq, d] (and lse [Hq, Tq] fp32,
        natural log, -inf for rows that see no token). Rows of tokens outside query_start_loc's
        range are left unspecified. A cache stored with key centering is read with the same
        ``centering`` and the ``center_sums`` of the planned requests (row r: block_table row r)."""
        if not self._planned:
            raise RuntimeError("call plan() before run()")
        lay, d = self.layout, self.layout.head_dim
        if centering is not None:
            _check_centering(centering, lay)
            if center_sums is None:
                raise ValueError("key centering needs the center_sums that the store wrote")
            _check_sums(center_sums, self.num_reqs, self.num_kv_heads, centering)
        if q.dim() != 3 or q.shape[1] != self.num_q_heads or q.shape[2] != d or q.stride(-1) != 1:
            raise ValueError(f"q must be [Tq, {self.num_q_heads}, {d}] with a contiguous last dim, "
                             f"got {tuple(q.shape)}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
        tq = q.shape[0]
        if tq > max(self.num_tokens, 1) and self.num_splits > 1:
            raise ValueError(f"q has {tq} tokens but the plan was made for num_tokens={self.num_tokens}")
        u8, f16 = _cache_views(cache, lay, self.num_kv_heads)
        if out is None:
            out = torch.empty_like(q)
        if out.shape != q.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim")
        write_lse = return_lse or lse is not None
        if write_lse and lse is None:
            lse = torch.empty(self.num_q_heads, tq, dtype=torch.float32, device=q.device)
        if write_lse and (lse.shape != (self.num_q_heads, tq) or lse.stride(1) != 1):
            raise ValueError(f"lse must be float32 [{self.num_q_heads}, {tq}] with a contiguous last dim")
        lse_arg = lse if write_lse else out
        if tq == 0 or self.num_reqs == 0:
            return (out, lse) if return_lse else out
        if self.decode_splits:
            if self.decode_kernel == "wgmma":
                run_decode_wgmma(self, q, u8, out, lse if write_lse else None, centering, center_sums)
            else:
                run_decode(self, q, u8, f16, out, lse if write_lse else None, centering, center_sums)
            return (out, lse) if return_lse else out
        s = self.num_splits
        if s > 1:
            n_o = s * tq * self.num_q_heads * d
            part_o = self.workspace[:n_o].view(s, tq, self.num_q_heads, d)
            part_l = self.workspace[n_o : n_o + s * tq * self.num_q_heads].view(s, tq, self.num_q_heads)
        else:
            part_o = part_l = self.workspace[:1].view(1, 1, 1, 1)
        kt, vt = self.k_tables, self.v_tables
        qblocks = self.num_reqs if self.one_qblock else self.num_reqs + tq // self.qpb
        cfg = self.config
        grid = (qblocks, self.num_kv_heads, s)
        cargs, cconst = _centering_args(centering, center_sums, f16, fp16_tables=True)
        self.last_compiled = tq_paged_attention_kernel[grid](
            q, q.stride(0), q.stride(1),
            u8, f16, u8.stride(0), u8.stride(1),
            self.block_table, self.block_table.stride(0), self.query_start_loc, self.seq_lens,
            kt.attn_rot_hi, kt.attn_rot_lo, kt.cent_f16[0], kt.cent_f16[1],
            vt.attn_rot_hi, vt.attn_rot_lo, vt.cent_f16[0], vt.cent_f16[1],
            out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0),
            part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
            self.num_reqs, s, self.softmax_scale * kt.codec.rot_scale / LN2, vt.codec.rot_scale,
            self.sliding_window or 0,
            *cargs, self.softmax_scale / LN2,
            D=d, D_PAD=kt.codec.dim_pad, GQ=self.group, GQ_PAD=self.block_m // self.qpb, QPB=self.qpb,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            K_FP8=lay.key_is_fp8, SPLIT=s > 1, ONE_QBLOCK=self.one_qblock, CAUSAL=self.causal,
            HAS_WINDOW=self.sliding_window is not None, WRITE_LSE=write_lse, WHILE_LOOP=_interpreting(),
            CENTER=centering is not None, **cconst, num_warps=self.num_warps, num_stages=cfg.num_stages,
            **({"maxnreg": self.maxnreg} if self.maxnreg and not _interpreting() else {}),
            **kt.constexprs("K", lay.key_is_fp8), **vt.constexprs("V"), **lay.kernel_constexprs(),
        )
        if s > 1:
            tq_merge_splits_kernel[(tq, self.num_q_heads)](
                part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0),
                part_l.stride(1), out, out.stride(0), out.stride(1), lse_arg, lse_arg.stride(0), s,
                S_PAD=triton.next_power_of_2(self.max_num_splits), D=d, D_PAD=kt.codec.dim_pad, WRITE_LSE=write_lse,
                num_warps=4 if d <= 128 else 8,
            )
        return (out, lse) if return_lse else out


def tq_paged_attention(q: torch.Tensor, cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, max_query_len: int,
                       max_seq_len: int, causal: bool = True, sliding_window: int | None = None,
                       softmax_scale: float | None = None, out: torch.Tensor | None = None,
                       return_lse: bool = False, num_splits: int | None = None,
                       config: TQAttentionConfig | None = None, centering: KeyCentering | None = None,
                       center_sums: torch.Tensor | None = None):
    """One-shot ``TQAttentionPlan(...).plan(...).run(...)`` (allocates a workspace; for tests and one-off calls).

    q [Tq, Hq, d]; cache [num_blocks, Hkv, head_page_bytes] uint8; returns out [Tq, Hq, d]
    (and lse [Hq, Tq] fp32 when ``return_lse``)."""
    num_kv_heads = cache.shape[1]
    tq = q.shape[0]
    ws = max(tq, 1) * q.shape[1] * (layout.head_dim + 1) * 4 * (num_splits or 64)
    plan = TQAttentionPlan(layout, q.shape[1], num_kv_heads, q.device, workspace_bytes=ws, config=config)
    plan.plan(block_table, query_start_loc, seq_lens, num_tokens=tq, max_query_len=max_query_len,
              max_seq_len=max_seq_len, causal=causal, sliding_window=sliding_window,
              softmax_scale=softmax_scale, num_splits=num_splits)
    return plan.run(q, cache, out=out, return_lse=return_lse, centering=centering, center_sums=center_sums)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      output: torch.Tensor | None = None):
    """Combine two attentions over disjoint key sets: out [T, H, d], lse [H, T] (natural log).

    A side with lse = -inf (no keys) contributes nothing; +inf (some kernels' "no keys") is read as
    -inf. Pure tensor ops, no host synchronization (CUDA-graph capturable). Returns (out, lse)."""
    la = torch.where(lse_a == float("inf"), float("-inf"), lse_a.float())
    lb = torch.where(lse_b == float("inf"), float("-inf"), lse_b.float())
    mx = torch.maximum(la, lb)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    wa, wb = torch.exp(la - mx), torch.exp(lb - mx)
    total = wa + wb
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    wa_t, wb_t = (wa * inv).t().unsqueeze(-1), (wb * inv).t().unsqueeze(-1)  # [T, H, 1]
    merged = out_a.float() * wa_t + out_b.float() * wb_t
    lse = torch.where(total > 0, mx + torch.log(total), torch.full_like(total, float("-inf")))
    if output is None:
        return merged.to(out_a.dtype), lse
    output.copy_(merged)
    return output, lse


# ----------------------------------------------------------------------------------------------
# Gather + dequantize
# ----------------------------------------------------------------------------------------------


def _decode_operands(tables: _ComponentTables, permute: bool) -> tuple:
    """(rot_hi, rot_lo, codebook 0, codebook 1) for ``_mse_decode_rows``: kernel-order rows and fp16
    codebooks with ``permute``, else the codec's rows and fp32 codebooks."""
    if permute:
        return tables.attn_rot_hi, tables.attn_rot_lo, tables.cent_f16[0], tables.cent_f16[1]
    c = tables.codec
    return c.rot_hi, c.rot_lo, c.centroids[0], c.centroids[-1]


def tq_gather_dequant(cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seq_lens: torch.Tensor, out_k: torch.Tensor,
                      out_v: torch.Tensor, *, max_seq_len: int, block_n: int = 32,
                      centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None):
    """Dequantize cached tokens 0..seq_lens[r]-1 of every request into dense rows
    ``cu_seq_lens[r] + t`` of ``out_k``/``out_v`` [N, Hkv, d] (fp16/bf16/fp32, preallocated: the
    caller bounds N, e.g. by a fixed workspace and a chunked loop). No host synchronization.
    bf16 outputs take the codebook values by byte permutes in registers (fp16 codebooks, as attention
    does; bf16's rounding hides theirs); fp16 and fp32 outputs gather the fp32 codebooks per index."""
    num_kv_heads = cache.shape[1]
    u8, f16 = _cache_views(cache, layout, num_kv_heads)
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if o.dim() != 3 or o.shape[1:] != (num_kv_heads, layout.head_dim) or o.stride(-1) != 1:
            raise ValueError(f"{name} must be [N, {num_kv_heads}, {layout.head_dim}] with a contiguous last dim")
    num_reqs = block_table.shape[0]
    if centering is not None:
        _check_centering(centering, layout)
        if center_sums is None:
            raise ValueError("key centering needs the center_sums that the store wrote")
        _check_sums(center_sums, num_reqs, num_kv_heads, centering)
    if num_reqs == 0 or max_seq_len <= 0:
        return out_k, out_v
    kt, vt = _layout_tables(layout, cache.device)
    kc, vc = kt.codec, vt.codec
    k_perm = out_k.dtype == torch.bfloat16 and not layout.key_is_fp8 and permute_lookup_applies(kc)
    v_perm = out_v.dtype == torch.bfloat16 and permute_lookup_applies(vc)
    grid = (num_reqs, triton.cdiv(max_seq_len, block_n), num_kv_heads)
    cargs, cconst = _centering_args(centering, center_sums, f16)
    tq_paged_gather_dequant_kernel[grid](
        u8, f16, u8.stride(0), u8.stride(1), block_table, block_table.stride(0), seq_lens, cu_seq_lens,
        *_decode_operands(kt, k_perm), *_decode_operands(vt, v_perm),
        out_k, out_k.stride(0), out_k.stride(1), out_v, out_v.stride(0), out_v.stride(1),
        kc.rot_scale, vc.rot_scale,
        *cargs, D=layout.head_dim, D_PAD=kc.dim_pad, K_FP8=layout.key_is_fp8, BN=block_n, num_warps=4,
        CENTER=centering is not None, K_PERMUTE=k_perm, V_PERMUTE=v_perm, **cconst,
        **kt.constexprs("K", layout.key_is_fp8), **vt.constexprs("V"), **layout.kernel_constexprs(),
    )
    return out_k, out_v


__all__ = [
    "DEFAULT_WORKSPACE_BYTES", "TQAttentionConfig", "TQAttentionPlan",
    "merge_attn_states", "tq_gather_dequant", "tq_paged_attention",
]

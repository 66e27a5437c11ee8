# SPDX-License-Identifier: Apache-2.0
"""TurboQuant MLA cache ops (page layout: ``ops.mla_layout``; references: ``ops.mla_reference``).

- ``mla_store(kv_c, k_pe, cache, slot_mapping, layout)``: vLLM's ``concat_and_cache_mla`` contract into
  TurboQuant MLA pages: the latent rotated, quantized and packed, k_pe as bf16, slots < 0 skipped; two launches
  (the latent's column chunks, then scales and k_pe), no host synchronization. Reference:
  ``mla_reference.mla_store_ref``.
- ``mla_gather_dequant(cache, layout, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, seq_starts)``: cached
  tokens as dense [kv_c | k_pe] rows, vLLM's ``gather_and_maybe_dequant_cache`` contract (the prefill context of
  an MLA layer); the latent's codebook values gathered still rotated, then rotated back by one product. Reference:
  ``mla_reference.mla_gather_dequant_ref``.
- ``mla_decode_attention(ql_nope, q_pe, cache, layout, block_table, seq_lens, softmax_scale)``: decode attention
  with the absorbed query (vLLM's ``forward_mqa``: one query row per request, or per query token), split-KV, every
  head of a block reading each page tile once, in the rotated domain: the queries are rotated once per head before
  the split kernel and the merged output rotated back once per head after it; with ``rotated=True`` the caller's
  absorbed weights do both (``mla_absorbed_weights``). One-segment 2- to 4-bit latents run the warpgroup-MMA kernel
  on sm_90 (``mla_decode_wgmma_jit``, ``mla_wgmma_applies``) and the register-tile kernel on other GPUs
  (``mla_decode_mma_jit``, ``mla_mma_applies``), the others the Triton kernel (``mla_decode_jit``); each has its
  coordinate order (``mla_decode_rotation``; ``mla_decode_kernel`` names the one that runs). Requests with a few
  query tokens (a chunked prompt's last ones, speculative verification) decode as one causal row per token
  (``mla_decode_query_rows``). Reference: ``mla_reference.mla_decode_attention_ref``.
- ``mla_absorbed_weights(layout, w_uk_t, w_uv)``: vLLM's absorbed MLA weights (W_UK_T, W_UV) with the latent's
  rotation folded in, so that decode attention needs no rotation product at all.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from ..kernels.mla_decode_jit import tq_mla_decode_kernel
from ..kernels.mla_decode_mma_jit import tq_mla_decode_mma_kernel
from ..kernels.mla_decode_wgmma_jit import tq_mla_decode_wgmma_kernel
from ..kernels.mla_gather_jit import tq_mla_gather_kernel
from ..kernels.mla_store_jit import tq_mla_store_finish_kernel, tq_mla_store_kernel
from ..kernels.paged_attention_jit import tq_merge_splits_kernel
from .mla_layout import MLAPagedLayout, mla_cache_views, mla_tables
from .paged_decode import _gluon_runs, codebook_permute_words, decode_key_order
from .paged_decode_wgmma import _sm90

MLA_GATHER_ROWS = 16  # tokens per gather program
MLA_STORE_FEW_TOKENS = 256  # up to this many tokens the store runs narrow column chunks of 16-token programs
MLA_STORE_FINISH_ROWS = 64  # tokens per program of the scale and k_pe pass


def _check_store_inputs(kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                        layout: MLAPagedLayout) -> None:
    lr, r = layout.kv_lora_rank, layout.rope_dim
    if kv_c.dim() != 2 or kv_c.shape[1] != lr:
        raise ValueError(f"kv_c must be [num_tokens, {lr}], got {tuple(kv_c.shape)}")
    if k_pe.dim() != 2 or k_pe.shape != (kv_c.shape[0], r):
        raise ValueError(f"k_pe must be [num_tokens, {r}] (vLLM passes k_pe.squeeze(1)), got {tuple(k_pe.shape)}")
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if r & (r - 1):
        raise ValueError(f"the store kernel needs a power-of-two rope_dim, got {r}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < kv_c.shape[0]:
        raise ValueError(f"slot_mapping must be 1-D with >= {kv_c.shape[0]} entries, got {tuple(slot_mapping.shape)}")


def mla_store_chunk_groups(num_tokens: int) -> tuple[int, int]:
    """(groups per column chunk, tokens per program) of the store: a decode step's few tokens get narrow chunks
    (more programs), a prefill's many tokens wide ones (fewer re-reads of the rotation)."""
    few = num_tokens <= MLA_STORE_FEW_TOKENS
    return (8 if few else 16), (16 if few else 64)


def mla_store(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
              layout: MLAPagedLayout) -> None:
    """Write kv_c [T, kv_lora_rank] and k_pe [T, rope_dim] (fp16 / bf16 / fp32) into ``cache`` (uint8
    [num_blocks, page_bytes]) at ``slot_mapping`` [>= T] (int32 or int64; < 0: skipped). The cache comes from
    ``mla_layout.allocate_mla_cache(num_blocks, layout, device)`` (or any view of that shape and layout). Two
    launches (the latent's column chunks, then the scales and k_pe), no host synchronization."""
    _check_store_inputs(kv_c, k_pe, slot_mapping, layout)
    u8, f16, bf16 = mla_cache_views(cache, layout)
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return
    t = mla_tables(layout, kv_c.device)
    c = t.codec
    lev0, bnd0, lev1, bnd1 = c.encode_tables()
    seg = t.segment_constexprs(layout.latent_is_fp8)
    lc = layout.kernel_constexprs()
    gw, bn = mla_store_chunk_groups(num_tokens)
    chunks = (seg["GP0"] + (seg["GP1"] if seg["G1"] else 0)) // gw
    sums = torch.empty(num_tokens, chunks + 1, dtype=torch.float32, device=kv_c.device)
    tq_mla_store_kernel[(triton.cdiv(num_tokens, bn), chunks)](
        kv_c, kv_c.stride(0), slot_mapping, u8, u8.stride(0), c.rot_hi, c.rot_lo, c.rot_bf16, lev0, bnd0, lev1, bnd1,
        sums, sums.stride(0), num_tokens, c.rot_scale, math.sqrt(layout.kv_lora_rank),
        L=lc["L"], L_PAD=seg["L_PAD"], PAGE=lc["PAGE"], LATENT_FP8=lc["LATENT_FP8"], G0=seg["G0"], GP0=seg["GP0"],
        B0=seg["B0"], G1=seg["G1"], GP1=seg["GP1"], B1=seg["B1"], EXACT_ROT=seg["EXACT_ROT"], IDX_OFF=lc["IDX_OFF"],
        IDX_ROW=lc["IDX_ROW"], GW=gw, BN=bn, num_warps=4 if bn <= 16 else 8,
    )
    tq_mla_store_finish_kernel[(triton.cdiv(num_tokens, MLA_STORE_FINISH_ROWS),)](
        k_pe, k_pe.stride(0), slot_mapping, f16, bf16, u8.stride(0), sums, sums.stride(0), num_tokens,
        math.sqrt(layout.kv_lora_rank), R=lc["R"], PAGE=lc["PAGE"], CHUNKS=chunks,
        CHUNKS_PAD=triton.next_power_of_2(chunks), HAS_SCALE=not layout.latent_is_fp8,
        NORM_CORRECTION=lc["NORM_CORRECTION"], ROPE_OFF=lc["ROPE_OFF"], SC_OFF=lc["SC_OFF"],
        BN=MLA_STORE_FINISH_ROWS, num_warps=4,
    )


@dataclass(frozen=True)
class MLADecodeLaunch:
    """Launch shape of the Triton decode kernel: heads per program (the MMA's rows: 16 is its smallest height), tokens
    per tile, warps and Triton's pipeline stages (the kernel loads a tile ahead itself; Triton's own pipelining only
    adds shared memory). The default is the fastest of ``benchmarks/bench_mla_decode.py --launch`` on an H100."""

    heads: int = 16
    tokens: int = 32
    warps: int = 4
    stages: int = 1


MLA_DECODE_LAUNCH = MLADecodeLaunch()
MLA_DECODE_HEADS = MLA_DECODE_LAUNCH.heads
MLA_MIN_TOKENS_PER_SPLIT = 256
MLA_PROGRAMS_PER_SM = 2  # the Triton and register-tile kernels' registers leave room for two programs per SM
MLA_WGMMA_PROGRAMS_PER_SM = 2  # the warpgroup-MMA kernel's shared memory (one fp16 tile, two copy stages): two
MLA_WAVE_FILL_SLACK = 0.05
MLA_MMA_WARPS = 4  # warps of the register-tile kernel, each holding DP / 4 latent coordinates
MLA_MMA_BLOCK_N = 16
MLA_MMA_DEPTH = 2  # tiles whose loads the register-tile kernel has in flight ahead of its arithmetic
# Register cap of the register-tile kernel (None: ptxas's choice, 224-229 at 4 warps: two programs per SM). A cap of
# 168 fits three, with spills to local memory (benchmarks/bench_mla_decode.py --launch mma:4:2:168 times it).
MLA_MMA_MAXNREG: int | None = None


def mla_mma_applies(layout: MLAPagedLayout, device) -> bool:
    """Whether decode runs the register-tile kernel (``mla_decode_mma_jit``): one 2- to 4-bit codebook segment of a
    power-of-two latent of 256 or more coordinates, a 64-wide rope key, pages of a multiple of 16 tokens whose
    sizes keep 4-byte plane loads aligned, on a CUDA GPU of sm_80 or later. Otherwise the Triton kernel runs."""
    lat = layout.fmt.latent
    lr = layout.kv_lora_rank
    return (lat.has_codebook and not lat.is_fp8 and lat.kernel_bits in (2, 3, 4) and lr >= 64 * MLA_MMA_WARPS
            and lr & (lr - 1) == 0 and layout.rope_dim == 64
            and layout.block_size % MLA_MMA_BLOCK_N == 0 and layout.page_bytes % 4 == 0
            and layout.index_offset % 4 == 0 and _gluon_runs(str(torch.device(device))))


@functools.lru_cache(maxsize=8)
def mla_mma_order(dp: int, warps: int) -> torch.Tensor:
    """The register-tile kernel's coordinate order, of its query operand and of its output alike (the value tile is
    the key tile transposed in registers): the rotated latent coordinate at each position. Warp w holds positions
    w*DW.. (DW = dp / warps), groups w*DW/8.., in ``paged_decode.decode_key_order`` over its DW coordinates;
    coordinate j*G + g of the latent's G = dp / 8 groups."""
    dw, g_all = dp // warps, dp // 8
    gw = dw // 8
    local = decode_key_order(dw)
    return torch.cat([(local // gw) * g_all + w * gw + local % gw for w in range(warps)])


@functools.lru_cache(maxsize=8)
def mla_wgmma_order(dp: int) -> torch.Tensor:
    """The warpgroup-MMA kernel's coordinate order (``mla_decode_wgmma_jit``): position 8g + j holds field j of group
    g, rotated coordinate j*G + g of the latent's G = dp / 8 groups."""
    p = torch.arange(dp)
    return (p % 8) * (dp // 8) + p // 8


MLA_DECODE_KERNELS = ("wgmma", "mma", "triton")
MLA_WGMMA_DECODE = True  # the warpgroup-MMA kernel where it applies (False: the register-tile kernel there)
MLA_WGMMA_STAGES = 2  # k_pe tiles in shared memory: the one computed and the copies in flight ahead of it


def mla_wgmma_applies(layout: MLAPagedLayout, device) -> bool:
    """Whether decode runs the warpgroup-MMA kernel (``mla_decode_wgmma_jit``): where the register-tile kernel
    applies, with a 512-wide latent, on an sm_90 GPU (wgmma needs sm_90a)."""
    dev = torch.device(device)
    return (MLA_WGMMA_DECODE and layout.kv_lora_rank == 512 and mla_mma_applies(layout, dev)
            and _sm90(str(dev)))


def mla_decode_kernel(layout: MLAPagedLayout, device) -> str:
    """The decode kernel ``mla_decode_attention`` runs for ``layout`` on ``device``: "wgmma"
    (``mla_wgmma_applies``), "mma" (``mla_mma_applies``) or "triton"."""
    if mla_wgmma_applies(layout, device):
        return "wgmma"
    return "mma" if mla_mma_applies(layout, device) else "triton"


@functools.lru_cache(maxsize=64)
def _decode_rotation(layout: MLAPagedLayout, device: str, kernel: str, warps: int) -> torch.Tensor:
    t = mla_tables(layout, device)
    if kernel == "triton":
        return t.attn_rows
    natural = torch.zeros_like(t.attn_rows)  # [L_PAD, L], row c: rotated coordinate c
    keep = t.order >= 0
    natural[t.order[keep].to(natural.device)] = t.attn_rows[keep.to(natural.device)]
    order = mla_wgmma_order(t.codec.dim_pad) if kernel == "wgmma" else mla_mma_order(t.codec.dim_pad, warps)
    return natural[order.to(natural.device)].contiguous()


def mla_decode_rotation(layout: MLAPagedLayout, device, kernel: str | None = None) -> torch.Tensor:
    """[L_PAD, kv_lora_rank] fp32: the latent's orthogonal rotation in the coordinate order of the decode kernel on
    ``device``, the order it takes its queries in (q_rot = rows @ q) and leaves its output in (out = rows^T @ y):
    ``MLATables.attn_rows``' for the Triton kernel, ``mla_mma_order`` for the register-tile kernel,
    ``mla_wgmma_order`` for the warpgroup-MMA kernel. ``kernel`` names one of ``MLA_DECODE_KERNELS`` (default: the
    one ``mla_decode_attention`` runs there, ``mla_decode_kernel``)."""
    dev = str(torch.device(device))
    kernel = mla_decode_kernel(layout, dev) if kernel is None else kernel
    if kernel not in MLA_DECODE_KERNELS:
        raise ValueError(f"unknown MLA decode kernel {kernel!r}; choose one of {', '.join(MLA_DECODE_KERNELS)}")
    return _decode_rotation(layout, dev, kernel, MLA_MMA_WARPS)


@functools.lru_cache(maxsize=64)
def _permute_words(layout: MLAPagedLayout, device: str) -> tuple[int, ...]:
    return codebook_permute_words(mla_tables(layout, device).cent_f16[0])


MLA_MAX_SPLITS = 64
LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def mla_decode_splits(num_reqs: int, num_heads: int, max_seq_len: int, device: torch.device,
                      kernel: str = "mma") -> int:
    """KV splits per request: the fewest whose programs fill their waves (the programs per SM that ``kernel``'s
    registers and shared memory allow: MLA_WGMMA_PROGRAMS_PER_SM for "wgmma", MLA_PROGRAMS_PER_SM otherwise) within
    a share MLA_WAVE_FILL_SLACK of the best count, none shorter than ``MLA_MIN_TOKENS_PER_SPLIT`` tokens, at most
    ``MLA_MAX_SPLITS`` (one on the CPU). A batch of one wave and a few programs takes about two waves' time; these
    are the counts ``benchmarks/bench_mla_decode.py`` measured fastest."""
    if device.type != "cuda":
        return 1
    from .paged_attention import _sm_count

    programs = max(num_reqs * triton.cdiv(num_heads, MLA_DECODE_HEADS), 1)
    per_sm = MLA_WGMMA_PROGRAMS_PER_SM if kernel == "wgmma" else MLA_PROGRAMS_PER_SM
    wave = per_sm * _sm_count(str(device))
    most = max(1, min(triton.cdiv(max(max_seq_len, 1), MLA_MIN_TOKENS_PER_SPLIT), MLA_MAX_SPLITS))

    def fill(splits: int) -> float:
        return programs * splits / (triton.cdiv(programs * splits, wave) * wave)

    best = max(fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if fill(s) >= best * (1 - MLA_WAVE_FILL_SLACK))


# Decode serves requests of up to this many query tokens (a chunked prompt's last few tokens, speculative
# verification) as one row per token; longer ones take vLLM's prefill path with the context gathered. A row reads its
# request's whole context, where the prefill path gathers it once for all of the request's tokens and pays a dozen
# launches per layer for that: by the bytes and products each moves, the two cost about the same at 16 tokens over
# a 32k context (DeepSeek-V2-Lite's heads).
MLA_DECODE_MAX_QUERY_LEN = 16


def mla_decode_query_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode requests with several query tokens as one decode row per token: token j of request r (query tokens
    query_start_loc[r]..[r+1], seq_lens[r] tokens with them) attends causally, to the first seq_lens[r] - q_r + j + 1
    tokens of its pages. -> (block_table [num_tokens, max_blocks], seq_lens [num_tokens] int32) for
    ``mla_decode_attention``, whose out and lse rows are then the tokens'. ``num_tokens`` (a host int) is
    query_start_loc[-1]; no host synchronization."""
    reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != reqs + 1 or block_table.shape[0] < reqs:
        raise ValueError(f"query_start_loc must have {reqs + 1} entries and block_table >= {reqs} rows, got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_table.shape)}")
    dev = seq_lens.device
    starts = query_start_loc.to(device=dev, dtype=torch.int64)
    q_lens = starts[1:] - starts[:-1]
    row_req = torch.repeat_interleave(torch.arange(reqs, device=dev), q_lens, output_size=num_tokens)
    position = torch.arange(num_tokens, device=dev) - starts[row_req]
    row_seq = seq_lens[row_req].to(torch.int64) - q_lens[row_req] + position + 1
    return block_table[row_req], row_seq.to(torch.int32)


def _check_decode_inputs(ql_nope, q_pe, block_table, seq_lens, layout: MLAPagedLayout) -> None:
    lr, r = layout.kv_lora_rank, layout.rope_dim
    if ql_nope.dim() != 3 or ql_nope.shape[-1] != lr or q_pe.shape != (*ql_nope.shape[:2], r):
        raise ValueError(f"ql_nope [B, H, {lr}] and q_pe [B, H, {r}] expected, got {tuple(ql_nope.shape)} and "
                         f"{tuple(q_pe.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < ql_nope.shape[0] or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be [>= {ql_nope.shape[0]}, max_blocks] with a contiguous last dim, got "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < ql_nope.shape[0]:
        raise ValueError(f"seq_lens must be 1-D with >= {ql_nope.shape[0]} entries, got {tuple(seq_lens.shape)}")
    if r & (r - 1):
        raise ValueError(f"the decode kernel needs a power-of-two rope_dim, got {r}")


def mla_absorbed_weights(layout: MLAPagedLayout, w_uk_t: torch.Tensor,
                         w_uv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's absorbed MLA weights W_UK_T [H, qk_nope, kv_lora_rank] and W_UV [H, kv_lora_rank, v_head] with the
    latent's rotation folded in (products in float32, results in the inputs' dtypes): queries made with the first
    are already rotated into the order the decode kernel on the weights' device takes (``mla_decode_rotation``;
    ``mla_decode_attention(..., rotated=True)``), and the second turns its rotated-domain output into the value heads
    directly. Needs kv_lora_rank to be its own padded size (a power of two: 512, 256), as vLLM's W_UV product reads
    kv_lora_rank columns."""
    rows = mla_decode_rotation(layout, w_uk_t.device)  # [L_PAD, L]: y_rot = rows @ y, y = rows^T @ y_rot
    lr = layout.kv_lora_rank
    if rows.shape[0] != lr:
        raise ValueError(f"kv_lora_rank {lr} pads to {rows.shape[0]} rotated coordinates; the rotation cannot be "
                         "folded into vLLM's absorbed weights")
    if w_uk_t.shape[-1] != lr or w_uv.shape[-2] != lr or w_uk_t.shape[0] != w_uv.shape[0]:
        raise ValueError(f"W_UK_T [H, P, {lr}] and W_UV [H, {lr}, V] expected, got {tuple(w_uk_t.shape)} and "
                         f"{tuple(w_uv.shape)}")
    return (w_uk_t.float() @ rows.T).to(w_uk_t.dtype), (rows @ w_uv.float()).to(w_uv.dtype)


def _launch_triton_decode(q_rot, q_pe, u8, f16, bf16, block_table, seq_lens, part_o, part_l, h, num_splits, qk_scale,
                          t, layout: MLAPagedLayout, cfg: MLADecodeLaunch) -> None:
    seg = t.segment_constexprs(layout.latent_is_fp8)
    seg.pop("EXACT_ROT")
    lc = layout.kernel_constexprs()
    tq_mla_decode_kernel[(q_rot.shape[0], triton.cdiv(h, cfg.heads), num_splits)](
        q_rot, q_rot.stride(0), q_rot.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
        u8, f16, bf16, u8.stride(0), block_table, block_table.stride(0), seq_lens, *t.cent_f16,
        part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
        h, num_splits, qk_scale, qk_scale, R=lc["R"], PAGE=lc["PAGE"], LATENT_FP8=lc["LATENT_FP8"],
        IDX_OFF=lc["IDX_OFF"], ROPE_OFF=lc["ROPE_OFF"], SC_OFF=lc["SC_OFF"], IDX_ROW=lc["IDX_ROW"], L=lc["L"], **seg,
        BLOCK_H=cfg.heads, BLOCK_N=cfg.tokens, WHILE_LOOP=_interpreting(), num_warps=cfg.warps, num_stages=cfg.stages,
    )


def mla_decode_attention(ql_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, layout: MLAPagedLayout,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float, *,
                         max_seq_len: int | None = None, num_splits: int | None = None,
                         rotated: bool = False, launch: MLADecodeLaunch | None = None,
                         kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention with the absorbed query over TurboQuant MLA pages: ql_nope [B, H, kv_lora_rank] (W_UK
    applied), q_pe [B, H, rope_dim], request b reading its first seq_lens[b] tokens through block_table[b] ->
    (out [B, H, kv_lora_rank] in ql_nope's dtype, the latent output before W_UV; lse [B, H] fp32, natural log,
    -inf for a request with no token).

    ``rotated``: ql_nope was made with ``mla_absorbed_weights``' W_UK_T (already in the rotated domain, in the
    decode kernel's order: ``mla_decode_rotation``), and ``out`` is left in that order for W_UV; no rotation
    product runs here. The register-tile kernel (``mla_mma_applies``) runs where it can, the Triton kernel
    otherwise.

    ``max_seq_len`` (a host int, as vLLM's metadata has it) sizes the splits; without it the seq_lens are read
    (a host synchronization). ``num_splits`` overrides the split count; ``kernel`` one of ``MLA_DECODE_KERNELS``
    overrides the choice of kernel (rotated queries then in its order: ``mla_decode_rotation(..., kernel)``);
    ``launch`` runs the Triton kernel with that launch shape."""
    _check_decode_inputs(ql_nope, q_pe, block_table, seq_lens, layout)
    u8, f16, bf16 = mla_cache_views(cache, layout)
    b, h, lr = ql_nope.shape
    dev = ql_nope.device
    t = mla_tables(layout, dev)
    c = t.codec
    lp = c.dim_pad
    if kernel is None:
        kernel = "triton" if launch is not None else mla_decode_kernel(layout, dev)
    rows = mla_decode_rotation(layout, dev, kernel)  # [L_PAD positions, L]
    # The kernel scales both query parts for the base-2 softmax as it loads them.
    qk_scale = softmax_scale * LOG2E
    if rotated:
        if lp != lr:
            raise ValueError(f"rotated queries need kv_lora_rank ({lr}) to be its own padded size ({lp})")
        q_rot = ql_nope
    else:
        # Rotate the absorbed queries once per head, into the kernel's query order.
        q_rot = ql_nope.float() @ rows.T
    if q_rot.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("ql_nope and q_pe need a contiguous last dim")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens[:b].max()) if b else 0
        num_splits = mla_decode_splits(b, h, max_seq_len, dev, kernel)
    part_o = torch.empty(num_splits, b, h, lp, dtype=torch.float32, device=dev)
    part_l = torch.empty(num_splits, b, h, dtype=torch.float32, device=dev)
    out_rot = torch.empty(b, h, lp, dtype=ql_nope.dtype if rotated else torch.float32, device=dev)
    lse = torch.empty(h, b, dtype=torch.float32, device=dev)
    if b == 0:
        return torch.empty(0, h, lr, dtype=ql_nope.dtype, device=dev), lse.t()
    lc = layout.kernel_constexprs()
    if kernel != "triton" and (u8.stride(0) % 4 or u8.data_ptr() % 4):
        raise ValueError(f"the MLA decode kernel loads 4-byte planes: the cache's block stride ({u8.stride(0)}) "
                         f"and address must be multiples of 4")
    if kernel in ("wgmma", "mma"):
        grid = (b, triton.cdiv(h, 16), num_splits)
        args = (q_rot, q_rot.stride(0), q_rot.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
                u8, f16, bf16, u8.stride(0), block_table, block_table.stride(0), seq_lens,
                *_permute_words(layout, str(dev)), part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2),
                part_l, part_l.stride(0), part_l.stride(1), h, num_splits, qk_scale, qk_scale)
        pages = dict(DP=lp, PAGE=lc["PAGE"], B=int(layout.fmt.latent.kernel_bits), IDX_OFF=lc["IDX_OFF"],
                     ROPE_OFF=lc["ROPE_OFF"], SC_OFF=lc["SC_OFF"])
        if kernel == "wgmma":
            tq_mla_decode_wgmma_kernel[grid](*args, **pages, STAGES=MLA_WGMMA_STAGES, num_warps=4)
        else:
            tq_mla_decode_mma_kernel[grid](*args, **pages, NW=MLA_MMA_WARPS, DEPTH=MLA_MMA_DEPTH,
                                           num_warps=MLA_MMA_WARPS,
                                           **({"maxnreg": MLA_MMA_MAXNREG} if MLA_MMA_MAXNREG else {}))
    else:
        _launch_triton_decode(q_rot, q_pe, u8, f16, bf16, block_table, seq_lens, part_o, part_l, h, num_splits,
                              qk_scale, t, layout, launch or MLA_DECODE_LAUNCH)
    tq_merge_splits_kernel[(b, h)](
        part_o, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l, part_l.stride(0), part_l.stride(1),
        out_rot, out_rot.stride(0), out_rot.stride(1), lse, lse.stride(0), num_splits,
        S_PAD=triton.next_power_of_2(num_splits), D=lp, D_PAD=lp, WRITE_LSE=True,
    )
    if rotated:
        return out_rot, lse.t()
    # Back from the rotated domain, once per head: out = R^T y.
    out = out_rot @ rows
    return out.to(ql_nope.dtype), lse.t()


def mla_gather_dequant(cache: torch.Tensor, layout: MLAPagedLayout, dst: torch.Tensor, block_table: torch.Tensor,
                       cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int | torch.Tensor,
                       seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Cached tokens into dense rows dst[i] = [kv_c | k_pe] (dst [>= num_tokens, kv_lora_rank + rope_dim], fp16 /
    bf16 / fp32), vLLM's ``gather_and_maybe_dequant_cache`` contract: row i is the token of request
    ``token_to_seq[i]`` at position ``i - cu_seq_lens[seq]`` (plus ``seq_starts[seq]``: a later chunk of the
    context), read through ``block_table[seq]``. Rows from ``num_tokens`` on are not written. ``num_tokens`` is a
    host int or a one-element CPU tensor (vLLM passes a row of its CPU ``cu_seq_lens``); no host synchronization."""
    num_tokens = int(num_tokens)
    lr, r = layout.kv_lora_rank, layout.rope_dim
    if dst.dim() != 2 or dst.shape[0] < num_tokens or dst.shape[1] != lr + r or dst.stride(1) != 1:
        raise ValueError(f"dst must be [>= {num_tokens}, {lr + r}] with a contiguous last dim, got {tuple(dst.shape)}")
    if dst.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dst must be float16, bfloat16 or float32, got {dst.dtype}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be 2-D with a contiguous last dim, got {tuple(block_table.shape)}")
    if token_to_seq.dim() != 1 or token_to_seq.shape[0] < num_tokens:
        raise ValueError(f"token_to_seq must be 1-D with >= {num_tokens} entries, got {tuple(token_to_seq.shape)}")
    if r & (r - 1):
        raise ValueError(f"the gather kernel needs a power-of-two rope_dim, got {r}")
    if num_tokens == 0:
        return dst
    u8, f16, bf16 = mla_cache_views(cache, layout)
    dev = dst.device
    t = mla_tables(layout, dev)
    y = torch.empty(num_tokens, t.attn_rows.shape[0], dtype=torch.float32, device=dev)
    seg = t.segment_constexprs(layout.latent_is_fp8)
    seg.pop("EXACT_ROT")
    lc = layout.kernel_constexprs()
    starts = seq_starts if seq_starts is not None else cu_seq_lens
    tq_mla_gather_kernel[(triton.cdiv(num_tokens, MLA_GATHER_ROWS),)](
        u8, f16, bf16, u8.stride(0), block_table, block_table.stride(0), cu_seq_lens, token_to_seq, starts,
        num_tokens, *t.cent_f16, y, y.stride(0), dst, dst.stride(0),
        R=lc["R"], PAGE=lc["PAGE"], LATENT_FP8=lc["LATENT_FP8"], IDX_OFF=lc["IDX_OFF"], ROPE_OFF=lc["ROPE_OFF"],
        SC_OFF=lc["SC_OFF"], IDX_ROW=lc["IDX_ROW"], L=lc["L"], **seg, HAS_STARTS=seq_starts is not None,
        BN=MLA_GATHER_ROWS, num_warps=4,
    )
    # Back from the rotated domain for all rows at once (as mla_decode_attention's output): R^T y.
    dst[:num_tokens, :lr] = (y @ t.attn_rows).to(dst.dtype)
    return dst


def mla_warmup_kernels(cache: torch.Tensor, layout: MLAPagedLayout, dtype: torch.dtype, num_heads: int,
                       softmax_scale: float, rotated: bool = False, block_id: int = 0) -> int:
    """Launch once every variant of the MLA kernels a serving engine reaches, so that Triton compiles them at start-up
    and not inside the first requests: the store (a decode step's few tokens, a prefill's many), decode with its split
    merge for every power-of-two split count up to ``MLA_MAX_SPLITS`` (the merge's variants; the decode kernel has
    one), and the context gather. Token counts, batch sizes, split counts and sequence lengths are run-time
    arguments. Writes one block (``block_id``; vLLM's block 0 is its never-read null block) and reads only it.
    Returns the launches."""
    dev = cache.device
    lr, r = layout.kv_lora_rank, layout.rope_dim
    tokens = min(layout.block_size, 16)
    slots = block_id * layout.block_size + torch.arange(tokens, dtype=torch.int64, device=dev)
    mla_store(torch.zeros(tokens, lr, dtype=dtype, device=dev), torch.zeros(tokens, r, dtype=dtype, device=dev),
              cache, slots, layout)
    # The store's prefill shape (wide column chunks) too; every slot skipped, nothing written.
    many = MLA_STORE_FEW_TOKENS + 1
    mla_store(torch.zeros(many, lr, dtype=dtype, device=dev), torch.zeros(many, r, dtype=dtype, device=dev),
              cache, torch.full((many,), -1, dtype=torch.int64, device=dev), layout)
    block_table = torch.full((1, 1), block_id, dtype=torch.int32, device=dev)
    seq_lens = torch.full((1,), tokens, dtype=torch.int32, device=dev)
    q = torch.zeros(1, num_heads, lr, dtype=dtype, device=dev)
    q_pe = torch.zeros(1, num_heads, r, dtype=dtype, device=dev)
    launches = 2
    splits = 1
    while splits <= MLA_MAX_SPLITS:
        mla_decode_attention(q, q_pe, cache, layout, block_table, seq_lens, softmax_scale, num_splits=splits,
                             rotated=rotated)
        launches += 1
        splits *= 2
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    to_seq = torch.zeros(tokens, dtype=torch.int32, device=dev)
    dst = torch.empty(tokens, lr + r, dtype=dtype, device=dev)
    starts = torch.zeros(1, dtype=torch.int32, device=dev)
    mla_gather_dequant(cache, layout, dst, block_table, cu, to_seq, tokens, seq_starts=starts)
    return launches + 1


__all__ = ["MLA_DECODE_KERNELS", "MLA_DECODE_MAX_QUERY_LEN", "MLA_GATHER_ROWS", "MLADecodeLaunch",
           "mla_absorbed_weights", "mla_decode_attention", "mla_decode_kernel", "mla_decode_query_rows",
           "mla_decode_rotation", "mla_decode_splits", "mla_gather_dequant", "mla_mma_applies", "mla_mma_order",
           "mla_store", "mla_warmup_kernels", "mla_wgmma_applies", "mla_wgmma_order"]

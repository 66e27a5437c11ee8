# SPDX-License-Identifier: Apache-2.0
"""Plain-torch references of the TurboQuant MLA cache: one token's entry, the paged store, and MLA decode attention
with the absorbed query, from compressed pages and from dense latents; also vLLM's fp8 MLA entries as baselines.
No Triton: they state what the kernels of ``ops.mla`` compute and run wherever torch does.

MLA decode attention (DeepSeek V2's "absorbed" form, vLLM's ``forward_mqa``), per request and head h:

    s_j = softmax_scale * (ql_h . kv_c_j + q_pe_h . k_pe_j),   o_h = sum_j softmax(s)_j kv_c_j    ([kv_lora_rank])

with ql_h = W_UK_h q_nope_h (the absorbed query) and o_h later mapped to the value head by W_UV outside attention.
A compressed latent is kv_c_j ~= R^T (a_j c[idx_j]) (a_j: its fp16 scale; fp8 latents: R^T e4m3(R kv_c_j)), so

    ql_h . kv_c_j = a_j (R ql_h) . c[idx_j],      o_h = R^T sum_j p_j a_j c[idx_j]

(``quantizer``'s identity): the query is rotated once per head, the output un-rotated once per head, and every
cached token is read as codebook values in the rotated domain (``mla_decode_attention_ref``). Both the scores and
the output read the same latent values, as in FlashMLA, where the latent is K and V at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MLA_FP8_DS_TILE, MLAFormat
from ..quantizer import FP8_MAX, FP8Quantizer, MSEQuantized
from ..rotation import rotate, unrotate
from .codec import encode_ref, unpack_segments
from .mla_layout import MLAPagedLayout, mla_cache_views

# ----------------------------------------------------------------------------------------------
# One token's entry
# ----------------------------------------------------------------------------------------------


@dataclass
class MLAEntries:
    """Tokens' MLA entries as stored: latent index bytes [..., latent_index_bytes] uint8, latent scale [...] fp16
    (None for fp8 latents) and k_pe [..., rope_dim] bf16."""

    latent_index: torch.Tensor
    latent_scale: torch.Tensor | None
    k_pe: torch.Tensor


def _check_latents(kv_c: torch.Tensor, k_pe: torch.Tensor, fmt: MLAFormat) -> None:
    if kv_c.shape[-1] != fmt.kv_lora_rank or k_pe.shape[-1] != fmt.rope_dim or kv_c.shape[:-1] != k_pe.shape[:-1]:
        raise ValueError(f"kv_c [..., {fmt.kv_lora_rank}] and k_pe [..., {fmt.rope_dim}] with equal leading dims "
                         f"expected, got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")


def mla_encode_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, fmt: MLAFormat) -> MLAEntries:
    """kv_c [..., kv_lora_rank], k_pe [..., rope_dim] (any float dtype) -> their entries: the latent by the preset's
    key quantizer (``ops.codec.encode_ref``, or the rotated fp8 bytes), k_pe rounded to bf16."""
    _check_latents(kv_c, k_pe, fmt)
    lat = fmt.latent
    if lat.is_fp8:
        idx, scale = FP8Quantizer(fmt.kv_lora_rank, fmt.seed).quantize(kv_c.float()), None
    else:
        idx, scale = encode_ref(kv_c.float(), lat.bits, fmt.seed, lat.norm_correction)
    return MLAEntries(idx, scale, k_pe.to(torch.bfloat16))


def mla_rotated_latent_ref(entries: MLAEntries, fmt: MLAFormat) -> torch.Tensor:
    """R kv_c as stored, [..., kv_lora_rank] float32: scale * c[idx] (codebook latents) or the e4m3 values."""
    if fmt.latent.is_fp8:
        return entries.latent_index.view(torch.float8_e4m3fn).float()
    q = fmt.latent_quantizer()
    idx = unpack_segments(entries.latent_index, fmt.kv_lora_rank, fmt.latent.bits)
    return q.rotated_values(MSEQuantized(idx, entries.latent_scale.float()))


def mla_decode_ref(entries: MLAEntries, fmt: MLAFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries -> (kv_c [..., kv_lora_rank], k_pe [..., rope_dim]) float32."""
    return unrotate(mla_rotated_latent_ref(entries, fmt), fmt.seed), entries.k_pe.float()


def mla_entry_bytes(entries: MLAEntries, fmt: MLAFormat) -> torch.Tensor:
    """Entries -> [..., bytes_per_token] uint8: one token's entry as one record, its sections in page order
    (``formats.MLAFormat``: latent indices | k_pe bf16 | latent fp16 scale); a page holds these same bytes, each
    section contiguous over its tokens."""
    parts = [entries.latent_index, entries.k_pe.contiguous().view(torch.uint8)]
    if entries.latent_scale is not None:
        parts.append(entries.latent_scale.to(torch.float16).unsqueeze(-1).view(torch.uint8))
    out = torch.cat(parts, dim=-1)
    assert out.shape[-1] == fmt.bytes_per_token()
    return out


def mla_entries_from_bytes(data: torch.Tensor, fmt: MLAFormat) -> MLAEntries:
    """Inverse of ``mla_entry_bytes``."""
    if data.dtype != torch.uint8 or data.shape[-1] != fmt.bytes_per_token():
        raise ValueError(f"expected uint8 [..., {fmt.bytes_per_token()}], got {data.dtype} {tuple(data.shape)}")
    pieces, start = {}, 0
    for name, n in fmt.entry_sections():
        pieces[name] = data[..., start : start + n].contiguous()
        start += n
    scale = pieces.get("latent_scale")
    return MLAEntries(pieces["latent_index"], None if scale is None else scale.view(torch.float16)[..., 0],
                      pieces["k_pe"].view(torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# Paged store and reads
# ----------------------------------------------------------------------------------------------


def _section(cache: torch.Tensor, layout: MLAPagedLayout, name: str) -> torch.Tensor:
    """View of one section of every block: [num_blocks, block_size, bytes per token]."""
    off, size = {n: (o, s) for n, o, s in layout.sections()}[name]
    return cache[:, off : off + size].unflatten(1, (layout.block_size, size // layout.block_size))


def mla_store_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                  layout: MLAPagedLayout) -> None:
    """Reference of ``ops.mla.mla_store``: kv_c [T, kv_lora_rank], k_pe [T, rope_dim] into their slots
    (``slot_mapping`` [>= T]; slots < 0 skipped), vLLM's ``concat_and_cache_mla`` contract."""
    mla_cache_views(cache, layout)
    n = kv_c.shape[0]
    keep = slot_mapping[:n] >= 0
    e = mla_encode_ref(kv_c[keep], k_pe[keep], layout.fmt)
    sl = slot_mapping[:n][keep].long()
    blk, off = sl // layout.block_size, sl % layout.block_size
    _section(cache, layout, "latent_index")[blk, off] = e.latent_index
    _section(cache, layout, "k_pe")[blk, off] = e.k_pe.contiguous().view(torch.uint8)
    if e.latent_scale is not None:
        _section(cache, layout, "latent_scale")[blk, off] = e.latent_scale.unsqueeze(-1).view(torch.uint8)


def read_mla_slots(cache: torch.Tensor, layout: MLAPagedLayout, slots: torch.Tensor) -> MLAEntries:
    """The stored entries at ``slots`` [n]."""
    slots = slots.long()
    blk, off = slots // layout.block_size, slots % layout.block_size
    scale = None
    if layout.scale_offset >= 0:
        scale = _section(cache, layout, "latent_scale")[blk, off].contiguous().view(torch.float16)[..., 0]
    k_pe = _section(cache, layout, "k_pe")[blk, off].contiguous().view(torch.bfloat16)
    return MLAEntries(_section(cache, layout, "latent_index")[blk, off].contiguous(), scale, k_pe)


def read_mla_tokens(cache: torch.Tensor, layout: MLAPagedLayout, block_table_row: torch.Tensor, n: int) -> MLAEntries:
    """``read_mla_slots`` for tokens 0..n-1 of one request (its block table row)."""
    t = torch.arange(n, device=cache.device)
    return read_mla_slots(cache, layout, block_table_row.long()[t // layout.block_size] * layout.block_size
                          + t % layout.block_size)


def mla_gather_dequant_ref(cache: torch.Tensor, layout: MLAPagedLayout, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                           seq_starts: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``ops.mla.mla_gather_dequant``: [num_tokens, kv_lora_rank + rope_dim] float32 rows [kv_c | k_pe]
    of the tokens vLLM's ``gather_and_maybe_dequant_cache`` contract names."""
    i = torch.arange(num_tokens, device=cache.device)
    seq = token_to_seq[:num_tokens].long()
    pos = i - cu_seq_lens.long()[seq]
    if seq_starts is not None:
        pos = pos + seq_starts.long()[seq]
    slots = block_table.long()[seq, pos // layout.block_size] * layout.block_size + pos % layout.block_size
    kv_c, k_pe = mla_decode_ref(read_mla_slots(cache, layout, slots), layout.fmt)
    return torch.cat([kv_c, k_pe], dim=-1)


# ----------------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------------


def _check_queries(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> None:
    if ql_nope.dim() != 3 or ql_nope.shape[-1] != kv_lora_rank or q_pe.shape != (*ql_nope.shape[:2], rope_dim):
        raise ValueError(f"ql_nope [B, H, {kv_lora_rank}] and q_pe [B, H, {rope_dim}] expected, got "
                         f"{tuple(ql_nope.shape)} and {tuple(q_pe.shape)}")


def _softmax_attend(s: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [H, n] (already scaled) and values [n, L] -> (out [H, L], lse [H]) in float64."""
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[:, None]) @ values, lse


def mla_attention_dense_ref(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                            seq_lens: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain MLA decode attention on dense latents, float64: ql_nope [B, H, L] (the absorbed query), q_pe [B, H, R],
    kv_c [B, T, L], k_pe [B, T, R], request b attending to its first seq_lens[b] tokens -> (out [B, H, L],
    lse [B, H]) float32; lse natural-log, -inf (and out 0) for a request with no token."""
    _check_queries(ql_nope, q_pe, kv_c.shape[-1], k_pe.shape[-1])
    b, h, lr = ql_nope.shape
    out = torch.zeros(b, h, lr, dtype=torch.float64, device=ql_nope.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float64, device=ql_nope.device)
    for r, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        c, pe = kv_c[r, :n].double(), k_pe[r, :n].double()
        s = (ql_nope[r].double() @ c.T + q_pe[r].double() @ pe.T) * softmax_scale
        out[r], lse[r] = _softmax_attend(s, c)
    return out.float(), lse.float()


def mla_decode_attention_ref(ql_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, layout: MLAPagedLayout,
                             block_table: torch.Tensor, seq_lens: torch.Tensor,
                             softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over compressed pages in the rotated domain (module docstring), float64: ql_nope
    [B, H, L] (absorbed), q_pe [B, H, R], request b reading tokens 0..seq_lens[b]-1 through block_table[b] ->
    (out [B, H, L], lse [B, H]) float32, as ``mla_attention_dense_ref`` on the decoded latents."""
    fmt = layout.fmt
    _check_queries(ql_nope, q_pe, fmt.kv_lora_rank, fmt.rope_dim)
    b, h, lr = ql_nope.shape
    q_rot = rotate(ql_nope.float(), fmt.seed).double()  # once per head
    acc = torch.zeros(b, h, lr, dtype=torch.float64, device=ql_nope.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float64, device=ql_nope.device)
    for r, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        e = read_mla_tokens(cache, layout, block_table[r], n)
        c = mla_rotated_latent_ref(e, fmt).double()  # [n, L] rotated domain: scale * c[idx]
        s = (q_rot[r] @ c.T + q_pe[r].double() @ e.k_pe.double().T) * softmax_scale
        acc[r], lse[r] = _softmax_attend(s, c)
    return unrotate(acc, fmt.seed).float(), lse.float()  # once per head


# ----------------------------------------------------------------------------------------------
# vLLM's fp8 MLA entries (baselines)
# ----------------------------------------------------------------------------------------------


def fp8_mla_round_trip(kv_c: torch.Tensor, k_pe: torch.Tensor,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fp8`` MLA entry (576 B: kv_c and k_pe as e4m3 over one per-tensor scale), stored and read back:
    (kv_c, k_pe) float32. ``scale``: the per-tensor scale (vLLM's k_scale); None takes amax / 448 of both."""
    if scale is None:
        scale = max(float(kv_c.abs().max()), float(k_pe.abs().max())) / FP8_MAX or 1.0

    def rt(x):
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale

    return rt(kv_c), rt(k_pe)


def fp8_ds_mla_round_trip(kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fp8_ds_mla`` entry (656 B: kv_c as e4m3 with one fp32 scale amax / 448 per tile of 128, k_pe
    bf16), stored and read back: (kv_c, k_pe) float32."""
    x = kv_c.float().unflatten(-1, (-1, MLA_FP8_DS_TILE))
    s = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    y = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return y.flatten(-2), k_pe.to(torch.bfloat16).float()


__all__ = [
    "MLAEntries", "fp8_ds_mla_round_trip", "fp8_mla_round_trip", "mla_attention_dense_ref",
    "mla_decode_attention_ref", "mla_decode_ref", "mla_encode_ref", "mla_entries_from_bytes", "mla_entry_bytes",
    "mla_gather_dequant_ref", "mla_rotated_latent_ref", "mla_store_ref", "read_mla_slots", "read_mla_tokens",
]

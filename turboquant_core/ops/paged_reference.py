# SPDX-License-Identifier: Apache-2.0
"""Plain-torch references of the paged TurboQuant ops: the quantizers, packing and indexed reads and
writes on the page layout of ``ops.page_layout``, no Triton. They state what the kernels compute (the
tests and benchmarks compare against them) and run wherever torch does.

- ``tq_store_ref``: ``ops.kv_store.tq_store``; ``center_sums_ref``: ``ops.kv_store.tq_key_center_sums``;
  ``center_sums_cached_ref``: the same with sums kept across steps (tags and block epochs).
- ``read_slots`` / ``read_cached_tokens``: the raw stored data of slots / of one request's tokens.
- ``dequant_cached_ref``: one request's tokens dequantized, K and V float32 (key centering undone).
- ``tq_paged_attention_ref``: ``ops.paged_attention.tq_paged_attention`` as naive float64 attention;
  ``tq_gather_dequant_ref``: ``ops.paged_attention.tq_gather_dequant``.
"""

from __future__ import annotations

import math

import torch

from ..quantizer import FP8Quantizer
from .codec import decode_ref, encode_ref
from .key_centering import (
    KeyCentering,
    center_sums_from_keys_ref,
    center_vectors_ref,
    request_positions,
    token_centers_ref,
)
from .page_layout import PagedTQLayout, _cache_views, _check_centering, _check_kv

# ----------------------------------------------------------------------------------------------
# Store
# ----------------------------------------------------------------------------------------------


def _encode_tokens_ref(key: torch.Tensor, value: torch.Tensor, layout: PagedTQLayout):
    """Reference encodings: (k_idx [.., KB] u8, k_scale fp16 or None, v_idx, v_scale)."""
    f, d = layout.fmt, layout.head_dim
    if layout.key_is_fp8:
        k_idx, k_scale = FP8Quantizer(d, f.key_seed).quantize(key), None
    else:
        k_idx, k_scale = encode_ref(key.float(), f.key.bits, f.key_seed, f.key.norm_correction)
    v_idx, v_scale = encode_ref(value.float(), f.value.bits, f.value_seed, f.value.norm_correction)
    return k_idx, k_scale, v_idx, v_scale


def _section(cache: torch.Tensor, layout: PagedTQLayout, name: str) -> torch.Tensor:
    """View of one section of every region: [num_blocks, Hkv, block_size, bytes per token]."""
    off, size = {n: (o, s) for n, o, s in layout.sections()}[name]
    sec = cache[:, :, off : off + size]
    return sec.unflatten(2, (layout.block_size, size // layout.block_size))


def tq_store_ref(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 layout: PagedTQLayout, *, centering: KeyCentering | None = None,
                 query_start_loc: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, center_sums: torch.Tensor | None = None,
                 block_epochs: torch.Tensor | None = None):
    """Plain-torch reference of ``tq_store`` (quantizers + packing, indexed writes), same arguments.
    With centering and no ``center_sums``, the sums come from ``center_sums_ref`` after the first pass;
    given ones (e.g. the kernel's) are used as they are. ``block_epochs``: +1 per first-page token stored,
    in its block (``tq_store``'s bump). Returns the sums used (or None)."""
    _check_kv(key, "key", layout)
    _cache_views(cache, layout, key.shape[1])
    n = key.shape[0]
    keep = slot_mapping[:n] >= 0
    if centering is None:
        _store_tokens_ref(key, value, cache, slot_mapping[:n], keep, keep, layout)
        return None
    _check_centering(centering, layout)
    pos = request_positions(query_start_loc, seq_lens, n)
    req = torch.searchsorted(query_start_loc.long()[1:], torch.arange(n, device=key.device), right=True)
    req = req.clamp_max(block_table.shape[0] - 1)
    first = keep & (pos >= 0) & (pos < layout.block_size)
    _store_tokens_ref(key, value, cache, slot_mapping[:n], first, keep, layout)
    if block_epochs is not None:
        blocks = slot_mapping[:n][first].long() // layout.block_size
        block_epochs.index_add_(0, blocks, torch.ones_like(blocks, dtype=block_epochs.dtype))
    if center_sums is None:
        center_sums = center_sums_ref(cache, layout, centering, block_table, seq_lens)
    later = keep & (pos >= layout.block_size)
    mu, mup = center_vectors_ref(center_sums[req], centering)
    centred = (key.double() - token_centers_ref(mu, mup, pos.clamp_min(0), centering)).float()
    _store_tokens_ref(centred, value, cache, slot_mapping[:n], later, torch.zeros_like(keep), layout)
    return center_sums


def _store_tokens_ref(key, value, cache, slots, k_keep, v_keep, layout: PagedTQLayout) -> None:
    """Encode and write the keys of tokens ``k_keep`` and the values of tokens ``v_keep`` [T] bool."""
    k_idx, k_scale, v_idx, v_scale = _encode_tokens_ref(key, value, layout)
    for keep, parts in ((k_keep, (("k_index", k_idx), ("k_scale", k_scale))),
                        (v_keep, (("v_index", v_idx), ("v_scale", v_scale)))):
        sl = slots[keep].long()
        blk, off = sl // layout.block_size, sl % layout.block_size
        for name, data in parts:
            if data is None:
                continue
            data = data[keep]
            if name.endswith("scale"):
                data = data.view(torch.uint8).view(*data.shape, 2)
            _section(cache, layout, name)[blk, :, off] = data


def center_sums_ref(cache: torch.Tensor, layout: PagedTQLayout, centering: KeyCentering,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, *, before_store: bool = False) -> torch.Tensor:
    """Reference of ``tq_key_center_sums``: [R, Hkv, 2, dim_pad] float32 from the decoded first pages (zeros
    where not full: seq_len >= block size, or seq_len - 1 >= block size ``before_store``)."""
    out = torch.zeros(block_table.shape[0], cache.shape[1], 2, centering.dim_pad, dtype=torch.float64,
                      device=cache.device)
    for r, n in enumerate(seq_lens.tolist()[: block_table.shape[0]]):
        if n - int(before_store) >= layout.block_size:
            k, _ = dequant_cached_ref(cache, layout, block_table[r], layout.block_size)
            out[r] = center_sums_from_keys_ref(k.transpose(0, 1), centering)
    return out.float()


def center_sums_cached_ref(cache: torch.Tensor, layout: PagedTQLayout, centering: KeyCentering,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, center_sums: torch.Tensor,
                           center_tags: torch.Tensor, block_epochs: torch.Tensor, *,
                           before_store: bool = False) -> torch.Tensor:
    """Reference of ``tq_key_center_sums`` with sums kept across steps: updates ``center_sums`` and
    ``center_tags`` [R, Hkv, 2] in place and returns which (row, KV head) it wrote [R, Hkv] bool.

    Row r, head h with first block b = block_table[r, 0]: a first page that is not full gets zeros and the
    invalid tag (-1, 0); a full one whose tag is (b, block_epochs[b]) is left alone; any other gets the sums
    of ``center_sums_ref`` and that tag."""
    num_reqs = block_table.shape[0]
    fresh = center_sums_ref(cache, layout, centering, block_table, seq_lens, before_store=before_store)
    full = (seq_lens[:num_reqs].long() - int(before_store) >= layout.block_size)[:, None]  # [R, 1]
    first = block_table[:, 0].long()
    epoch = torch.where(full[:, 0], block_epochs.long()[first.clamp(0, block_epochs.shape[0] - 1)], 0)
    tags = center_tags[:num_reqs].long()
    hit = full & (tags[..., 0] == first[:, None]) & (tags[..., 1] == epoch[:, None])
    write = ~hit
    center_sums[:num_reqs][write] = fresh[write]
    new_tag = torch.stack([torch.where(full[:, 0], first, -1), epoch], dim=-1).to(center_tags.dtype)  # [R, 2]
    center_tags[:num_reqs][write] = new_tag[:, None, :].expand(-1, center_tags.shape[1], -1)[write]
    return write


# ----------------------------------------------------------------------------------------------
# Reads and dequantization
# ----------------------------------------------------------------------------------------------


def read_slots(cache: torch.Tensor, layout: PagedTQLayout, slots: torch.Tensor):
    """Raw stored data at ``slots`` [n]: (k_idx [n, Hkv, KB] uint8, k_scale fp16 [n, Hkv] or None,
    v_idx [n, Hkv, VB] uint8, v_scale fp16 [n, Hkv])."""
    slots = slots.long()
    blk, off = slots // layout.block_size, slots % layout.block_size

    def scale(name):
        return _section(cache, layout, name)[blk, :, off].contiguous().view(torch.float16)[..., 0]

    k_idx = _section(cache, layout, "k_index")[blk, :, off]
    v_idx = _section(cache, layout, "v_index")[blk, :, off]
    k_scale = None if layout.key_is_fp8 else scale("k_scale")
    return k_idx, k_scale, v_idx, scale("v_scale")


def read_cached_tokens(cache: torch.Tensor, layout: PagedTQLayout, block_table_row: torch.Tensor, n: int):
    """``read_slots`` for tokens 0..n-1 of one request (its block table row)."""
    t = torch.arange(n, device=cache.device)
    return read_slots(cache, layout, block_table_row.long()[t // layout.block_size] * layout.block_size
                      + t % layout.block_size)


def dequant_cached_ref(cache: torch.Tensor, layout: PagedTQLayout, block_table_row: torch.Tensor, n: int, *,
                       centering: KeyCentering | None = None, center_sums_row: torch.Tensor | None = None):
    """Tokens 0..n-1 of one request dequantized by the references: K, V [n, Hkv, d] float32.
    With ``centering``, keys get their page's centre back (sums [Hkv, 2, dim_pad] of the request)."""
    f, d = layout.fmt, layout.head_dim
    k_idx, k_scale, v_idx, v_scale = read_cached_tokens(cache, layout, block_table_row, n)
    if layout.key_is_fp8:
        k = FP8Quantizer(d, f.key_seed).dequantize(k_idx.contiguous())
    else:
        k = decode_ref(k_idx, k_scale, d, f.key.bits, f.key_seed)
    v = decode_ref(v_idx, v_scale, d, f.value.bits, f.value_seed)
    k = k.double()
    if centering is not None:
        mu, mup = center_vectors_ref(center_sums_row, centering)  # [Hkv, dim_pad]
        t = torch.arange(n, device=cache.device)
        k = k + token_centers_ref(mu.expand(n, *mu.shape), mup.expand(n, *mup.shape), t, centering)
    return k.float(), v.float()


# ----------------------------------------------------------------------------------------------
# Attention and gather + dequantize
# ----------------------------------------------------------------------------------------------


def tq_paged_attention_ref(q: torch.Tensor, cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, causal: bool = True,
                           sliding_window: int | None = None, softmax_scale: float | None = None,
                           centering: KeyCentering | None = None, center_sums: torch.Tensor | None = None):
    """Reference: gather pages per request, dequantize with the references, naive float64 softmax
    attention with the same masking. Returns out (q.dtype, rows outside the requests zero) and
    lse [Hq, Tq] float32 (-inf for rows that see no token)."""
    tq, hq, d = q.shape
    hkv = cache.shape[1]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(tq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float64, device=q.device)
    qsl, sl = query_start_loc.tolist(), seq_lens.tolist()
    for r in range(block_table.shape[0]):
        q0, q1, n = qsl[r], qsl[r + 1], sl[r]
        nq = q1 - q0
        if nq <= 0 or n <= 0:
            continue
        k, v = dequant_cached_ref(cache, layout, block_table[r], n, centering=centering,
                                  center_sums_row=None if centering is None else center_sums[r])
        k = k.double().repeat_interleave(g, dim=1)  # [n, Hq, d]
        v = v.double().repeat_interleave(g, dim=1)
        pos = torch.arange(nq, device=q.device) + (n - nq if causal else n)
        t = torch.arange(n, device=q.device)
        mask = t[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= t[None, :] > pos[:, None] - sliding_window
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * scale
        s = s.masked_fill(~mask[None], float("-inf"))
        lse_r = torch.logsumexp(s, dim=-1)  # [Hq, nq]
        p = torch.exp(s - torch.where(torch.isinf(lse_r), 0.0, lse_r)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
        lse[:, q0:q1] = lse_r
    return out.to(q.dtype), lse.float()


def tq_gather_dequant_ref(cache: torch.Tensor, layout: PagedTQLayout, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, *, centering: KeyCentering | None = None,
                          center_sums: torch.Tensor | None = None):
    """Reference: concatenated dequantized K, V [sum(seq_lens), Hkv, d] float32."""
    ks, vs = [], []
    for r, n in enumerate(seq_lens.tolist()):
        k, v = dequant_cached_ref(cache, layout, block_table[r], n, centering=centering,
                                  center_sums_row=None if centering is None else center_sums[r])
        ks.append(k)
        vs.append(v)
    return torch.cat(ks), torch.cat(vs)


__all__ = [
    "center_sums_cached_ref", "center_sums_ref", "dequant_cached_ref", "read_cached_tokens", "read_slots",
    "tq_gather_dequant_ref", "tq_paged_attention_ref", "tq_store_ref",
]

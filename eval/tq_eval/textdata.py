# SPDX-License-Identifier: Apache-2.0
"""Token windows of a text file for perplexity (WikiText-2 raw, or any UTF-8 text).

A window is ``prefix_ids + text_ids[start : start + window_tokens - len(prefix_ids)]``, where
``prefix_ids`` are the special tokens the tokenizer puts in front of a document (Gemma's <bos>;
nothing for SmolLM2). Windows do not overlap and are spread evenly over the whole text, so a
small number of them still samples the full document.

Scored positions: with chunked prefill of C tokens per step, the tokens of the first chunk only
attend to each other (fresh keys and values, the same for every KV-cache dtype on backends that
attend fresh tokens in full precision), so a prediction is scored only when the position that
makes it (p - 1) lies past the first chunk: p in [C + 1, window). See ``scored_positions``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


def load_text(path: str | Path) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file not found: {p}")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"text file is empty: {p}")
    return text


def special_prefix(
    encode_with_specials: Callable[[str], Sequence[int]], encode_plain: Callable[[str], Sequence[int]]
) -> list[int]:
    """Leading special tokens the tokenizer adds to a document (e.g. [bos_id]), found by comparing
    the encodings of a short text with and without special tokens."""
    sample = "The quick brown fox."
    with_sp, plain = list(encode_with_specials(sample)), list(encode_plain(sample))
    for i in range(len(with_sp) + 1):
        if with_sp[i:i + len(plain)] == plain:
            return with_sp[:i]
    return []


def token_windows(
    token_ids: Sequence[int], window_tokens: int, num_windows: int, prefix_ids: Sequence[int] = ()
) -> list[list[int]]:
    """Up to ``num_windows`` non-overlapping windows of exactly ``window_tokens`` tokens each."""
    body = window_tokens - len(prefix_ids)
    if body < 2:
        raise ValueError(f"window_tokens={window_tokens} leaves no room after {len(prefix_ids)} prefix tokens")
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    available = len(token_ids) // body
    if available < 1:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than one window of {body}")
    n = min(num_windows, available)
    # Spread the windows over the text: start i at floor(i * (len - body) / (n - 1)) would overlap
    # when n == available, so step over whole window slots instead.
    slot = available / n
    starts = [int(i * slot) * body for i in range(n)]
    return [list(prefix_ids) + list(token_ids[s:s + body]) for s in starts]


def scored_positions(window_tokens: int, prefill_chunk: int) -> list[int]:
    """Prompt positions p whose prediction (made at p - 1) saw KV-cache context: p - 1 >= chunk."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if window_tokens <= prefill_chunk + 1:
        raise ValueError(
            f"window_tokens={window_tokens} must exceed prefill_chunk + 1 = {prefill_chunk + 1}: "
            "nothing would be read from the KV cache"
        )
    return list(range(prefill_chunk + 1, window_tokens))

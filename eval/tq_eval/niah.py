# SPDX-License-Identifier: Apache-2.0
"""Needle in a haystack that needs no download: a seeded synthetic haystack, one numeric needle.

The haystack is made of filler sentences drawn from a fixed word list (no digits anywhere), so
the only number in the prompt is the needle ``The special magic number is NNNNNN.``. The needle
sits at a requested depth (0% = first sentence of the haystack, 100% = last); the question comes
at the end, followed by the answer prefix ``The special magic number is`` so that even a small
model only has to copy the number. Lengths are counted in tokens of whatever tokenizer the caller
passes (``count_tokens(text) -> int``), after ``render`` (e.g. a chat template) is applied.

Everything is deterministic: the haystack depends on (seed, length, sample) and not on the
depth, so the depths of one (length, sample) differ only in where the needle sits; the needle
value depends on (seed, length, depth, sample).

Example (a whitespace "tokenizer"):

>>> s = make_sample(lambda t: len(t.split()), target_tokens=300, depth_percent=50, seed=1)
>>> s.num_tokens <= 300, s.needle in s.prompt, score_answer(f" {s.needle}.", s.needle)
(True, True, True)
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

NEEDLE_TEMPLATE = "The special magic number is {value}."
ANSWER_PREFIX = "The special magic number is"
INSTRUCTION = (
    "A special magic number is hidden somewhere in the following text. "
    "Find it and remember it; you will be asked for it at the end."
)
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
NEEDLE_DIGITS = 6

# Plain words only: no digits (the needle must be the only number) and none of the words of the
# needle sentence, so nothing in the haystack looks like an answer.
FILLER_WORDS = (
    "river mountain garden window teacher market village morning evening winter summer autumn "
    "spring forest ocean island bridge station letter story picture kitchen table chair door road "
    "city country family friend doctor farmer painter singer writer student library museum theater "
    "harbor valley meadow cloud storm rain snow wind sun moon star light shadow color sound music "
    "song dance game paper book page word voice idea plan reason answer question problem lesson "
    "journey travel walk run climb swim build carry bring hold open close watch listen remember "
    "forget learn teach write read speak call follow lead help wait stay leave arrive return begin "
    "finish change grow fall rise turn move stand sit sleep dream laugh smile quiet loud bright dark "
    "warm cold soft hard early late quick slow gentle careful simple strange ancient modern small "
    "large narrow wide empty full green blue yellow brown golden silver wooden stone glass iron "
    "old young happy calm busy lonely patient curious brave honest clever distant nearby always "
    "often sometimes rarely slowly quickly softly together alone again around along across behind "
    "beyond beneath between through toward during after before while because although the a an "
    "and but or so yet of in on at by with from into over under near far this that these those "
    "every each some many few most other another such own same"
).split()
_FORBIDDEN_FILLER = {"special", "magic", "number", "is"}
assert not _FORBIDDEN_FILLER & set(FILLER_WORDS)
assert not any(ch.isdigit() for w in FILLER_WORDS for ch in w)

CountTokens = Callable[[str], int]
Render = Callable[[str], str]


def plain_prompt(body: str) -> str:
    """The prompt for a model without a chat template: body, then the answer prefix."""
    return f"{body}\n{ANSWER_PREFIX}"


@dataclass(frozen=True)
class NiahSample:
    """One prompt: ``prompt`` goes to the model as is; ``needle`` is the number to retrieve.

    length: the requested context length in tokens (the label); num_tokens: the prompt's actual
    token count (<= the target); depth_percent: requested depth; needle_depth_percent: where the
    needle landed, as the share of haystack characters before it (snapped to a sentence boundary).
    """

    length: int
    depth_percent: float
    sample: int
    needle: str
    prompt: str
    num_tokens: int
    target_tokens: int
    needle_depth_percent: float

    def to_dict(self, with_prompt: bool = False) -> dict:
        d = asdict(self)
        if not with_prompt:
            d.pop("prompt")
        return d


def _rng(*parts: object) -> random.Random:
    # str seeds hash deterministically (sha512), unlike hash() of tuples.
    return random.Random("tq-niah/" + "/".join(str(p) for p in parts))


def needle_value(seed: int, length: int, depth_percent: float, sample: int) -> str:
    """The needle number for one cell: NEEDLE_DIGITS digits, no leading zero."""
    rng = _rng("needle", seed, length, f"{float(depth_percent):g}", sample)
    return str(rng.randrange(10 ** (NEEDLE_DIGITS - 1), 10**NEEDLE_DIGITS))


class _SentencePool:
    """Filler sentences from one seeded stream; growing the pool never changes earlier ones."""

    def __init__(self, rng: random.Random):
        self._rng = rng
        self.sentences: list[str] = []

    def grow(self, n: int) -> None:
        for _ in range(n):
            words = [self._rng.choice(FILLER_WORDS) for _ in range(self._rng.randint(8, 16))]
            words[0] = words[0].capitalize()
            self.sentences.append(" ".join(words) + ".")


def insertion_index(sentences: Sequence[str], depth_percent: float) -> int:
    """Sentence boundary closest to ``depth_percent`` of the haystack's characters (0..len)."""
    if not sentences:
        return 0
    total = sum(len(s) + 1 for s in sentences)
    goal = total * depth_percent / 100.0
    best, best_err, cum = 0, abs(goal), 0
    for i, s in enumerate(sentences, start=1):
        cum += len(s) + 1
        err = abs(cum - goal)
        if err < best_err:
            best, best_err = i, err
    return best


def build_body(sentences: Sequence[str], needle_sentence: str, index: int) -> str:
    """Instruction, haystack with the needle sentence before ``sentences[index]``, question."""
    hay = list(sentences[:index]) + [needle_sentence] + list(sentences[index:])
    return f"{INSTRUCTION}\n\n{' '.join(hay)}\n\n{QUESTION}"


def _check_depth(depth_percent: float) -> float:
    d = float(depth_percent)
    if not 0.0 <= d <= 100.0:
        raise ValueError(f"depth_percent must be within 0..100, got {depth_percent}")
    return d


def _fit_sentence_count(
    pool: _SentencePool,
    count_tokens: CountTokens,
    render: Render,
    target_tokens: int,
    depth_percent: float,
    needle_sentence: str,
) -> int:
    """Largest n such that the prompt with the first n pool sentences has <= target tokens."""

    def n_tokens(n: int) -> int:
        hay = pool.sentences[:n]
        return count_tokens(render(build_body(hay, needle_sentence, insertion_index(hay, depth_percent))))

    base = n_tokens(0)
    if base > target_tokens:
        raise ValueError(
            f"target_tokens={target_tokens} is too small: the prompt without any haystack already "
            f"takes {base} tokens"
        )
    # Bracket the count from a 16-sentence estimate (growing the pool as needed), then narrow it
    # by interpolation: tokens grow almost linearly with sentences, so a probe usually lands
    # within a sentence or two; a bisection step follows whenever one side stalls. Each probe
    # tokenizes a whole prompt, so few probes keep long contexts cheap.
    if len(pool.sentences) < 16:
        pool.grow(16 - len(pool.sentences))
    per_sentence = max(1.0, (n_tokens(16) - base) / 16)
    lo, t_lo = 0, base
    hi = max(int((target_tokens - base) / per_sentence * 1.05) + 2, 1)
    pool.grow(max(0, hi - len(pool.sentences)))
    t_hi = n_tokens(hi)
    while t_hi <= target_tokens:
        lo, t_lo = hi, t_hi
        hi += hi // 4 + 2
        pool.grow(hi - len(pool.sentences))
        t_hi = n_tokens(hi)
    # invariant: n_tokens(lo) = t_lo <= target < t_hi = n_tokens(hi)
    last_side = None
    stalled = False
    while hi - lo > 1:
        if stalled:
            mid = (lo + hi) // 2
        else:
            mid = lo + int((target_tokens - t_lo) * (hi - lo) / max(t_hi - t_lo, 1))
        mid = min(max(mid, lo + 1), hi - 1)
        t_mid = n_tokens(mid)
        side = "lo" if t_mid <= target_tokens else "hi"
        if side == "lo":
            lo, t_lo = mid, t_mid
        else:
            hi, t_hi = mid, t_mid
        stalled = side == last_side and not stalled
        last_side = side
    return lo


def _assemble(
    pool: _SentencePool,
    n: int,
    count_tokens: CountTokens,
    render: Render,
    target_tokens: int,
    depth_percent: float,
    needle_sentence: str,
) -> tuple[str, int, float, int]:
    """Prompt with n sentences (fewer if this depth overflows), its tokens and needle depth."""
    while True:
        hay = pool.sentences[:n]
        idx = insertion_index(hay, depth_percent)
        prompt = render(build_body(hay, needle_sentence, idx))
        num = count_tokens(prompt)
        if num <= target_tokens or n == 0:
            break
        n -= 1
    if num > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is too small for this prompt ({num} tokens)")
    # Depth by characters: filler sentences have a near-constant token/character ratio, and
    # re-tokenizing a long haystack per depth costs more than the whole fit.
    before = sum(len(x) + 1 for x in hay[:idx])
    total = sum(len(x) + 1 for x in hay)
    depth = 100.0 * before / total if total else 0.0
    return prompt, num, depth, n


def make_sample(
    count_tokens: CountTokens,
    target_tokens: int,
    depth_percent: float,
    *,
    seed: int = 0,
    sample: int = 0,
    render: Render = plain_prompt,
    length: int | None = None,
) -> NiahSample:
    """One NIAH prompt with at most ``target_tokens`` tokens (as close to it as a sentence allows).

    ``length`` is the label the haystack is seeded with (defaults to ``target_tokens``); a caller
    that must leave room for generation passes ``length=L, target_tokens=L - room``.
    """
    return make_grid(
        count_tokens, [length if length is not None else target_tokens], [depth_percent], samples=1,
        seed=seed, render=render, first_sample=sample,
        target_tokens={length if length is not None else target_tokens: target_tokens},
    )[0]


def make_grid(
    count_tokens: CountTokens,
    lengths: Iterable[int],
    depths: Iterable[float] = DEFAULT_DEPTHS,
    samples: int = 1,
    *,
    seed: int = 0,
    render: Render = plain_prompt,
    target_tokens: dict[int, int] | None = None,
    first_sample: int = 0,
) -> list[NiahSample]:
    """All (length, depth, sample) prompts, ordered by length, then sample, then depth.

    target_tokens: optional {length: max prompt tokens} where it must be below the label (room
    for the answer near the model's limit).
    """
    lengths = [int(x) for x in lengths]
    depths = [_check_depth(d) for d in depths]
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not lengths or not depths:
        raise ValueError("need at least one length and one depth")
    out: list[NiahSample] = []
    for length in lengths:
        target = (target_tokens or {}).get(length, length)
        if target < 1:
            raise ValueError(f"length {length} leaves no room for a prompt (target {target})")
        for s in range(first_sample, first_sample + samples):
            pool = _SentencePool(_rng("haystack", seed, length, s))
            n = None
            for depth in depths:
                value = needle_value(seed, length, depth, s)
                needle_sentence = NEEDLE_TEMPLATE.format(value=value)
                if n is None:
                    # The count barely depends on where the needle sits: fit once per haystack.
                    n = _fit_sentence_count(pool, count_tokens, render, target, depth, needle_sentence)
                prompt, num, actual_depth, _ = _assemble(
                    pool, n, count_tokens, render, target, depth, needle_sentence
                )
                out.append(
                    NiahSample(
                        length=length, depth_percent=depth, sample=s, needle=value, prompt=prompt,
                        num_tokens=num, target_tokens=target, needle_depth_percent=actual_depth,
                    )
                )
    return out


_COMMA_IN_NUMBER = re.compile(r"(?<=\d)[,\s](?=\d{3}\b)")


def score_answer(answer: str, needle: str) -> bool:
    """Exact retrieval: the needle number appears in the answer as a whole number.

    Thousands separators ("482,913", "482 913") are accepted; a longer digit run that merely
    contains the needle ("14829130") is not.
    """
    text = _COMMA_IN_NUMBER.sub("", answer)
    return re.search(rf"(?<!\d){re.escape(needle)}(?!\d)", text) is not None


def summarize(records: Iterable[dict]) -> dict:
    """Accuracy by length, by (length, depth) cell, and overall.

    records: dicts with keys ``length``, ``depth_percent`` and ``correct`` (bool).
    Returns {"overall": {"acc", "n"}, "by_length": {"L": {"acc", "n"}}, "cells": [{"length",
    "depth_percent", "acc", "n"}, ...]} with lengths as strings (JSON keys) in ascending order.
    """
    by_len: dict[int, list[bool]] = defaultdict(list)
    by_cell: dict[tuple[int, float], list[bool]] = defaultdict(list)
    all_: list[bool] = []
    for r in records:
        ok = bool(r["correct"])
        by_len[int(r["length"])].append(ok)
        by_cell[(int(r["length"]), float(r["depth_percent"]))].append(ok)
        all_.append(ok)

    def acc(xs: list[bool]) -> dict:
        return {"acc": sum(xs) / len(xs) if xs else None, "n": len(xs)}

    return {
        "overall": acc(all_),
        "by_length": {str(k): acc(by_len[k]) for k in sorted(by_len)},
        "cells": [
            {"length": k[0], "depth_percent": k[1], **acc(by_cell[k])} for k in sorted(by_cell)
        ],
    }


def default_lengths(max_model_len: int, start: int = 1024) -> list[int]:
    """Powers of two from ``start`` up to the model's limit, plus the limit itself if it is not one."""
    if max_model_len < start:
        return [max_model_len]
    out, n = [], start
    while n <= max_model_len:
        out.append(n)
        n *= 2
    if out[-1] != max_model_len:
        out.append(max_model_len)
    return out

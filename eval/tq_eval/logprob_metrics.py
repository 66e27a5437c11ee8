# SPDX-License-Identifier: Apache-2.0
"""Perplexity, KL divergence and top-1 agreement from vLLM prompt logprobs.

vLLM returns, for every prompt position p >= 1, the logprob of the prompt token p and the top-K
logprobs of the distribution that predicted it (``SamplingParams(prompt_logprobs=K)``). It does
not return the full distribution, so KL(P_ref || Q) is estimated on a coarsened vocabulary:

- buckets: every token whose probability is known under both P and Q -- the reference's top-K
  tokens that also appear in Q's top-K, plus the prompt token itself (its logprob is always
  returned) -- and one "rest" bucket holding all remaining mass (1 - sum of the known ones);
- KL_est = sum_b P(b) log(P(b) / Q(b)) over those buckets.

Merging outcomes never increases KL (data-processing inequality), so KL_est <= the true KL, with
equality when the buckets cover the whole vocabulary; with K = 20 the rest bucket of a small
model typically holds a few percent of the mass. Report it as a lower bound.

Example (a full distribution over 3 tokens, so the estimate is exact):

>>> import numpy as np
>>> p, q = np.log([[0.7, 0.2, 0.1]]), np.log([[0.6, 0.3, 0.1]])
>>> ref = PromptLogprobs(np.array([0]), p[:, :1], np.array([[0, 1, 2]]), p)
>>> test = PromptLogprobs(np.array([0]), q[:, :1], np.array([[0, 1, 2]]), q)
>>> round(float(topk_kl(ref, test)[0]), 6), round(float((np.exp(p) * (p - q)).sum()), 6)
(0.026812, 0.026812)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Probabilities below this are treated as zero in the rest bucket (float32 sums of top-K
# probabilities can exceed 1 by a few ulps).
_REST_FLOOR = 1e-12


@dataclass
class PromptLogprobs:
    """Per predicted position: the prompt token and the top-K of the predicting distribution.

    target_ids int32 [N], target_logprobs float32 [N, 1] or [N], topk_ids int32 [N, K],
    topk_logprobs float32 [N, K] sorted by decreasing logprob (padding: id -1, logprob -inf).
    """

    target_ids: np.ndarray
    target_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray

    def __post_init__(self) -> None:
        self.target_ids = np.asarray(self.target_ids, dtype=np.int64).reshape(-1)
        self.target_logprobs = np.asarray(self.target_logprobs, dtype=np.float64).reshape(-1)
        self.topk_ids = np.asarray(self.topk_ids, dtype=np.int64)
        self.topk_logprobs = np.asarray(self.topk_logprobs, dtype=np.float64)
        n = self.target_ids.shape[0]
        if self.topk_ids.ndim != 2 or self.topk_ids.shape != self.topk_logprobs.shape:
            raise ValueError(
                f"topk_ids {self.topk_ids.shape} and topk_logprobs {self.topk_logprobs.shape} must be equal [N, K]"
            )
        if self.topk_ids.shape[0] != n or self.target_logprobs.shape[0] != n:
            raise ValueError("target_ids, target_logprobs and topk_* must have the same number of positions")

    @property
    def k(self) -> int:
        return int(self.topk_ids.shape[1])

    def __len__(self) -> int:
        return int(self.target_ids.shape[0])

    @staticmethod
    def concat(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        if not parts:
            raise ValueError("nothing to concatenate")
        return PromptLogprobs(
            np.concatenate([p.target_ids for p in parts]),
            np.concatenate([p.target_logprobs for p in parts]),
            np.concatenate([p.topk_ids for p in parts]),
            np.concatenate([p.topk_logprobs for p in parts]),
        )

    def select(self, index: np.ndarray) -> PromptLogprobs:
        return PromptLogprobs(
            self.target_ids[index], self.target_logprobs[index], self.topk_ids[index], self.topk_logprobs[index]
        )

    def to_tensors(self) -> dict[str, np.ndarray]:
        """Arrays for safetensors (fp32 logprobs, int32 ids)."""
        return {
            "target_ids": self.target_ids.astype(np.int32),
            "target_logprobs": self.target_logprobs.astype(np.float32),
            "topk_ids": self.topk_ids.astype(np.int32),
            "topk_logprobs": self.topk_logprobs.astype(np.float32),
        }

    @staticmethod
    def from_tensors(t: Mapping[str, np.ndarray]) -> PromptLogprobs:
        return PromptLogprobs(t["target_ids"], t["target_logprobs"], t["topk_ids"], t["topk_logprobs"])


def _value(x) -> float:
    # vLLM's Logprob dataclass has .logprob; older or hand-made containers hold floats.
    return float(getattr(x, "logprob", x))


def parse_prompt_logprobs(
    prompt_token_ids: Sequence[int], prompt_logprobs, k: int, positions: Sequence[int] | None = None
) -> PromptLogprobs:
    """Turn one request's ``RequestOutput.prompt_logprobs`` into arrays.

    prompt_logprobs: vLLM's per-position container -- either ``FlatLogprobs`` (its flat lists
    hold, per position, the prompt token first and then the top-K in rank order) or a list of
    ``{token_id: Logprob | float}`` dicts (position 0 is None). positions: which positions to keep
    (default: 1..len-1). Raises if a position lacks the prompt token's logprob.
    """
    n = len(prompt_token_ids)
    if len(prompt_logprobs) != n:
        raise ValueError(f"prompt_logprobs has {len(prompt_logprobs)} positions for {n} prompt tokens")
    pos = list(range(1, n)) if positions is None else [int(p) for p in positions]
    if any(p < 1 or p >= n for p in pos):
        raise ValueError(f"positions must lie in 1..{n - 1}")
    m = len(pos)
    tgt_ids = np.asarray([prompt_token_ids[p] for p in pos], dtype=np.int64)
    tgt_lp = np.empty(m, dtype=np.float64)
    top_ids = np.full((m, k), -1, dtype=np.int64)
    top_lp = np.full((m, k), -np.inf, dtype=np.float64)

    flat = all(hasattr(prompt_logprobs, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs"))
    if flat:
        starts, ends = prompt_logprobs.start_indices, prompt_logprobs.end_indices
        ids_all, lps_all = prompt_logprobs.token_ids, prompt_logprobs.logprobs
    for row, p in enumerate(pos):
        if flat:
            s, e = starts[p], ends[p]
            ids, lps = ids_all[s:e], lps_all[s:e]
            if e - s == k + 1 and ids[0] == tgt_ids[row]:
                tgt_lp[row] = lps[0]
                top_ids[row] = ids[1:]
                top_lp[row] = lps[1:]
                continue
            entries = dict(zip(ids, lps))
        else:
            d = prompt_logprobs[p]
            if d is None:
                raise ValueError(f"no logprobs at prompt position {p}")
            entries = {int(t): _value(v) for t, v in d.items()}
        t = int(tgt_ids[row])
        if t not in entries:
            raise ValueError(f"prompt token {t} has no logprob at position {p}")
        tgt_lp[row] = entries[t]
        best = sorted(entries.items(), key=lambda kv: -kv[1])[:k]
        for j, (tid, lp) in enumerate(best):
            top_ids[row, j] = tid
            top_lp[row, j] = lp
    return PromptLogprobs(tgt_ids, tgt_lp, top_ids, top_lp)


def perplexity(target_logprobs: np.ndarray) -> float:
    """exp(mean negative log-likelihood) of the given token logprobs."""
    lp = np.asarray(target_logprobs, dtype=np.float64).reshape(-1)
    if lp.size == 0:
        raise ValueError("no tokens to score")
    return float(math.exp(-lp.mean()))


def _check_same_positions(ref: PromptLogprobs, test: PromptLogprobs) -> None:
    if len(ref) != len(test) or not np.array_equal(ref.target_ids, test.target_ids):
        raise ValueError(
            "reference and test logprobs are not over the same tokens (different text, windows or tokenizer)"
        )


def topk_kl(ref: PromptLogprobs, test: PromptLogprobs) -> np.ndarray:
    """Per-position KL(ref || test) on the coarsened vocabulary described in the module doc [N]."""
    _check_same_positions(ref, test)
    p_lp, q_lp = ref.topk_logprobs, test.topk_logprobs
    n, k = p_lp.shape
    # q's logprob for each of ref's top-K tokens, where q returned it.
    match = ref.topk_ids[:, :, None] == test.topk_ids[:, None, :]  # [N, K, Kq]
    match &= ref.topk_ids[:, :, None] >= 0
    has_q = match.any(axis=2)
    q_for_ref = np.where(has_q, np.take_along_axis(q_lp, match.argmax(axis=2), axis=1), np.nan)
    # The prompt token's logprob is known under both, wherever it ranks.
    is_target = ref.topk_ids == ref.target_ids[:, None]
    q_for_ref = np.where(is_target, test.target_logprobs[:, None], q_for_ref)
    known = ~np.isnan(q_for_ref) & np.isfinite(p_lp)

    p = np.where(known, np.exp(p_lp), 0.0)
    q = np.where(known, np.exp(np.where(known, q_for_ref, 0.0)), 0.0)
    terms = np.where(known, p * (p_lp - np.where(known, q_for_ref, 0.0)), 0.0)
    kl = terms.sum(axis=1)
    sum_p, sum_q = p.sum(axis=1), q.sum(axis=1)

    # Target outside ref's top-K: one more exact bucket.
    extra = ~is_target.any(axis=1)
    pt, qt = np.exp(ref.target_logprobs), np.exp(test.target_logprobs)
    kl += np.where(extra, pt * (ref.target_logprobs - test.target_logprobs), 0.0)
    sum_p += np.where(extra, pt, 0.0)
    sum_q += np.where(extra, qt, 0.0)

    p_rest = np.clip(1.0 - sum_p, 0.0, 1.0)
    q_rest = np.clip(1.0 - sum_q, 0.0, 1.0)
    rest = np.where(
        p_rest > _REST_FLOOR,
        p_rest * (np.log(np.maximum(p_rest, _REST_FLOOR)) - np.log(np.maximum(q_rest, _REST_FLOOR))),
        0.0,
    )
    return np.maximum(kl + rest, 0.0)


def rest_mass(ref: PromptLogprobs) -> np.ndarray:
    """Probability mass outside the reference's top-K, per position [N] (how coarse the KL is)."""
    return np.clip(1.0 - np.exp(ref.topk_logprobs).sum(axis=1), 0.0, 1.0)


def top1_agreement(ref: PromptLogprobs, test: PromptLogprobs) -> float:
    """Share of positions where both distributions have the same most likely token."""
    _check_same_positions(ref, test)
    return float(np.mean(ref.topk_ids[:, 0] == test.topk_ids[:, 0]))


def compare(ref: PromptLogprobs, test: PromptLogprobs) -> dict:
    """All quality numbers of ``test`` against the reference ``ref`` (same positions)."""
    kl = topk_kl(ref, test)
    ppl_ref, ppl = perplexity(ref.target_logprobs), perplexity(test.target_logprobs)
    return {
        "tokens": len(ref),
        "ppl_ref": ppl_ref,
        "ppl": ppl,
        "dppl_pct": 100.0 * (ppl / ppl_ref - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "top1_agree": top1_agreement(ref, test),
        "ref_rest_mass_mean": float(rest_mass(ref).mean()),
        "topk": ref.k,
    }

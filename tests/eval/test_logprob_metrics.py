# SPDX-License-Identifier: Apache-2.0
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from tq_eval.logprob_metrics import (
    PromptLogprobs,
    compare,
    parse_prompt_logprobs,
    perplexity,
    rest_mass,
    top1_agreement,
    topk_kl,
)


@dataclass
class Lp:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLayout:
    """vLLM's FlatLogprobs storage: per position, the prompt token first, then the top-K by rank."""

    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def append(self, ids, lps):
        self.start_indices.append(len(self.logprobs))
        self.token_ids += list(ids)
        self.logprobs += list(lps)
        self.end_indices.append(len(self.logprobs))

    def __len__(self):
        return len(self.start_indices)


def _random_dists(n, vocab, seed, noise=0.0):
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=(n, vocab)) * 2.0
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    lq = lp + noise * np.random.default_rng(seed + 1).normal(size=(n, vocab))
    lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
    return lp, lq


def _topk(full, targets, k):
    order = np.argsort(-full, axis=1)[:, :k]
    return PromptLogprobs(targets, full[np.arange(len(targets)), targets], order, np.take_along_axis(full, order, 1))


def _exact_kl(lp, lq):
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def test_parse_dict_layout_with_target_inside_and_outside_topk():
    prompt = [5, 7, 9, 11]
    plp = [
        None,
        {7: Lp(-0.1, 1), 3: Lp(-2.5, 2)},              # target is the top-1: K entries
        {3: Lp(-0.3, 1), 4: Lp(-1.5, 2), 9: Lp(-6.0, 9)},  # target ranked 9th: K + 1 entries
        {11: -0.7, 2: -0.9},                             # plain floats are accepted
    ]
    out = parse_prompt_logprobs(prompt, plp, k=2)
    assert out.target_ids.tolist() == [7, 9, 11]
    assert out.target_logprobs.tolist() == pytest.approx([-0.1, -6.0, -0.7])
    assert out.topk_ids.tolist() == [[7, 3], [3, 4], [11, 2]]
    assert out.topk_logprobs[1].tolist() == pytest.approx([-0.3, -1.5])


def test_parse_flat_layout_and_positions():
    prompt = [1, 2, 3, 4]
    flat = FlatLayout()
    flat.append([], [])
    flat.append([2, 2, 8], [-0.2, -0.2, -1.9])      # prompt token, then top-2 (it is the top-1)
    flat.append([3, 6, 8], [-4.0, -0.5, -1.0])
    flat.append([4, 4, 6], [-0.1, -0.1, -3.0])
    out = parse_prompt_logprobs(prompt, flat, k=2, positions=[2, 3])
    assert out.target_ids.tolist() == [3, 4]
    assert out.target_logprobs.tolist() == pytest.approx([-4.0, -0.1])
    assert out.topk_ids.tolist() == [[6, 8], [4, 6]]


def test_parse_rejects_bad_input():
    with pytest.raises(ValueError, match="positions"):
        parse_prompt_logprobs([1, 2], [None], k=1)
    with pytest.raises(ValueError, match="no logprob"):
        parse_prompt_logprobs([1, 2], [None, {5: -0.1}], k=1)
    with pytest.raises(ValueError, match="1..1"):
        parse_prompt_logprobs([1, 2], [None, {2: -0.1}], k=1, positions=[0])


def test_parse_real_vllm_flat_logprobs_if_available():
    logprobs_mod = pytest.importorskip("vllm.logprobs")
    flat = logprobs_mod.create_prompt_logprobs(flat_logprobs=True)
    logprobs_mod.append_logprobs_for_next_position(flat, [5, 9, 5], [-2.0, -0.1, -2.0], [None] * 3, 2, 2)
    out = parse_prompt_logprobs([0, 5], flat, k=2)
    assert out.target_logprobs.tolist() == [-2.0] and out.topk_ids.tolist() == [[9, 5]]


def test_perplexity():
    assert perplexity(np.log([0.5, 0.25])) == pytest.approx(math.sqrt(8))
    with pytest.raises(ValueError):
        perplexity(np.array([]))


def test_kl_is_exact_when_topk_covers_the_vocabulary():
    lp, lq = _random_dists(n=37, vocab=11, seed=0, noise=0.4)
    t = np.random.default_rng(3).integers(0, 11, 37)
    est = topk_kl(_topk(lp, t, 11), _topk(lq, t, 11))
    np.testing.assert_allclose(est, _exact_kl(lp, lq), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_kl_estimate_is_a_lower_bound(k):
    lp, lq = _random_dists(n=53, vocab=41, seed=1, noise=0.5)
    t = np.random.default_rng(4).integers(0, 41, 53)
    est = topk_kl(_topk(lp, t, k), _topk(lq, t, k))
    exact = _exact_kl(lp, lq)
    assert np.all(est >= 0)
    assert np.all(est <= exact + 1e-9)
    if k == 20:  # most of the mass is covered: close to exact on average
        assert est.mean() > 0.8 * exact.mean()


def test_kl_grows_with_the_perturbation_and_is_zero_for_identical():
    lp, _ = _random_dists(n=40, vocab=30, seed=2)
    t = np.random.default_rng(5).integers(0, 30, 40)
    ref = _topk(lp, t, 8)
    assert np.allclose(topk_kl(ref, ref), 0.0)
    kls = []
    for noise in (0.05, 0.2, 0.8):
        _, lq = _random_dists(n=40, vocab=30, seed=2, noise=noise)
        kls.append(topk_kl(ref, _topk(lq, t, 8)).mean())
    assert kls[0] < kls[1] < kls[2]


def test_top1_agreement_and_rest_mass():
    lp, lq = _random_dists(n=64, vocab=13, seed=6, noise=1.0)
    t = np.zeros(64, dtype=int)
    ref, test = _topk(lp, t, 4), _topk(lq, t, 4)
    expected = np.mean(lp.argmax(1) == lq.argmax(1))
    assert top1_agreement(ref, test) == pytest.approx(expected)
    assert 0 < expected < 1
    full = np.sort(np.exp(lp), axis=1)[:, ::-1]
    np.testing.assert_allclose(rest_mass(ref), 1 - full[:, :4].sum(1), atol=1e-12)


def test_compare_and_mismatch():
    lp, lq = _random_dists(n=30, vocab=9, seed=7, noise=0.3)
    t = np.arange(30) % 9
    ref, test = _topk(lp, t, 9), _topk(lq, t, 9)
    c = compare(ref, test)
    ppl_r = math.exp(-lp[np.arange(30), t].mean())
    ppl_t = math.exp(-lq[np.arange(30), t].mean())
    assert c["ppl_ref"] == pytest.approx(ppl_r) and c["ppl"] == pytest.approx(ppl_t)
    assert c["dppl_pct"] == pytest.approx(100 * (ppl_t / ppl_r - 1))
    assert c["kl_mean"] == pytest.approx(_exact_kl(lp, lq).mean())
    assert c["tokens"] == 30 and c["topk"] == 9
    other = _topk(lq, (t + 1) % 9, 9)
    with pytest.raises(ValueError, match="same tokens"):
        compare(ref, other)


def test_tensors_round_trip_and_concat():
    lp, _ = _random_dists(n=10, vocab=7, seed=8)
    a = _topk(lp, np.arange(10) % 7, 3)
    b = PromptLogprobs.from_tensors(a.to_tensors())
    assert b.topk_ids.tolist() == a.topk_ids.tolist()
    np.testing.assert_allclose(b.topk_logprobs, a.topk_logprobs, rtol=1e-6)
    c = PromptLogprobs.concat([a, a.select(np.arange(4))])
    assert len(c) == 14 and c.k == 3

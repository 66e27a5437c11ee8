# SPDX-License-Identifier: Apache-2.0
import re

import pytest
from tq_eval import niah


def whitespace_count(text: str) -> int:
    """The trivial tokenizer of these tests: one token per whitespace-separated word."""
    return len(text.split())


def _haystack_without_needle(sample: niah.NiahSample) -> str:
    return sample.prompt.replace(niah.NEEDLE_TEMPLATE.format(value=sample.needle) + " ", "").replace(
        " " + niah.NEEDLE_TEMPLATE.format(value=sample.needle), "")


def test_grid_is_deterministic_and_seed_dependent():
    a = niah.make_grid(whitespace_count, [333, 1000], [0, 37, 100], samples=2, seed=5)
    b = niah.make_grid(whitespace_count, [333, 1000], [0, 37, 100], samples=2, seed=5)
    c = niah.make_grid(whitespace_count, [333, 1000], [0, 37, 100], samples=2, seed=6)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.needle for s in a] == [s.needle for s in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, c))
    assert len(a) == 2 * 3 * 2
    assert [(s.length, s.sample, s.depth_percent) for s in a[:3]] == [(333, 0, 0.0), (333, 0, 37.0), (333, 0, 100.0)]


@pytest.mark.parametrize("target", [97, 333, 1000, 4099])
def test_length_fits_target_within_one_sentence(target):
    for s in niah.make_grid(whitespace_count, [target], [0, 50, 100], samples=2, seed=1):
        assert s.num_tokens == whitespace_count(s.prompt)
        assert target - 17 <= s.num_tokens <= target  # a filler sentence has at most 16 words


def test_needle_is_the_only_number_and_appears_once():
    for s in niah.make_grid(whitespace_count, [500], [0, 50, 100], samples=3, seed=2):
        assert re.findall(r"\d+", s.prompt) == [s.needle]
        assert len(s.needle) == niah.NEEDLE_DIGITS and s.needle[0] != "0"
        assert s.prompt.count(niah.NEEDLE_TEMPLATE.format(value=s.needle)) == 1
        assert s.prompt.endswith("\n" + niah.ANSWER_PREFIX)


def test_needle_depth_placement():
    grid = niah.make_grid(whitespace_count, [2000], [0, 10, 50, 90, 100], samples=1, seed=3)
    by_depth = {s.depth_percent: s for s in grid}
    first = by_depth[0.0]
    assert first.prompt.startswith(niah.INSTRUCTION + "\n\n" + niah.NEEDLE_TEMPLATE.format(value=first.needle))
    last = by_depth[100.0]
    assert (niah.NEEDLE_TEMPLATE.format(value=last.needle) + "\n\n" + niah.QUESTION) in last.prompt
    for d, s in by_depth.items():
        assert abs(s.needle_depth_percent - d) <= 3.0, (d, s.needle_depth_percent)
    positions = [by_depth[d].prompt.index(by_depth[d].needle) for d in sorted(by_depth)]
    assert positions == sorted(positions)


def test_haystack_does_not_depend_on_depth():
    grid = niah.make_grid(whitespace_count, [800], [0, 33, 66, 100], samples=1, seed=4)
    hay = {_haystack_without_needle(s) for s in grid}
    assert len(hay) == 1
    assert len({s.needle for s in grid}) == len(grid)


def test_render_is_applied_and_counted():
    header = "SYSTEM " * 40

    def render(body):
        return header + body + "\nASSISTANT: " + niah.ANSWER_PREFIX

    s = niah.make_sample(whitespace_count, 300, 50, render=render, seed=9)
    assert s.prompt.startswith(header)
    assert 300 - 17 <= s.num_tokens <= 300


def test_length_label_seeds_haystack_and_target_caps_it():
    a = niah.make_sample(whitespace_count, 1000, 50, length=1024)
    b = niah.make_grid(whitespace_count, [1024], [50], target_tokens={1024: 1000})[0]
    assert a.prompt == b.prompt and a.length == 1024 and a.num_tokens <= 1000


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="too small"):
        niah.make_sample(whitespace_count, 20, 50)
    with pytest.raises(ValueError, match="0..100"):
        niah.make_grid(whitespace_count, [500], [120])
    with pytest.raises(ValueError, match="samples"):
        niah.make_grid(whitespace_count, [500], [0], samples=0)


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        (" 482913.", True),
        ("482913", True),
        ("The number is 482,913!", True),
        ("is 482 913", True),
        (" 4829130", False),
        (" 1482913", False),
        (" 48291", False),
        ("", False),
        (" 482913 and 111111", True),
    ],
)
def test_score_answer(answer, ok):
    assert niah.score_answer(answer, "482913") is ok


def test_summarize_accuracy_by_length_and_cell():
    recs = [
        {"length": 2048, "depth_percent": 0.0, "correct": True},
        {"length": 1024, "depth_percent": 0.0, "correct": True},
        {"length": 1024, "depth_percent": 0.0, "correct": False},
        {"length": 1024, "depth_percent": 100.0, "correct": True},
    ]
    s = niah.summarize(recs)
    assert list(s["by_length"]) == ["1024", "2048"]
    assert s["by_length"]["1024"] == {"acc": pytest.approx(2 / 3), "n": 3}
    assert s["overall"] == {"acc": 0.75, "n": 4}
    assert s["cells"][0] == {"length": 1024, "depth_percent": 0.0, "acc": 0.5, "n": 2}
    assert niah.summarize([])["overall"] == {"acc": None, "n": 0}


def test_default_lengths():
    assert niah.default_lengths(8192) == [1024, 2048, 4096, 8192]
    assert niah.default_lengths(6000) == [1024, 2048, 4096, 6000]
    assert niah.default_lengths(512) == [512]


@pytest.mark.parametrize("target", [150, 1000, 2500])
def test_fit_is_the_longest_haystack_that_fits(target):
    """Brute force over sentence counts: one more sentence would overflow the target."""
    for sample in range(2):
        s = niah.make_grid(whitespace_count, [target], [50], first_sample=sample)[0]
        pool = niah._SentencePool(niah._rng("haystack", 0, target, sample))
        pool.grow(target)
        needle = niah.NEEDLE_TEMPLATE.format(value=s.needle)

        def tokens(n, pool=pool, needle=needle):
            hay = pool.sentences[:n]
            return whitespace_count(niah.plain_prompt(niah.build_body(hay, needle, niah.insertion_index(hay, 50))))

        first_over = next(n for n in range(target) if tokens(n) > target)  # counts grow with n
        assert s.num_tokens == tokens(first_over - 1)

# SPDX-License-Identifier: Apache-2.0
import pytest
from tq_eval import textdata


def test_windows_are_exact_disjoint_and_spread():
    ids = list(range(10_000))
    wins = textdata.token_windows(ids, window_tokens=513, num_windows=5, prefix_ids=[-1])
    assert len(wins) == 5
    assert all(len(w) == 513 and w[0] == -1 for w in wins)
    bodies = [w[1:] for w in wins]
    for a, b in zip(bodies, bodies[1:]):
        assert a[-1] < b[0]  # in order, no overlap
    assert bodies[-1][-1] > 7000  # reaches the end of the text, not just its start
    assert all(b == list(range(b[0], b[0] + 512)) for b in bodies)


def test_windows_capped_by_text_and_errors():
    assert len(textdata.token_windows(list(range(1000)), 300, 10)) == 3
    with pytest.raises(ValueError, match="fewer than one window"):
        textdata.token_windows(list(range(100)), 300, 1)
    with pytest.raises(ValueError, match="no room"):
        textdata.token_windows(list(range(100)), 2, 1, prefix_ids=[0, 0])


def test_scored_positions():
    assert textdata.scored_positions(1024, 256) == list(range(257, 1024))
    with pytest.raises(ValueError, match="exceed"):
        textdata.scored_positions(256, 256)


def test_special_prefix():
    def plain(s):
        return [ord(c) for c in s]

    assert textdata.special_prefix(lambda s: [2] + plain(s), plain) == [2]
    assert textdata.special_prefix(lambda s: [2, 7] + plain(s) + [3], plain) == [2, 7]
    assert textdata.special_prefix(plain, plain) == []


def test_load_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text(" = Title = \n text \n", encoding="utf-8")
    assert textdata.load_text(p).startswith(" = Title")
    with pytest.raises(FileNotFoundError):
        textdata.load_text(tmp_path / "missing.txt")
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        textdata.load_text(tmp_path / "e.txt")

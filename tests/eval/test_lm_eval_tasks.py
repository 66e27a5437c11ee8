# SPDX-License-Identifier: Apache-2.0
"""GSM8K and tq_niah through lm-eval's real task machinery (skipped without lm-eval).

The language model here is a small lm-eval ``LM`` that answers from the data (GSM8K: the gold
answer; NIAH: the number it reads in the prompt), so the tests check the task wiring, the
filters and the scoring -- not a model."""

import json
import os
import re
from pathlib import Path

import pytest

# Everything here is local files; never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lm_eval.api.model import LM  # noqa: E402
from tq_eval import gsm8k, niah  # noqa: E402

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"

QUESTIONS = [
    ("Ann has 3 apples and buys 4 more. How many apples does she have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 12 eggs. How many eggs are in 2 boxes?", "12 * 2 = 24\n#### 24"),
    ("Tom had 1,250 dollars and spent 250. How much is left?", "1250 - 250 = 1000\n#### 1,000"),
]


class AnswerFromData(LM):
    def __init__(self, answer):
        super().__init__()
        self.answer = answer
        self.prompts = []

    def generate_until(self, requests, disable_tqdm=False):
        self.prompts += [r.args[0] for r in requests]
        return [self.answer(r.args[0]) for r in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


@pytest.fixture
def gsm8k_dir(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    train = [{"question": f"Train question {i}?", "answer": f"It is {i}.\n#### {i}"} for i in range(8)]
    (d / "train.jsonl").write_text("\n".join(json.dumps(x) for x in train) + "\n")
    (d / "test.jsonl").write_text(
        "\n".join(json.dumps({"question": q, "answer": a}) for q, a in QUESTIONS) + "\n")
    return d


def test_gsm8k_local_task_keeps_lm_eval_config(gsm8k_dir):
    cfg = gsm8k.task_config(str(gsm8k_dir))
    assert cfg["dataset_path"] == "json" and cfg["num_fewshot"] == 5
    assert [f["name"] for f in cfg["filter_list"]] == ["strict-match", "flexible-extract"]
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"
    hub = gsm8k.task_config(gsm8k.HUB)
    assert hub["dataset_path"] == "openai/gsm8k" and hub["dataset_name"] == "main"
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        gsm8k.task_config(str(gsm8k_dir / "nowhere"))


def test_gsm8k_scores_strict_and_flexible(gsm8k_dir):
    gold = {q: a.split("####")[-1].strip() for q, a in QUESTIONS}

    def answer(prompt):
        q = prompt.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
        return f" Work it out.\n#### {gold[q]}"

    lm = AnswerFromData(answer)
    s = gsm8k.evaluate(lm, str(gsm8k_dir), limit=None, num_fewshot=5)
    assert s["strict"] == 1.0 and s["flexible"] == 1.0 and s["n"] == 3
    assert s["lm_eval_version"].startswith("0.4")
    # 5-shot: five solved train questions precede the test question
    assert lm.prompts[0].count("Question: ") == 6 and lm.prompts[0].count("#### ") == 5

    lm_loose = AnswerFromData(lambda p: " The answer is 7 apples.")  # no "#### ": only flexible can match
    s2 = gsm8k.evaluate(lm_loose, str(gsm8k_dir), limit=2, num_fewshot=5)
    assert s2["strict"] == 0.0 and s2["flexible"] == 0.5 and s2["n"] == 2


def test_extract_scores_errors():
    with pytest.raises(ValueError, match="no task"):
        gsm8k.extract_scores({"results": {}})
    with pytest.raises(ValueError, match="lack"):
        gsm8k.extract_scores({"results": {"gsm8k": {"exact_match,strict-match": 1.0}}})


def test_tq_niah_task_runs_in_lm_eval(word_tokenizer_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    meta = {"tokenizer": str(word_tokenizer_dir), "niah_lengths": [150, 400], "niah_depths": [0, 50, 100],
            "niah_samples": 2}
    tm = TaskManager(include_path=str(EVAL_DIR / "tasks"), include_defaults=False, metadata=meta)
    assert "tq_niah" in tm.all_tasks

    def read_needle(prompt):
        assert prompt.endswith(niah.QUESTION + "\n" + niah.ANSWER_PREFIX)
        return " " + re.search(r"special magic number is (\d+)\.", prompt).group(1) + "."

    lm = AnswerFromData(read_needle)
    res = lm_eval.simple_evaluate(model=lm, tasks=["tq_niah"], task_manager=tm, log_samples=False,
                                  bootstrap_iters=0)
    assert res["results"]["tq_niah"]["acc,none"] == 1.0
    assert len(lm.prompts) == 2 * 3 * 2


def test_tq_niah_dataset_lengths_use_the_tokenizer(word_tokenizer_dir):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tq_niah_task", EVAL_DIR / "tasks" / "tq_niah_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ds = mod.niah_dataset(pretrained=str(word_tokenizer_dir), niah_lengths=[300], niah_depths=[50],
                          niah_samples=3)["test"]
    assert len(ds) == 3 and all(280 <= r["num_tokens"] <= 300 for r in ds)
    assert mod.process_results(ds[0], [" " + ds[0]["outputs"][0]]) == {"acc": 1.0}
    with pytest.raises(ValueError, match="needs a tokenizer"):
        mod.niah_dataset(niah_lengths=[300])

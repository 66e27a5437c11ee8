# SPDX-License-Identifier: Apache-2.0
"""lm-eval glue for tq_niah.yaml: the dataset comes from tq_eval.niah (same generator and scorer
as run_quality.py), sized with the model's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

_EVAL_DIR = str(Path(__file__).resolve().parents[1])
if _EVAL_DIR not in sys.path:
    sys.path.insert(0, _EVAL_DIR)

from tq_eval import niah  # noqa: E402

DEFAULT_LENGTHS = (1024, 2048, 4096)
TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")


def _tokenizer_name(kwargs: dict) -> str:
    for key in TOKENIZER_KEYS:
        v = kwargs.get(key)
        if isinstance(v, str) and v:
            return v
    raise ValueError(
        "tq_niah sizes its prompts in tokens and needs a tokenizer: pass --model_args pretrained=... "
        "(or tokenizer=...), or --metadata '{\"tokenizer\": \"...\"}'"
    )


def niah_dataset(**kwargs) -> dict:
    """{"test": Dataset} of NIAH prompts. Metadata keys: niah_lengths (or max_seq_lengths),
    niah_depths, niah_samples, niah_seed, tokenizer/pretrained."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_name(kwargs))
    lengths = [int(x) for x in kwargs.get("niah_lengths") or kwargs.get("max_seq_lengths") or DEFAULT_LENGTHS]
    depths = [float(x) for x in kwargs.get("niah_depths") or niah.DEFAULT_DEPTHS]
    samples = int(kwargs.get("niah_samples", 2))
    seed = int(kwargs.get("niah_seed", 0))

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=True).input_ids)

    # plain_prompt() ends with "\n" + ANSWER_PREFIX, which lm-eval adds back (target_delimiter +
    # gen_prefix); generating with plain_prompt keeps that suffix inside the token count.
    suffix = "\n" + niah.ANSWER_PREFIX
    rows = [
        {"input": s.prompt.removesuffix(suffix), "outputs": [s.needle], "max_length": s.length,
         "depth_percent": s.depth_percent, "num_tokens": s.num_tokens}
        for s in niah.make_grid(count, lengths, depths, samples, seed=seed)
    ]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"acc": float(niah.score_answer(results[0], doc["outputs"][0]))}

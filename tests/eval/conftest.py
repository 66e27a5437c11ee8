# SPDX-License-Identifier: Apache-2.0
"""Tests of eval/ (the quality suite): put eval/ on the import path, share small fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"
if str(EVAL_DIR) not in sys.path:
    sys.path.insert(0, str(EVAL_DIR))


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory) -> Path:
    """A real Hugging Face tokenizer folder (word-level, whitespace split, <s> in front), built offline."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from tq_eval import niah
    from transformers import PreTrainedTokenizerFast

    words = sorted({w.lower() for w in niah.FILLER_WORDS}
                   | {w.strip(".?;").lower() for w in (niah.INSTRUCTION + " " + niah.QUESTION + " "
                                                       + niah.NEEDLE_TEMPLATE).split()})
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for w in words + [w.capitalize() for w in words] + list(".,;?"):
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    out = tmp_path_factory.mktemp("word_tokenizer")
    fast.save_pretrained(out)
    return out

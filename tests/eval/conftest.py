# SPDX-License-Identifier: Apache-2.0
"""Tests of eval/ (the quality suite): put eval/ on the import path, share small fixtures."""

from __future__ import annotations

import json
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


def _layer(i: int, arch: str) -> list[str]:
    """The tensor names of decoder layer ``i`` in SmolLM2's (Llama) and Gemma 3's checkpoints."""
    p = f"model.layers.{i}."
    out = [p + f"self_attn.{x}_proj.weight" for x in "qkvo"] + [p + f"mlp.{x}_proj.weight" for x in
                                                                  ("gate", "up", "down")]
    out += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if arch == "gemma3":
        out += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight",
                p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return out


def _shape(name: str, hidden: int, mlp: int) -> tuple[int, ...]:
    if "norm" in name:
        return (64,) if "_norm" in name and "self_attn" in name else (hidden,)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (mlp, hidden)
    if name.endswith("down_proj.weight"):
        return (hidden, mlp)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return (64, hidden)
    if name.endswith("_proj.bias"):
        return (hidden,)
    return (hidden, hidden)


def write_hub_model(folder: Path, arch: str, dtype=None) -> dict:
    """A model folder as the hub has them (names of SmolLM2 / Gemma 3 270M): hidden 192 and MLP 320, so the
    projections' inputs end in a padded group, two decoder layers in two shards (the output head beside the second),
    one shard that holds no projection (embeddings, final norm), an index, a tokenizer file. Returns {name: tensor}."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    hidden, mlp = 192, 320
    shards = {"model-00001-of-00003.safetensors": _layer(0, arch),
              "model-00002-of-00003.safetensors": _layer(1, arch) + ["lm_head.weight"],
              "model-00003-of-00003.safetensors": ["model.embed_tokens.weight", "model.norm.weight"]}
    if arch == "llama":
        shards["model-00001-of-00003.safetensors"].append("model.layers.0.self_attn.q_proj.bias")
    folder.mkdir(parents=True)
    tensors, weight_map = {}, {}
    for shard, names in shards.items():
        part = {}
        for n in names:
            shape = (100, hidden) if n.startswith(("model.embed", "lm_head")) else _shape(n, hidden, mlp)
            part[n] = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
            weight_map[n] = shard
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        tensors.update(part)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                     "weight_map": weight_map}))
    arch_name = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch_name], "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16"}))
    (folder / "tokenizer.json").write_text('{"stand-in": true}')
    return tensors


@pytest.fixture
def hub_model():
    """``write_hub_model``: a small safetensors model folder named like SmolLM2 ("llama") or Gemma 3 ("gemma3")."""
    return write_hub_model

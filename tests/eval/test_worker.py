# SPDX-License-Identifier: Apache-2.0
"""The worker: prompt rendering on the CPU; the whole worker on a real vLLM engine where one exists
(GPU machine: set TQ_EVAL_MODEL to a model folder; TQ_EVAL_GSM8K optionally to the GSM8K folder)."""

import importlib.util
import json
import math
import os

import pytest
from tq_eval import configs as C
from tq_eval import niah, runner, worker


def test_niah_renderer_plain_and_chat(word_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer_dir)
    render, encode, chat = worker.niah_renderer(tok)
    assert not chat and render("body") == "body\n" + niah.ANSWER_PREFIX
    assert encode("river bridge")[0] == tok.bos_token_id  # specials added without a template

    tok.chat_template = "{% for m in messages %}<s> user: {{ m['content'] }} {% endfor %}assistant:"
    render, encode, chat = worker.niah_renderer(tok)
    prompt = render("river bridge")
    assert chat and prompt == "<s> user: river bridge assistant:" + niah.ANSWER_PREFIX
    ids = encode(prompt)
    assert ids.count(tok.bos_token_id) == 1  # the template's own <s>, not a second one
    s = niah.make_sample(lambda t: len(encode(t)), 300, 50, render=render)
    assert s.prompt.startswith("<s> user: ") and s.num_tokens <= 300


def test_gemma_without_bos_is_refused(word_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(word_tokenizer_dir)
    worker.require_document_bos(tok, "Gemma3ForCausalLM")  # <s> in front: accepted
    tok.backend_tokenizer.post_processor = None  # as transformers loads a Gemma 3 GGUF
    with pytest.raises(ValueError, match="adds no <bos>.*tq convert-gguf"):
        worker.require_document_bos(tok, "Gemma3ForCausalLM")
    worker.require_document_bos(tok, "LlamaForCausalLM")  # other models: the tokenizer decides


def test_served_model_per_weights(tmp_path):
    cfg = {"model": {"path": "/models/m"}, "weights": "tq4"}
    assert worker.served_model(cfg) == ("/models/m", "tq4")
    assert worker.served_model({**cfg, "weights": "fp8"}) == ("/models/m", "fp8")
    assert worker.served_model({"model": {"path": "/models/m"}}) == ("/models/m", None)  # a spec from before
    rtn = {**cfg, "weights": "rtn4", "served_path": str(tmp_path / "m__rtn4")}
    with pytest.raises(FileNotFoundError, match="RTN control folder"):
        worker.served_model(rtn)
    (tmp_path / "m__rtn4").mkdir()
    (tmp_path / "m__rtn4" / "config.json").write_text("{}")
    assert worker.served_model(rtn) == (str(tmp_path / "m__rtn4"), None)  # served as a plain model


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.skipif(not os.environ.get("TQ_EVAL_MODEL"), reason="set TQ_EVAL_MODEL to a local model folder")
@pytest.mark.parametrize("dtype", ["auto", "fp8", "turboquant_k3v4_nc"])
def test_worker_on_a_real_engine(tmp_path, dtype):
    text = tmp_path / "text.txt"
    pool = niah._SentencePool(niah._rng("gpu-test"))
    pool.grow(3000)
    text.write_text("\n".join(pool.sentences))
    tasks = C.TaskSettings(
        text_path=str(text), ppl_window_tokens=512, ppl_windows=4, topk=8, niah_lengths=[1024],
        niah_depths=[0.0, 100.0], niah_samples=1, gsm8k_data=os.environ.get("TQ_EVAL_GSM8K"), gsm8k_limit=4,
    )
    cfg = C.RunConfig(C.ModelInfo.from_path(os.environ["TQ_EVAL_MODEL"]), dtype, "patched")
    res = runner.run_config(cfg, C.EngineSettings(kv_cache_gib=2.0), tasks, tmp_path / "raw", None, timeout_s=500)
    assert res["status"] == "ok", json.dumps({k: res.get(k) for k in ("error", "tasks", "log_tail")})[:4000]
    ppl = res["tasks"]["ppl"]
    assert ppl["tokens"] == 4 * (512 - 257) and math.isfinite(ppl["ppl"]) and ppl["ppl"] > 1
    assert len(res["tasks"]["niah"]["records"]) == 2
    assert res["engine"]["kv_cache_tokens"] and res["engine"]["max_model_len"] >= 1024
    # Read from the engine core, and the same figure vLLM logs.
    assert res["engine"]["kv_cache_tokens_from"] == "engine"
    logged = runner.kv_cache_tokens_from_log(tmp_path / "raw" / cfg.id / runner.LOG_FILE)
    assert logged in (None, res["engine"]["kv_cache_tokens"])
    if tasks.gsm8k_data:
        assert res["tasks"]["gsm8k"]["n"] == 4

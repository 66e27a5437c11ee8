# SPDX-License-Identifier: Apache-2.0
"""One config = one process = one vLLM engine that runs every task: ``python -m tq_eval.worker SPEC``.

SPEC is a JSON file written by ``run_quality.py`` (keys: config, engine, tasks, out_dir). The config's
weights pick what vLLM loads: the model folder, with ``quantization=`` for fp8/tq4/tq3, or the RTN control's
fake-quantized copy (``served_path``, written before the run by ``tq_eval.rtn``) as a plain model. The
worker writes ``result.json`` in out_dir after every stage (so a crash keeps what finished) and
``ppl_logprobs.safetensors`` with the perplexity positions' prompt logprobs; KL against the
bf16 run is computed later, in the report step. Task order: perplexity, NIAH (short lengths
first), GSM8K -- a failure in one task is recorded and the next task still runs.

GSM8K goes through lm-eval's ``vllm`` model class. lm-eval 0.4.13 builds its own ``vllm.LLM``
inside ``VLLM.__init__`` and has no argument for an existing one, so while that class is being
constructed its module-level ``LLM`` name is pointed at a factory returning this worker's engine:
one engine (and one KV-cache dtype) serves all tasks, and the engine does not depend on lm-eval.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from tq_eval import niah as niah_mod
from tq_eval import textdata
from tq_eval.configs import (
    NO_WEIGHTS,
    EngineSettings,
    TaskSettings,
    rtn_bits,
    vllm_quantization,
    weights_engine_options,
)
from tq_eval.logprob_metrics import PromptLogprobs, parse_prompt_logprobs, perplexity

RESULT_FILE = "result.json"
LOGPROBS_FILE = "ppl_logprobs.safetensors"


def _error_text(exc: BaseException, limit: int = 4000) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


class Recorder:
    """result.json, rewritten atomically after every change."""

    def __init__(self, out_dir: Path, spec: dict):
        self.path = out_dir / RESULT_FILE
        self.data = {"config": spec["config"], "status": "running", "error": None, "engine": {}, "tasks": {},
                     "timings": {}, "pid": os.getpid()}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=float))
        tmp.replace(self.path)


def served_model(cfg: dict) -> tuple[str, str | None]:
    """(folder vLLM loads, its ``quantization=``) for a config dict; a config written before the weight axis
    existed has no weights: the model as it is."""
    weights = cfg.get("weights") or NO_WEIGHTS
    if rtn_bits(weights) is not None:
        path = cfg.get("served_path")
        if not path or not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"weights {weights}: the RTN control folder {path!r} was not written "
                                    "(run_quality.py writes it before the configs run)")
        return path, None
    return cfg["model"]["path"], vllm_quantization(weights)


def build_engine(model_path: str, kv_cache_dtype: str, engine: EngineSettings, topk: int,
                 quantization: str | None = None, options: dict | None = None):
    from vllm import LLM

    return LLM(**engine.engine_kwargs(model_path, kv_cache_dtype, topk, quantization, options))


def lm_eval_adapter(llm, model_path: str, engine_kwargs: dict):
    """lm-eval's VLLM model object around the existing engine (see the module doc)."""
    import lm_eval.models.vllm_causallms as lmv

    kwargs = {k: v for k, v in engine_kwargs.items() if k not in ("model", "tokenizer", "dtype", "seed")}
    kwargs["max_model_len"] = llm.llm_engine.model_config.max_model_len
    real_llm = lmv.LLM
    lmv.LLM = lambda **_: llm
    try:
        return lmv.VLLM(pretrained=model_path, dtype="auto", batch_size="auto", seed=engine_kwargs["seed"], **kwargs)
    finally:
        lmv.LLM = real_llm


def load_tokenizer(model_path: str):
    # The model folder's own Hugging Face tokenizer (the one vLLM wraps), independent of vLLM's API.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def document_prefix(tok) -> list[int]:
    """The special tokens this tokenizer puts in front of a text (Gemma: [<bos>]; SmolLM2: [])."""
    return textdata.special_prefix(
        lambda s: tok(s, add_special_tokens=True).input_ids, lambda s: tok(s, add_special_tokens=False).input_ids
    )


def require_document_bos(tok, architecture: str) -> None:
    """Refuse a Gemma model whose tokenizer puts no <bos> in front of a text.

    Gemma reads a sequence without <bos> as noise (WikiText-2 perplexity in the thousands instead of
    about 17), so every task would measure a broken model. transformers' GGUF loader produces such a
    tokenizer for Gemma 3 (it drops the GGUF's ``add_bos_token``); ``tq convert-gguf`` keeps it."""
    if not architecture.lower().startswith("gemma"):
        return
    prefix = document_prefix(tok)
    if getattr(tok, "bos_token_id", None) not in prefix:
        raise ValueError(
            f"the tokenizer of this {architecture} model adds no <bos> to a text (add_bos_token is off), and "
            "Gemma models need one in front of every sequence; convert the GGUF with `tq convert-gguf`, or set "
            "add_bos_token to true in the model folder's tokenizer_config.json")


def run_ppl(llm, tok, tasks: TaskSettings, engine: EngineSettings, out_dir: Path) -> dict:
    from safetensors.numpy import save_file
    from vllm import SamplingParams

    max_len = llm.llm_engine.model_config.max_model_len
    if tasks.ppl_window_tokens >= max_len:
        raise ValueError(f"ppl window of {tasks.ppl_window_tokens} tokens does not fit max_model_len {max_len}")
    text = textdata.load_text(tasks.text_path)
    ids = tok(text, add_special_tokens=False).input_ids
    prefix = document_prefix(tok)
    windows = textdata.token_windows(ids, tasks.ppl_window_tokens, tasks.ppl_windows, prefix)
    positions = textdata.scored_positions(tasks.ppl_window_tokens, engine.prefill_chunk)
    params = SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=tasks.topk, detokenize=False, flat_logprobs=True
    )
    # Every request of a step gets exactly `prefill_chunk` tokens only while the step budget
    # holds them all; submit at most that many windows at once so chunk boundaries (and the
    # scored positions) are the same for every dtype.
    per_batch = max(1, engine.max_num_batched_tokens // engine.prefill_chunk)
    parts, window_index = [], []
    for start in range(0, len(windows), per_batch):
        batch = windows[start:start + per_batch]
        outs = llm.generate([{"prompt_token_ids": w} for w in batch], params, use_tqdm=False)
        for j, (w, o) in enumerate(zip(batch, outs)):
            parts.append(parse_prompt_logprobs(w, o.prompt_logprobs, tasks.topk, positions))
            window_index += [start + j] * len(positions)
    lp = PromptLogprobs.concat(parts)
    tensors = lp.to_tensors()
    tensors["window"] = np.asarray(window_index, dtype=np.int32)
    tensors["position"] = np.tile(np.asarray(positions, dtype=np.int32), len(windows))
    save_file(tensors, str(out_dir / LOGPROBS_FILE))
    return {
        "ppl": perplexity(lp.target_logprobs),
        "tokens": len(lp),
        "windows": len(windows),
        "window_tokens": tasks.ppl_window_tokens,
        "prefix_tokens": len(prefix),
        "first_scored_position": positions[0],
        "topk": tasks.topk,
        "text": str(tasks.text_path),
        "logprobs_file": LOGPROBS_FILE,
    }


def niah_renderer(tok):
    """(render, encode): the chat template if the tokenizer has one, else the plain prompt."""
    template = getattr(tok, "chat_template", None)
    if template:
        def render(body: str) -> str:
            msgs = [{"role": "user", "content": body}]
            return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + niah_mod.ANSWER_PREFIX

        def encode(text: str) -> list[int]:
            return tok(text, add_special_tokens=False).input_ids  # the template holds its specials
    else:
        render = niah_mod.plain_prompt

        def encode(text: str) -> list[int]:
            return tok(text, add_special_tokens=True).input_ids
    return render, encode, bool(template)


def run_niah(llm, tok, tasks: TaskSettings, rec: Recorder) -> dict:
    from vllm import SamplingParams

    max_len = llm.llm_engine.model_config.max_model_len  # the engine's limit (may be capped by --max-model-len)
    lengths = tasks.niah_lengths or niah_mod.default_lengths(max_len)
    room = tasks.niah_gen_tokens + 1
    render, encode, chat = niah_renderer(tok)
    params = SamplingParams(temperature=0.0, max_tokens=tasks.niah_gen_tokens)
    section = {"lengths": lengths, "depths": tasks.niah_depths, "samples_per_cell": tasks.niah_samples,
               "seed": tasks.niah_seed, "chat_template": chat, "records": [], "errors": {}}
    rec.data["tasks"]["niah"] = section
    for length in lengths:  # shortest first: a failure at long context keeps the short results
        if length > max_len:
            section["errors"][str(length)] = f"longer than the engine's max_model_len ({max_len})"
            continue
        try:
            target = min(length, max_len - room)
            samples = niah_mod.make_grid(
                lambda t: len(encode(t)), [length], tasks.niah_depths, tasks.niah_samples,
                seed=tasks.niah_seed, render=render, target_tokens={length: target},
            )
            outs = llm.generate([{"prompt_token_ids": encode(s.prompt)} for s in samples], params, use_tqdm=False)
            for s, o in zip(samples, outs):
                answer = o.outputs[0].text
                section["records"].append(
                    {**s.to_dict(), "answer": answer[:80], "correct": niah_mod.score_answer(answer, s.needle)}
                )
        except Exception as e:  # noqa: BLE001 -- recorded per length, the next length still runs
            section["errors"][str(length)] = _error_text(e)
            traceback.print_exc()
        section["summary"] = niah_mod.summarize(section["records"])
        rec.write()
    if section["errors"] and not section["records"]:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in section["errors"].items()))
    return section


def _engine_facts(llm) -> dict:
    facts = {}
    try:
        facts["max_model_len"] = llm.llm_engine.model_config.max_model_len
        cache = llm.llm_engine.vllm_config.cache_config
        facts["num_gpu_blocks"] = getattr(cache, "num_gpu_blocks", None)
        facts["block_size"] = getattr(cache, "block_size", None)
        facts["cache_dtype"] = getattr(cache, "cache_dtype", None)
        facts["quantization"] = llm.llm_engine.model_config.quantization
    except AttributeError as e:  # informational only; the tasks do not need it
        facts["facts_error"] = _error_text(e)
    try:
        # The model runner's "Model loading took X GiB memory" figure (weights as served, after quantization).
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        facts["model_memory_gib"] = runner.model_memory_usage / (1 << 30)
    except (AttributeError, TypeError):
        pass  # the runner falls back to the engine's log line
    try:
        # vLLM's "GPU KV cache size" figure, from the engine core itself (in this process: the worker runs
        # with VLLM_ENABLE_V1_MULTIPROCESSING=0); group-aware, so right for sliding-window models too.
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        core = llm.llm_engine.engine_core.engine_core
        facts["kv_cache_tokens"], _ = get_kv_cache_capacity(llm.llm_engine.vllm_config, core.scheduler.kv_cache_config)
    except (AttributeError, ImportError, TypeError):
        pass  # the runner falls back to the engine's log line
    return facts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tq_eval.worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = EngineSettings(**spec["engine"])
    tasks = TaskSettings(**spec["tasks"])
    cfg = spec["config"]
    rec = Recorder(out_dir, spec)
    rec.data["engine"]["weights"] = cfg.get("weights") or NO_WEIGHTS
    t_start = time.time()
    try:
        model_path, quantization = served_model(cfg)
        options = weights_engine_options(cfg.get("weights") or NO_WEIGHTS)
        import vllm

        rec.data["engine"]["vllm_version"] = vllm.__version__
        rec.data["engine"]["vllm_path"] = str(Path(vllm.__file__).parent)
        tok = load_tokenizer(model_path)
        require_document_bos(tok, cfg["model"]["architecture"])
        llm = build_engine(model_path, cfg["dtype"], engine, tasks.topk, quantization, options)
    except Exception as e:  # noqa: BLE001 -- the suite records a config that cannot start
        traceback.print_exc()
        rec.data.update(status="error", error=_error_text(e))
        rec.data["timings"]["engine_start_s"] = time.time() - t_start
        rec.write()
        return 1
    rec.data["timings"]["engine_start_s"] = time.time() - t_start
    rec.data["engine"].update(_engine_facts(llm))
    engine_kwargs = engine.engine_kwargs(model_path, cfg["dtype"], tasks.topk, quantization, options)
    rec.data["engine"]["kwargs"] = engine_kwargs
    rec.write()

    failed = []
    for name in tasks.tasks:
        t0 = time.time()
        try:
            if name == "ppl":
                if not tasks.text_path:
                    continue
                rec.data["tasks"]["ppl"] = run_ppl(llm, tok, tasks, engine, out_dir)
            elif name == "niah":
                if run_niah(llm, tok, tasks, rec)["errors"]:
                    failed.append(name)  # some lengths failed; the others are kept
            elif name == "gsm8k":
                if not tasks.gsm8k_data:
                    continue
                from tq_eval import gsm8k

                lm = lm_eval_adapter(llm, model_path, engine_kwargs)
                rec.data["tasks"]["gsm8k"] = gsm8k.evaluate(
                    lm, tasks.gsm8k_data, tasks.gsm8k_limit, tasks.gsm8k_fewshot, engine.seed
                )
        except Exception as e:  # noqa: BLE001 -- recorded; the next task still runs
            traceback.print_exc()
            prev = rec.data["tasks"].get(name) or {}
            rec.data["tasks"][name] = {**prev, "error": _error_text(e)}
            failed.append(name)
        rec.data["timings"][f"{name}_s"] = time.time() - t0
        rec.write()
    rec.data["timings"]["total_s"] = time.time() - t_start
    rec.data["status"] = "ok" if not failed else "partial"
    rec.write()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # result.json is complete: leave without interpreter shutdown, where engine and CUDA teardown
    # can hang and hold the config's slot until its timeout.
    os._exit(code)

# SPDX-License-Identifier: Apache-2.0
"""Run configs as separate processes (GPU memory is freed between them), with timeouts.

A config that fails to start, crashes or times out is recorded in its result.json with the error
text and the tail of its log; the suite goes on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from tq_eval.configs import EngineSettings, RunConfig, TaskSettings, subprocess_env
from tq_eval.worker import RESULT_FILE

EVAL_DIR = Path(__file__).resolve().parents[1]  # eval/
PROJECT_ROOT = EVAL_DIR.parent
LOG_FILE = "worker.log"
SPEC_FILE = "spec.json"
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_MODEL_MEMORY = re.compile(r"Model loading took ([\d.]+) GiB")
_ERROR_LINE = re.compile(r"(Error|Exception|error:|Traceback|CUDA|Killed|out of memory)")


def log_tail(path: Path, lines: int = 30) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def error_from_log(path: Path) -> str | None:
    """The last line of the log that reads like an error (the real cause behind an exit code)."""
    for line in reversed(log_tail(path, 200)):
        if _ERROR_LINE.search(line) and not line.lstrip().startswith("File "):
            return line.strip()[:2000]
    return None


def kv_cache_tokens_from_log(path: Path) -> int | None:
    """vLLM's own "GPU KV cache size: N tokens" line (it accounts for hybrid layouts)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    m = _KV_TOKENS.findall(text)
    return int(m[-1].replace(",", "")) if m else None


def model_memory_gib_from_log(path: Path) -> float | None:
    """vLLM's "Model loading took X GiB memory" line: the weights as served (after online quantization)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    m = _MODEL_MEMORY.findall(text)
    return float(m[-1]) if m else None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_config(
    cfg: RunConfig,
    engine: EngineSettings,
    tasks: TaskSettings,
    raw_dir: Path,
    install_path: str | None,
    *,
    python: str = sys.executable,
    timeout_s: float = 420.0,
    offline: bool = True,
) -> dict:
    """Run one config in a fresh process; returns its result dict (also left in raw_dir/<id>/)."""
    out = raw_dir / cfg.id
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, "ppl_logprobs.safetensors"):
        (out / stale).unlink(missing_ok=True)
    spec = {"config": cfg.to_dict(), "engine": asdict(engine), "tasks": asdict(tasks), "out_dir": str(out.resolve()),
            "install_path": install_path}
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=1))
    env = subprocess_env(dict(os.environ), install_path, [str(EVAL_DIR), str(PROJECT_ROOT)], offline)
    t0 = time.time()
    status_note = None
    with open(out / LOG_FILE, "w") as log:
        proc = subprocess.Popen(
            [python, "-m", "tq_eval.worker", str((out / SPEC_FILE).resolve())],
            cwd=str(out), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            rc = None
            status_note = f"timed out after {timeout_s:.0f} s"
        else:
            # Stray children of the worker (compile workers) must not hold the GPU.
            _kill_group(proc)
    wall = time.time() - t0
    result_path = out / RESULT_FILE
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        result = {"config": cfg.to_dict(), "status": "error", "error": None, "engine": {}, "tasks": {}, "timings": {}}
    if status_note:
        result["status"] = "error" if result.get("status") in ("running", "error") else "partial"
        result["error"] = "; ".join(x for x in (result.get("error"), status_note) if x)
    elif result.get("status") == "running":  # the process died without finishing its record
        result["status"] = "error" if not result.get("tasks") else "partial"
        cause = error_from_log(out / LOG_FILE) or f"worker exited with code {rc}"
        result["error"] = result.get("error") or f"worker died (exit code {rc}): {cause}"
    elif result.get("status") == "error" and not result.get("error"):
        result["error"] = error_from_log(out / LOG_FILE) or f"worker exited with code {rc}"
    result["exit_code"] = rc
    result["wall_s"] = wall
    result["install_path"] = install_path
    engine = result.setdefault("engine", {})
    if engine.get("kv_cache_tokens"):  # the worker read it from the engine core
        engine["kv_cache_tokens_from"] = "engine"
    else:
        engine["kv_cache_tokens"] = kv_cache_tokens_from_log(out / LOG_FILE)
        engine["kv_cache_tokens_from"] = "log" if engine["kv_cache_tokens"] else None
    if engine.get("model_memory_gib") is None:
        engine["model_memory_gib"] = model_memory_gib_from_log(out / LOG_FILE)
    if result["status"] != "ok":
        result["log_tail"] = log_tail(out / LOG_FILE)
    result_path.write_text(json.dumps(result, indent=1))
    return result


def execute(
    plan: list[RunConfig],
    engine: EngineSettings,
    tasks: TaskSettings,
    raw_dirs: dict[str, Path],
    install_paths: dict[str, str | None],
    *,
    python: str = sys.executable,
    parallel: int = 1,
    timeout_s: float = 420.0,
    time_budget_s: float | None = None,
    offline: bool = True,
    on_done: Callable[[RunConfig, dict], None] | None = None,
) -> dict[str, dict]:
    """Run ``plan`` (``parallel`` at a time); returns {model name + id: result}. Configs that would
    start after ``time_budget_s`` are recorded as skipped; a started one gets at most the time left."""
    t0 = time.time()
    lock = threading.Lock()
    results: dict[str, dict] = {}

    def one(cfg: RunConfig) -> tuple[RunConfig, dict]:
        left = None if time_budget_s is None else time_budget_s - (time.time() - t0)
        if left is not None and left < 30:
            res = {"config": cfg.to_dict(), "status": "skipped", "error": "time budget used up before start",
                   "engine": {}, "tasks": {}, "timings": {}}
            out = raw_dirs[cfg.model.name] / cfg.id
            out.mkdir(parents=True, exist_ok=True)
            (out / RESULT_FILE).write_text(json.dumps(res, indent=1))
            return cfg, res
        limit = timeout_s if left is None else min(timeout_s, left)
        print(f"[tq-eval] start {cfg.model.name} {cfg.id} (limit {limit:.0f} s)", flush=True)
        res = run_config(cfg, engine, tasks, raw_dirs[cfg.model.name], install_paths.get(cfg.install),
                         python=python, timeout_s=limit, offline=offline)
        print(f"[tq-eval] done  {cfg.model.name} {cfg.id}: {res['status']} in {res.get('wall_s', 0):.0f} s"
              + (f" -- {res['error'][:200]}" if res.get("error") else ""), flush=True)
        return cfg, res

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = []
        for i, cfg in enumerate(plan):
            futures.append(pool.submit(one, cfg))
            if parallel > 1 and i < parallel - 1:
                time.sleep(2.0)  # stagger the first engines' start-up memory checks
        for fut in as_completed(futures):
            cfg, res = fut.result()
            with lock:
                results[f"{cfg.model.name}/{cfg.id}"] = res
                if on_done is not None:
                    on_done(cfg, res)
    return results

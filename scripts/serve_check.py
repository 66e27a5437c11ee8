#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Start `vllm serve` with a KV-cache dtype, send real OpenAI-API requests (streaming included), stop it.

    python scripts/serve_check.py --model DIR --kv-cache-dtype turboquant_k3v4_nc --out serve-check.json \
        [--log serve.log] [-- EXTRA VLLM SERVE ARGS ...]

Requests: GET /v1/models; POST /v1/completions (plain and stream=true); POST /v1/chat/completions
(plain and stream=true). A streamed answer must arrive as several `data:` chunks ending in `data: [DONE]`
and assemble to non-empty text. Writes a JSON record (requests, answers, timings, pass/fail per check)
and exits 1 if any check failed. Only the standard library is used for the client side.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream(url: str, body: dict, timeout: float = 120.0) -> dict:
    """POST with stream=true; returns the chunk count, the assembled text and whether [DONE] came."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    chunks, text, done, t0, first = 0, [], False, time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        status = r.status
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            chunks += 1
            first = first or time.perf_counter() - t0
            choice = json.loads(payload)["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return dict(status=status, chunks=chunks, text="".join(text), done=done,
                first_chunk_s=round(first or 0.0, 3), total_s=round(time.perf_counter() - t0, 3))


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was ready")
        try:
            if http("GET", base + "/health", timeout=5)[0] == 200:
                return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s")


def run_checks(base: str, model: str, max_tokens: int) -> list[dict]:
    checks = []

    def record(name: str, fn) -> None:
        t = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # a failed request is a failed check, recorded with its reason
            ok, detail = False, {"error": f"{type(e).__name__}: {e}"}
        checks.append(dict(name=name, ok=ok, seconds=round(time.perf_counter() - t, 3), **detail))
        print(f"[serve-check] {name}: {'ok' if ok else 'FAILED'} {json.dumps(detail)[:300]}", flush=True)

    def models():
        st, body = http("GET", base + "/v1/models")
        ids = [m["id"] for m in json.loads(body)["data"]] if st == 200 else []
        return st == 200 and model in ids, dict(status=st, models=ids)

    def completion():
        st, body = http("POST", base + "/v1/completions",
                        dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0))
        doc = json.loads(body)
        text = doc["choices"][0]["text"] if st == 200 else ""
        return st == 200 and bool(text.strip()), dict(status=st, text=text, usage=doc.get("usage"))

    def completion_stream():
        r = stream(base + "/v1/completions",
                   dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True))
        return r["status"] == 200 and r["done"] and r["chunks"] > 1 and bool(r["text"].strip()), r

    def chat():
        st, body = http("POST", base + "/v1/chat/completions",
                        dict(model=model, messages=CHAT, max_tokens=max_tokens, temperature=0.0))
        doc = json.loads(body)
        text = doc["choices"][0]["message"]["content"] if st == 200 else ""
        return st == 200 and bool((text or "").strip()), dict(status=st, text=text, usage=doc.get("usage"))

    def chat_stream():
        r = stream(base + "/v1/chat/completions",
                   dict(model=model, messages=CHAT, max_tokens=max_tokens, temperature=0.0, stream=True))
        return r["status"] == 200 and r["done"] and r["chunks"] > 1 and bool(r["text"].strip()), r

    def stream_matches_plain():
        plain = next(c for c in checks if c["name"] == "completion").get("text")
        streamed = next(c for c in checks if c["name"] == "completion_stream").get("text")
        return plain is not None and plain == streamed, dict(plain=plain, streamed=streamed)

    for name, fn in (("models", models), ("completion", completion), ("completion_stream", completion_stream),
                     ("chat", chat), ("chat_stream", chat_stream), ("stream_matches_plain", stream_matches_plain)):
        record(name, fn)
    return checks


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local model folder (served under this name)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ready-timeout", type=float, default=400.0, help="seconds to wait for the server")
    ap.add_argument("--log", default="serve.log", help="server stdout+stderr")
    ap.add_argument("--out", default="serve-check.json")
    args = ap.parse_args(argv)

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--kv-cache-dtype", args.kv_cache_dtype, *extra]
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    log_path = Path(args.log)
    print(f"[serve-check] {' '.join(cmd)}", flush=True)
    doc = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), command=" ".join(cmd),
               model=args.model, kv_cache_dtype=args.kv_cache_dtype, checks=[])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            doc["ready_s"] = round(wait_ready(f"http://127.0.0.1:{port}", proc, args.ready_timeout), 1)
            print(f"[serve-check] ready after {doc['ready_s']} s", flush=True)
            doc["checks"] = run_checks(f"http://127.0.0.1:{port}", args.model, args.max_tokens)
        except (RuntimeError, TimeoutError) as e:
            doc["error"] = str(e)
            print(f"[serve-check] {e}", flush=True)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            doc["server_returncode"] = proc.returncode
    text = log_path.read_text(errors="replace")
    doc["backend_lines"] = [ln.strip()[-300:] for ln in text.splitlines()
                            if "TurboQuant" in ln or "attention backend" in ln.lower() or "KV cache size" in ln][:12]
    doc["ok"] = bool(doc["checks"]) and all(c["ok"] for c in doc["checks"])
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"[serve-check] {'PASS' if doc['ok'] else 'FAIL'} -> {args.out}", flush=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

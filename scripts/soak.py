#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
r"""Soak-test a running OpenAI-compatible server (`vllm serve`): N seeded requests at concurrency C, then a report.

    python scripts/soak.py --url http://127.0.0.1:8000 --requests 1000 --concurrency 200 --out soak-k3v4
    python scripts/soak.py --url http://127.0.0.1:8000 --model NAME --max-model-len 8192 --duration-limit 900 \
        --max-errors 5 --api-key KEY        # or OPENAI_API_KEY in the environment

The request mix is a pure function of --seed and the arguments (and of the server's max_model_len and measured
tokens per word, both recorded in the report; pass --max-model-len and --tokens-per-word to pin them): streaming and
non-streaming requests to /v1/chat/completions and /v1/completions; prompts from a few tokens to near the context
limit; a share starting with one of a few long shared prefixes (prefix caching); a share cancelled mid-stream (the
client closes the stream after k chunks); groups of identical temperature-0 requests spread over the run (does each
repeat answer exactly like the first of its group?); varied max_tokens and temperatures; logprobs on a share (every
returned logprob must be finite). Prompt lengths are counted in words of a fixed vocabulary and converted with the
tokens per word measured through vLLM's POST /tokenize (1.3 assumed where the server has none); near-limit prompts keep
a margin for the chat template.

Writes OUT/report.json, OUT/report.md and OUT/requests.jsonl (one line per request, no prompt text): outcomes (ok,
cancelled as planned, HTTP error by status, connection error, timeout, protocol/JSON error, error inside a stream),
error examples, empty outputs, non-finite logprobs, TTFT and latency percentiles, output tokens/s, temperature-0
repeat agreement, and from GET /metrics (before, every --metrics-interval seconds, after) the preemption count and the
peaks of KV-cache usage and running/waiting requests; metrics the server does not export are reported as absent.

Exit status: 0 when the errors (requests that failed other than by a planned cancel, plus requests with a non-finite
logprob) are at most --max-errors, 1 otherwise, 2 for argument errors or when the server cannot be used (unreachable,
no model, unknown context length). Targets other than loopback (127.0.0.0/8, ::1, localhost) are refused unless
--allow-remote is given. The client is httpx (async); tqdm draws the progress bar.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import hashlib
import ipaddress
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

try:
    import httpx
except ImportError:  # reported by main(); the pure parts (plan, parsers, report) work without it
    httpx = None

# A fixed vocabulary of common English words, one token each (with the leading space) in the usual BPE and
# SentencePiece vocabularies; prompt lengths are counted in these words.
WORDS = """the of and to in is was for on that with as by at from his her they this had not are but have were which
one all their there been has more when will would who out two time into only other new some could these may first any
then about after most made over did many such where years through back much before good great well between under last
long being same still own day might also year place see work old life never right here world both while small each
house people water found part three home hand city light point line state night large form end turn open
river stone green white black cold warm field south north east west school story music paper table tree bird horse
garden window road bridge market winter summer spring morning evening island mountain forest valley letter number
""".split()
TEMPERATURES = (0.0, 0.0, 0.7, 1.0)
OVERHEAD_TOKENS = {"chat": 64, "completions": 32}  # chat template and the prompt's frame, kept free near the limit
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DEFAULT_TOKENS_PER_WORD = 1.3
# Outcomes in report order; every one but ok, cancelled and not_started counts as an error.
OUTCOMES = ("ok", "cancelled", "http_error", "connection_error", "timeout", "protocol_error", "stream_error",
            "client_error", "not_started")
ERROR_OUTCOMES = ("http_error", "connection_error", "timeout", "protocol_error", "stream_error", "client_error")
OUTCOME_LABELS = {"ok": "ok", "cancelled": "cancelled as planned", "http_error": "HTTP error",
                  "connection_error": "connection error", "timeout": "timeout",
                  "protocol_error": "protocol/JSON error", "stream_error": "error reported inside a stream",
                  "client_error": "client exception", "not_started": "not started (duration limit)"}
# vLLM's Prometheus series: (report key, kind, names tried in order, aggregate over label sets, label).
SERVER_METRICS = (
    ("preemptions", "counter", ("vllm:num_preemptions_total", "vllm:num_preemptions"), "sum", "preemptions"),
    ("prefix_cache_queries", "counter", ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
                                         "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries"),
     "sum", "prefix-cache queries (tokens)"),
    ("prefix_cache_hits", "counter", ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
                                      "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits"),
     "sum", "prefix-cache hits (tokens)"),
    ("kv_cache_usage", "gauge", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "max",
     "KV-cache usage (1.0 = full)"),
    ("requests_running", "gauge", ("vllm:num_requests_running",), "sum", "requests running"),
    ("requests_waiting", "gauge", ("vllm:num_requests_waiting",), "sum", "requests waiting"),
)


# ----------------------------------------------------------------------------------------------------------------
# Request plan: a pure function of the seed and the arguments.


@dataclass(frozen=True)
class PlanConfig:
    requests: int = 1000
    seed: int = 0
    max_model_len: int = 4096
    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD
    max_tokens: int = 512
    stream_fraction: float = 0.5
    chat_fraction: float = 0.5
    cancel_fraction: float = 0.1
    prefix_fraction: float = 0.25
    num_prefixes: int = 4
    prefix_tokens: int = 1024
    logprobs_fraction: float = 0.1
    near_limit_fraction: float = 0.05
    repeat_groups: int = 8
    repeat_size: int = 4


@dataclass(frozen=True)
class PlanItem:
    index: int
    endpoint: str  # "chat" | "completions"
    stream: bool
    cancel_after: int | None  # close the stream after this many content chunks
    prompt_seed: int  # the prompt body's words; shared by the members of a repeat group
    body_words: int
    prefix_id: int | None
    prefix_words: int
    est_prompt_tokens: int
    max_tokens: int
    temperature: float
    logprobs: bool
    repeat_group: int | None
    near_limit: bool


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    lo, hi = max(1, lo), max(1, hi)
    if hi <= lo:
        return hi
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def plan_limits(cfg: PlanConfig) -> tuple[int, int, int]:
    """(largest max_tokens, shared-prefix tokens, shared-prefix words) for this context length."""
    mt_cap = max(1, min(cfg.max_tokens, cfg.max_model_len // 4))
    prefix_tokens = max(0, min(cfg.prefix_tokens, cfg.max_model_len // 4))
    return mt_cap, prefix_tokens, int(prefix_tokens / cfg.tokens_per_word)


def make_plan(cfg: PlanConfig) -> list[PlanItem]:
    """The requests of one soak, in sending order. Shares are exact counts (round(fraction * requests)) drawn from
    the requests that are not temperature-0 repeats; a repeat group draws its endpoint and streaming once."""
    rng = random.Random(f"soak-plan:{cfg.seed}")
    n = cfg.requests
    size = cfg.repeat_size if cfg.repeat_size >= 2 else 0
    groups = min(cfg.repeat_groups, n // size) if size else 0
    group_of = {i: k // size for k, i in enumerate(rng.sample(range(n), groups * size))} if groups else {}
    others = [i for i in range(n) if i not in group_of]

    def share(fraction: float, pool: list[int], already: int = 0) -> set[int]:
        return set(rng.sample(pool, min(len(pool), max(0, round(fraction * n) - already))))

    group_stream = [rng.random() < cfg.stream_fraction for _ in range(groups)]
    group_chat = [rng.random() < cfg.chat_fraction for _ in range(groups)]
    cancels = share(cfg.cancel_fraction, others)
    stream = cancels | share(cfg.stream_fraction, [i for i in others if i not in cancels],
                             len(cancels) + sum(group_stream[g] for g in group_of.values()))
    chat = share(cfg.chat_fraction, others, sum(group_chat[g] for g in group_of.values()))
    prefixed = share(cfg.prefix_fraction, others) if cfg.num_prefixes > 0 else set()
    logprobs = share(cfg.logprobs_fraction, others)
    near = share(cfg.near_limit_fraction, others)
    mt_cap, prefix_tokens, prefix_words = plan_limits(cfg)
    tpw = cfg.tokens_per_word

    def prompt_words(endpoint: str, max_tokens: int, prefix: bool, near_limit: bool) -> int:
        allowed = cfg.max_model_len - max_tokens - OVERHEAD_TOKENS[endpoint] - (prefix_tokens if prefix else 0)
        target = rng.uniform(0.9, 0.98) * allowed if near_limit else _log_uniform(rng, 4, allowed)
        return max(1, int(target / tpw))

    group_params = []
    for g in range(groups):
        endpoint = "chat" if group_chat[g] else "completions"
        max_tokens = _log_uniform(rng, min(16, mt_cap), mt_cap)
        group_params.append((endpoint, max_tokens, prompt_words(endpoint, max_tokens, False, False),
                             rng.getrandbits(48)))
    items = []
    for i in range(n):
        if i in group_of:
            endpoint, max_tokens, words, seed = group_params[group_of[i]]
            items.append(PlanItem(i, endpoint, group_stream[group_of[i]], None, seed, words, None, 0,
                                  round(words * tpw) + OVERHEAD_TOKENS[endpoint], max_tokens, 0.0, False,
                                  group_of[i], False))
            continue
        endpoint = "chat" if i in chat else "completions"
        cancel_after = rng.randint(1, max(1, min(16, mt_cap // 2))) if i in cancels else None
        max_tokens = _log_uniform(rng, 1, mt_cap)
        if cancel_after is not None:
            max_tokens = max(max_tokens, min(mt_cap, 2 * cancel_after + 8))
        prefix_id = rng.randrange(cfg.num_prefixes) if i in prefixed else None
        words = prompt_words(endpoint, max_tokens, prefix_id is not None, i in near)
        pw = prefix_words if prefix_id is not None else 0
        items.append(PlanItem(i, endpoint, i in stream, cancel_after, rng.getrandbits(48), words, prefix_id, pw,
                              round((words + pw) * tpw) + OVERHEAD_TOKENS[endpoint], max_tokens,
                              rng.choice(TEMPERATURES), i in logprobs, None, i in near))
    return items


def plan_digest(plan: list[PlanItem]) -> str:
    return hashlib.sha256(json.dumps([asdict(p) for p in plan]).encode()).hexdigest()[:16]


def _words(key: str, n: int) -> str:
    return " ".join(random.Random(key).choices(WORDS, k=n))


@functools.lru_cache(maxsize=64)
def prefix_text(seed: int, prefix_id: int, n_words: int) -> str:
    return f"Shared document {prefix_id}: {_words(f'soak-prefix:{seed}:{prefix_id}', n_words)}\n\n"


def prompt_text(item: PlanItem, seed: int) -> str:
    """The prompt of one planned request (a pure function, so the plan never holds long texts)."""
    prefix = prefix_text(seed, item.prefix_id, item.prefix_words) if item.prefix_id is not None else ""
    body = _words(f"soak-body:{item.prompt_seed}", item.body_words)
    return f"{prefix}Notes {item.prompt_seed}: {body}\n\nContinue the text above."


def request_body(item: PlanItem, model: str, prompt: str) -> dict:
    body = dict(model=model, max_tokens=item.max_tokens, temperature=item.temperature)
    if item.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if item.logprobs:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = prompt
        if item.logprobs:
            body["logprobs"] = 2
    if item.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ----------------------------------------------------------------------------------------------------------------
# Target check, SSE and Prometheus parsing.


def check_target(url: str, allow_remote: bool) -> str:
    """The base URL (without a trailing /v1) of an http(s) target; ValueError for other schemes and, unless
    allow_remote, for hosts that are not loopback (names are not resolved: only "localhost" counts)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url {url!r}: the scheme must be one of http, https")
    host = parts.hostname
    if not host:
        raise ValueError(f"--url {url!r} has no host")
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"refusing to soak {host!r}: not a loopback host (127.0.0.0/8, ::1, localhost); "
                         "pass --allow-remote to target a remote server")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class SSEDecoder:
    """Server-sent events fed line by line (text/event-stream): an event's `data:` lines are joined with newlines, a
    blank line ends the event, comments (`:`) and other fields are skipped. feed_line returns an event's data when
    the line completes one."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse(text: str) -> list[str]:
    decoder = SSEDecoder()
    events = [d for d in map(decoder.feed_line, text.splitlines()) if d is not None]
    last = decoder.flush()
    return events + ([last] if last is not None else [])


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: sample name -> [(labels, value)]; comments and unparsable lines are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = {k: v.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(m["labels"] or "")}
        out.setdefault(m["name"], []).append((labels, value))
    return out


def tracked_metrics(parsed: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """The SERVER_METRICS series present, each summed (or maxed) over its label sets (engines, models)."""
    out = {}
    for _key, _kind, names, agg, _label in SERVER_METRICS:
        for name in names:
            if name in parsed:
                values = [v for _, v in parsed[name]]
                out[name] = max(values) if agg == "max" else sum(values)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Async runner and metrics sampler.


class SetupError(Exception):
    """The server cannot be soaked (unreachable, no model, unknown context length): exit status 2."""


class RequestFailed(Exception):
    def __init__(self, outcome: str, message: str, status: int | None = None):
        super().__init__(message)
        self.outcome, self.status = outcome, status


@dataclass
class Target:
    base: str
    model: str
    headers: dict


def _choice_text(choice: dict, endpoint: str, stream: bool) -> str:
    if endpoint == "completions":
        return choice.get("text") or ""
    msg = choice.get("delta" if stream else "message") or {}
    return (msg.get("reasoning_content") or msg.get("reasoning") or "") + (msg.get("content") or "")


def logprob_values(logprobs) -> list:
    """Every logprob of a choice's `logprobs` (completions: token_logprobs and top_logprobs dicts; chat: content[]
    entries and their top_logprobs)."""
    if not isinstance(logprobs, dict):
        return []
    values = list(logprobs.get("token_logprobs") or [])
    for top in logprobs.get("top_logprobs") or []:
        values.extend((top or {}).values())
    for entry in logprobs.get("content") or []:
        values.append(entry.get("logprob"))
        values.extend(t.get("logprob") for t in entry.get("top_logprobs") or [])
    return [v for v in values if v is not None]


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _error_message(resp) -> str:
    text = resp.text.strip()
    try:
        doc = json.loads(text)
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        text = err.get("message", text) if isinstance(err, dict) else text
    except ValueError:
        pass
    return f"HTTP {resp.status_code}: {str(text)[:300]}"


def _check_choices(doc, where: str) -> list:
    if not isinstance(doc, dict):
        raise RequestFailed("protocol_error", f"{where}: not a JSON object: {str(doc)[:200]}")
    if ("error" in doc or doc.get("object") == "error") and not doc.get("choices"):
        err = doc.get("error", doc)
        raise RequestFailed("stream_error" if where == "stream" else "protocol_error",
                            f"{where}: {err.get('message', err) if isinstance(err, dict) else err}"[:300])
    choices = doc.get("choices")
    if not isinstance(choices, list):
        raise RequestFailed("protocol_error", f"{where}: no 'choices' list in {json.dumps(doc)[:200]}")
    return choices


async def _send(client, target: Target, item: PlanItem, body: dict, res: dict, parts: list[str], t0: float) -> None:
    url = target.base + ENDPOINTS[item.endpoint]

    def take(choice: dict) -> bool:  # one choice of a response or chunk; True when it carried output
        piece = _choice_text(choice, item.endpoint, item.stream)
        if "logprobs" in choice and choice["logprobs"] is not None:
            values = logprob_values(choice["logprobs"])
            res["logprobs_returned"] = True
            res["logprob_values"] += len(values)
            res["nonfinite_logprobs"] += sum(not _is_finite(v) for v in values)
        if piece:
            parts.append(piece)
        return bool(piece)

    def take_usage(doc: dict) -> None:
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            res["output_tokens"], res["tokens_source"] = usage["completion_tokens"], "usage"

    if not item.stream:
        resp = await client.post(url, json=body)
        res["status"] = resp.status_code
        if resp.status_code != 200:
            raise RequestFailed("http_error", _error_message(resp), resp.status_code)
        try:
            doc = json.loads(resp.content)
        except ValueError as e:
            raise RequestFailed("protocol_error", f"invalid JSON ({e}): {resp.text[:200]}") from None
        choices = _check_choices(doc, "response")
        if not choices or not isinstance(choices[0], dict):
            raise RequestFailed("protocol_error", f"empty 'choices' in {resp.text[:200]}")
        take(choices[0])
        take_usage(doc)
        res["outcome"] = "ok"
        return

    async with client.stream("POST", url, json=body) as resp:
        res["status"] = resp.status_code
        if resp.status_code != 200:
            await resp.aread()
            raise RequestFailed("http_error", _error_message(resp), resp.status_code)
        decoder, done = SSEDecoder(), False
        async for line in resp.aiter_lines():
            data = decoder.feed_line(line)
            if data is None:
                continue
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                doc = json.loads(data)
            except ValueError as e:
                raise RequestFailed("protocol_error", f"invalid JSON in stream ({e}): {data[:200]}") from None
            for choice in _check_choices(doc, "stream"):
                if isinstance(choice, dict) and take(choice):
                    res["chunks"] += 1
                    if res["ttft_s"] is None:
                        res["ttft_s"] = time.perf_counter() - t0
            take_usage(doc)
            if item.cancel_after is not None and res["chunks"] >= item.cancel_after:
                res["outcome"] = "cancelled"
                return  # leaving the block closes the connection: the server sees a client disconnect
        if not done:
            last = decoder.flush()
            if last is None or last.strip() != "[DONE]":
                raise RequestFailed("protocol_error", f"stream ended without data: [DONE] after {res['chunks']} "
                                    "chunks")
        if item.cancel_after is not None:
            res["cancel_missed"] = True  # finished before its cancel point: counted as ok
        res["outcome"] = "ok"


def _exception_text(e: BaseException) -> str:
    """Type and message, through the exceptions it wraps (httpx's ReadError often has an empty message)."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    while cause is not None and not str(e):
        text += f" <- {type(cause).__name__}: {cause}"
        e, cause = cause, cause.__cause__ or cause.__context__
    return text[:300]


async def execute(client, target: Target, item: PlanItem, seed: int, timeout: float, t_run: float) -> dict:
    """One planned request; never raises: the outcome and its measurements are in the returned record."""
    res = dict(index=item.index, endpoint=item.endpoint, stream=item.stream, planned_cancel=item.cancel_after,
               repeat_group=item.repeat_group, prefix_id=item.prefix_id, logprobs=item.logprobs,
               max_tokens=item.max_tokens, est_prompt_tokens=item.est_prompt_tokens, outcome=None, status=None,
               error=None, start_s=None, ttft_s=None, latency_s=None, chunks=0, output_tokens=None,
               tokens_source=None, output_chars=0, output_sha=None, logprobs_returned=False, logprob_values=0,
               nonfinite_logprobs=0, cancel_missed=False)
    body = request_body(item, target.model, prompt_text(item, seed))
    parts: list[str] = []
    t0 = time.perf_counter()
    res["start_s"] = round(time.monotonic() - t_run, 3)
    try:
        await asyncio.wait_for(_send(client, target, item, body, res, parts, t0), timeout)
    except RequestFailed as e:
        res.update(outcome=e.outcome, error=str(e), status=e.status or res["status"])
    except asyncio.TimeoutError:
        res.update(outcome="timeout", error=f"no complete answer within {timeout:g} s")
    except Exception as e:  # a failed request is a recorded outcome, never the end of the soak
        if httpx is not None and isinstance(e, httpx.TimeoutException):
            res.update(outcome="timeout", error=_exception_text(e))
        elif httpx is not None and isinstance(e, httpx.TransportError):
            res.update(outcome="connection_error", error=_exception_text(e))
        else:
            res.update(outcome="client_error", error=_exception_text(e))
    res["latency_s"] = time.perf_counter() - t0
    text = "".join(parts)
    res["output_chars"] = len(text)
    res["output_sha"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    if res["output_tokens"] is None and res["outcome"] in ("ok", "cancelled"):
        res["output_tokens"], res["tokens_source"] = (res["chunks"], "chunks") if item.stream else (None, None)
    if item.repeat_group is not None:
        res["text"] = text
    return res


@dataclass
class RunConfig:
    concurrency: int
    timeout: float
    duration_limit: float | None
    seed: int


async def run_plan(plan: list[PlanItem], target: Target, cfg: RunConfig, on_done=None) -> tuple[list[dict], dict]:
    """Send the plan with cfg.concurrency workers; after cfg.duration_limit seconds no new request starts."""
    results: list[dict | None] = [None] * len(plan)
    pending = iter(range(len(plan)))
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    t_run = time.monotonic()
    hit_limit = False

    async def worker(client) -> None:
        nonlocal hit_limit
        for i in pending:
            if cfg.duration_limit is not None and time.monotonic() - t_run >= cfg.duration_limit:
                hit_limit = True
                return
            results[i] = await execute(client, target, plan[i], cfg.seed, cfg.timeout, t_run)
            if on_done is not None:
                on_done(results[i])

    async with httpx.AsyncClient(headers=target.headers, limits=limits, timeout=httpx.Timeout(cfg.timeout)) as c:
        await asyncio.gather(*(worker(c) for _ in range(max(1, min(cfg.concurrency, len(plan))))))
    wall = time.monotonic() - t_run
    out = [r if r is not None else dict(index=p.index, endpoint=p.endpoint, stream=p.stream, outcome="not_started",
                                        repeat_group=p.repeat_group, planned_cancel=p.cancel_after)
           for p, r in zip(plan, results)]
    return out, dict(wall_s=round(wall, 3), duration_limit_hit=hit_limit,
                     started=sum(r is not None for r in results))


class MetricsSampler:
    """GET /metrics: snapshot() returns the tracked series (or None, with self.error set); run() samples every
    `interval` seconds until `stop` is set."""

    def __init__(self, client, url: str, interval: float):
        self.client, self.url, self.interval = client, url, interval
        self.samples: list[dict] = []
        self.error: str | None = None

    async def snapshot(self) -> dict[str, float] | None:
        try:
            resp = await self.client.get(self.url, timeout=10.0)
        except Exception as e:  # the soak goes on without metrics
            self.error = f"GET /metrics: {type(e).__name__}: {e}"[:300]
            return None
        if resp.status_code != 200:
            self.error = f"GET /metrics: HTTP {resp.status_code}"
            return None
        return tracked_metrics(parse_prometheus(resp.text))

    async def run(self, stop: asyncio.Event, t_run: float) -> None:
        while not stop.is_set():
            snap = await self.snapshot()
            if snap is not None:
                self.samples.append(dict(t=round(time.monotonic() - t_run, 2), values=snap))
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


# ----------------------------------------------------------------------------------------------------------------
# Report (pure) and markdown (pure).


def percentiles(values: list[float]) -> dict:
    """n, p50/p90/p99 (linear interpolation), mean and max; None entries when there are no values."""
    xs = sorted(values)
    if not xs:
        return dict(n=0, p50=None, p90=None, p99=None, mean=None, max=None)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return dict(n=len(xs), p50=round(q(0.5), 4), p90=round(q(0.9), 4), p99=round(q(0.99), 4),
                mean=round(sum(xs) / len(xs), 4), max=round(xs[-1], 4))


def summarize_metrics(before: dict | None, after: dict | None, samples: list[dict], error: str | None) -> dict:
    snaps = [s for s in (before, *(x["values"] for x in samples), after) if s is not None]
    out: dict = dict(available=bool(snaps), error=error, samples=len(samples))
    for key, kind, names, _agg, label in SERVER_METRICS:
        name = next((n for n in names if any(n in s for s in snaps)), None)
        if name is None:
            out[key] = dict(present=False, label=label, names_tried=list(names))
            continue
        b, a = (before or {}).get(name), (after or {}).get(name)
        entry = dict(present=True, label=label, kind=kind, name=name, before=b, after=a)
        if kind == "counter":
            entry["delta"] = a - b if a is not None and b is not None else None
            entry["reset"] = entry["delta"] is not None and entry["delta"] < 0
        else:
            values = [s[name] for s in snaps if name in s]
            entry["peak"] = max(values, key=lambda v: -math.inf if math.isnan(v) else v)
        out[key] = entry
    hits, queries = out["prefix_cache_hits"], out["prefix_cache_queries"]
    out["prefix_cache_hit_rate"] = (round(hits["delta"] / queries["delta"], 4)
                                    if hits["present"] and queries["present"] and hits["delta"] is not None
                                    and queries["delta"] else None)
    return out


def error_kind(r: dict) -> str:
    return f"http_{r.get('status')}" if r["outcome"] == "http_error" else r["outcome"]


def repeat_agreement(results: list[dict]) -> dict:
    """Each repeat group's completed answers against the first completed one in sending order."""
    groups: dict[int, list[dict]] = {}
    for r in sorted(results, key=lambda r: r["index"]):
        if r.get("repeat_group") is not None and r["outcome"] == "ok":
            groups.setdefault(r["repeat_group"], []).append(r)
    compared = agreeing = 0
    disagreeing = []
    for g, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        ref = members[0]["text"]
        same = [m["text"] == ref for m in members[1:]]
        compared += len(same)
        agreeing += sum(same)
        if not all(same):
            other = next(m["text"] for m in members[1:] if m["text"] != ref)
            at = next((k for k, (x, y) in enumerate(zip(ref, other)) if x != y), min(len(ref), len(other)))
            disagreeing.append(dict(group=g, members=len(members), agree=sum(same), first_difference_at_char=at,
                                    first=ref[max(0, at - 40):at + 40], other=other[max(0, at - 40):at + 40]))
    planned = len({r["repeat_group"] for r in results if r.get("repeat_group") is not None})
    return dict(planned_groups=planned, groups=sum(len(m) >= 2 for m in groups.values()), compared=compared,
                agreeing=agreeing, rate=round(agreeing / compared, 4) if compared else None,
                disagreeing_groups=disagreeing[:10])


def build_report(meta: dict, plan: list[PlanItem], results: list[dict], run: dict, metrics: dict,
                 max_errors: int) -> dict:
    n = len(plan)
    counts = {k: sum(r["outcome"] == k for r in results) for k in OUTCOMES}
    http = {}
    for r in results:
        if r["outcome"] == "http_error":
            http[str(r.get("status"))] = http.get(str(r.get("status")), 0) + 1
    by_kind: dict[str, dict] = {}
    for r in results:
        if r["outcome"] in ERROR_OUTCOMES:
            e = by_kind.setdefault(error_kind(r), dict(count=0, examples=[]))
            e["count"] += 1
            if len(e["examples"]) < 3:
                e["examples"].append(dict(index=r["index"], endpoint=r["endpoint"], stream=r["stream"],
                                          message=r.get("error")))
    done = [r for r in results if r["outcome"] in ("ok", "cancelled")]
    ok = [r for r in results if r["outcome"] == "ok"]
    nonfinite = [r["index"] for r in results if r.get("nonfinite_logprobs")]
    failed = {r["index"] for r in results if r["outcome"] in ERROR_OUTCOMES}
    counted = len(failed | set(nonfinite))
    empty = [r["index"] for r in ok if not r.get("output_chars")]
    tokens = [r["output_tokens"] for r in done if r.get("output_tokens") is not None]
    wall = run.get("wall_s") or 0.0
    lp = [r for r in results if r.get("logprobs") and r["outcome"] in ("ok", "cancelled")]
    est = sorted(p.est_prompt_tokens for p in plan)
    report = dict(
        tool="scripts/soak.py", **meta,
        plan=dict(requests=n, sha256=plan_digest(plan),
                  streaming=sum(p.stream for p in plan), chat=sum(p.endpoint == "chat" for p in plan),
                  cancel=sum(p.cancel_after is not None for p in plan),
                  shared_prefix=sum(p.prefix_id is not None for p in plan),
                  logprobs=sum(p.logprobs for p in plan), repeat_requests=sum(p.repeat_group is not None for p in plan),
                  near_limit=sum(p.near_limit for p in plan),
                  est_prompt_tokens=dict(min=est[0], median=est[len(est) // 2], max=est[-1]) if est else None,
                  max_tokens=dict(min=min(p.max_tokens for p in plan), max=max(p.max_tokens for p in plan))
                  if plan else None),
        run=dict(run, not_started=counts["not_started"]),
        outcomes=dict(counts, http_error_by_status=dict(sorted(http.items()))),
        errors=dict(total=sum(e["count"] for e in by_kind.values()), by_kind=dict(sorted(by_kind.items()))),
        empty_outputs=dict(count=len(empty), indices=empty[:20]),
        cancel_missed=sum(bool(r.get("cancel_missed")) for r in results),
        logprobs=dict(requested=sum(bool(r.get("logprobs")) for r in results), answered=len(lp),
                      missing=sum(not r.get("logprobs_returned") for r in lp),
                      values_checked=sum(r.get("logprob_values", 0) for r in lp),
                      nonfinite_values=sum(r.get("nonfinite_logprobs", 0) for r in results),
                      requests_with_nonfinite=len(nonfinite), nonfinite_indices=nonfinite[:20]),
        latency=dict(ttft_s=percentiles([r["ttft_s"] for r in done if r.get("stream") and r.get("ttft_s") is not None]),
                     total_s=percentiles([r["latency_s"] for r in ok if r.get("latency_s") is not None])),
        throughput=dict(output_tokens=sum(tokens),
                        from_usage=sum(r.get("tokens_source") == "usage" for r in done),
                        from_chunk_counts=sum(r.get("tokens_source") == "chunks" for r in done),
                        output_tokens_per_s=round(sum(tokens) / wall, 2) if wall > 0 else None,
                        requests_per_s=round(len(done) / wall, 3) if wall > 0 else None),
        repeats=repeat_agreement(results),
        server_metrics=metrics,
    )
    report["verdict"] = dict(counted_errors=counted, max_errors=max_errors, passed=counted <= max_errors,
                             exit_status=0 if counted <= max_errors else 1)
    return report


def exit_status(report: dict, max_errors: int | None = None) -> int:
    limit = report["verdict"]["max_errors"] if max_errors is None else max_errors
    return 0 if report["verdict"]["counted_errors"] <= limit else 1


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}".rstrip("0").rstrip(".") if math.isfinite(v) else str(v)
    return str(v)


def _md(text) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|").replace("`", "'")


def render_markdown(report: dict) -> str:
    t, run, oc, v = report["target"], report["run"], report["outcomes"], report["verdict"]
    plan, s = report["plan"], report["settings"]
    lines = [f"# Soak: {t['model']} at {t['url']}", "",
             f"{report['date']}; {run['started']} of {plan['requests']} requests started at concurrency "
             f"{s['concurrency']} in {_fmt(run['wall_s'], 1)} s"
             + (" (duration limit reached)" if run.get("duration_limit_hit") else "")
             + f"; seed {s['seed']}, plan {plan['sha256']}; max_model_len {t['max_model_len']} "
             f"({t['max_model_len_source']}), {t['tokens_per_word']} tokens/word ({t['tokens_per_word_source']}).",
             "", f"**{'PASS' if v['passed'] else 'FAIL'}**: {v['counted_errors']} counted errors (failed requests "
             f"other than planned cancels, plus requests with non-finite logprobs), --max-errors {v['max_errors']}, "
             f"exit status {v['exit_status']}.", "", "## Outcomes", "", "| outcome | requests |", "|---|---:|"]
    for k in OUTCOMES:
        if k == "http_error":
            by_status = oc["http_error_by_status"].items()
            lines += [f"| HTTP {code} | {c} |" for code, c in by_status] or ["| HTTP error | 0 |"]
        elif oc[k] or k in ("ok", "cancelled"):
            lines.append(f"| {OUTCOME_LABELS[k]} | {oc[k]} |")
    if report["errors"]["by_kind"]:
        lines += ["", "## Errors", ""]
        for kind, e in report["errors"]["by_kind"].items():
            lines.append(f"- **{kind}** ({e['count']})")
            lines += [f"  - request {x['index']} ({x['endpoint']}, {'stream' if x['stream'] else 'plain'}): "
                      f"`{_md(x['message'])[:300]}`" for x in e["examples"]]
    lp, rep, em = report["logprobs"], report["repeats"], report["empty_outputs"]
    lines += ["", "## Outputs", "",
              f"- empty outputs (completed requests with no text): {em['count']}"
              + (f" (requests {', '.join(map(str, em['indices']))})" if em["indices"] else ""),
              f"- logprobs: {lp['requested']} requests asked, {lp['answered']} answered, {lp['missing']} without "
              f"logprobs, {lp['values_checked']} values checked, {lp['nonfinite_values']} non-finite values in "
              f"{lp['requests_with_nonfinite']} requests"
              + (f" (requests {', '.join(map(str, lp['nonfinite_indices']))})" if lp["nonfinite_indices"] else ""),
              f"- planned cancels that finished before their cancel point (counted ok): {report['cancel_missed']}",
              f"- temperature-0 repeats: {rep['groups']} of {rep['planned_groups']} groups with two or more completed "
              f"answers, {rep['agreeing']} of {rep['compared']} repeats identical to the first answer of their group "
              f"(rate {_fmt(rep['rate'], 4)})"]
    for d in rep["disagreeing_groups"]:
        lines.append(f"  - group {d['group']}: {d['agree']} of {d['members'] - 1} agree; first difference at char "
                     f"{d['first_difference_at_char']}: `{_md(d['first'])}` vs `{_md(d['other'])}`")
    lat, tp = report["latency"], report["throughput"]
    lines += ["", "## Latency and throughput", "", "| seconds | n | p50 | p90 | p99 | mean | max |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, key in (("time to first token (streams)", "ttft_s"), ("total latency (completed)", "total_s")):
        p = lat[key]
        lines.append(f"| {name} | {p['n']} | " + " | ".join(_fmt(p[q]) for q in ("p50", "p90", "p99", "mean", "max"))
                     + " |")
    lines += ["", f"Output tokens: {tp['output_tokens']} ({tp['from_usage']} requests counted by usage, "
              f"{tp['from_chunk_counts']} by stream chunks), {_fmt(tp['output_tokens_per_s'], 1)} tokens/s overall; "
              f"{_fmt(tp['requests_per_s'])} requests/s.", "", "## Server metrics (GET /metrics)", ""]
    m = report["server_metrics"]
    if not m.get("available"):
        lines.append(f"Not available{': ' + _md(m['error']) if m.get('error') else ''}.")
    else:
        lines += [f"{m['samples']} samples during the run"
                  + (f" (last error: `{_md(m['error'])}`)" if m.get("error") else "") + ".", "",
                  "| metric | series | before | after | change / peak |", "|---|---|---:|---:|---:|"]
        for key, kind, *_ in SERVER_METRICS:
            e = m[key]
            if not e["present"]:
                lines.append(f"| {e['label']} | absent ({', '.join(e['names_tried'])}) | - | - | absent |")
            elif kind == "counter":
                d = e["delta"]
                lines.append(f"| {e['label']} | {e['name']} | {_fmt(e['before'])} | {_fmt(e['after'])} | "
                             f"{'-' if d is None else ('+' if d >= 0 else '') + _fmt(d)}"
                             f"{' (counter reset)' if e.get('reset') else ''} |")
            else:
                lines.append(f"| {e['label']} | {e['name']} | {_fmt(e['before'])} | {_fmt(e['after'])} | "
                             f"peak {_fmt(e['peak'])} |")
        if m.get("prefix_cache_hit_rate") is not None:
            lines += ["", f"Prefix-cache hit rate during the run: {_fmt(m['prefix_cache_hit_rate'], 4)}."]
    ep, mt = plan["est_prompt_tokens"] or {}, plan["max_tokens"] or {}
    lines += ["", "## Request mix", "", "| planned | requests |", "|---|---:|"]
    lines += [f"| {label} | {plan[key]} |" for label, key in (
        ("streaming", "streaming"), ("/v1/chat/completions", "chat"), ("mid-stream cancel", "cancel"),
        ("shared prefix", "shared_prefix"), ("logprobs", "logprobs"), ("temperature-0 repeats", "repeat_requests"),
        ("near the context limit", "near_limit"))]
    lines += ["", f"Estimated prompt tokens {ep.get('min')} / {ep.get('median')} / {ep.get('max')} (min / median / "
              f"max); max_tokens {mt.get('min')} to {mt.get('max')}.", ""]
    return "\n".join(lines)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# ----------------------------------------------------------------------------------------------------------------
# Command line.


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number from 0 to 1")
    return v


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {'integer' if kind is int else 'number'}")
        return v
    return parse


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (a trailing /v1 is accepted)")
    ap.add_argument("--allow-remote", action="store_true", help="allow a target host that is not loopback")
    ap.add_argument("--model", help="model name sent in requests (default: the first entry of GET /v1/models)")
    ap.add_argument("--api-key", help="Bearer token (default: the OPENAI_API_KEY environment variable)")
    ap.add_argument("--max-model-len", type=_positive(int),
                    help="context length (default: max_model_len of GET /v1/models); at least 256")
    ap.add_argument("--tokens-per-word", type=_positive(float),
                    help="tokens per prompt word (default: measured with POST /tokenize, else "
                         f"{DEFAULT_TOKENS_PER_WORD})")
    ap.add_argument("--requests", type=_positive(int), default=1000, help="requests in the plan")
    ap.add_argument("--concurrency", type=_positive(int), default=200, help="requests in flight at once")
    ap.add_argument("--duration-limit", type=float, metavar="S",
                    help="start no new request after S seconds (the report covers what ran)")
    ap.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request plan")
    ap.add_argument("--max-tokens", type=_positive(int), default=512,
                    help="largest max_tokens (varied log-uniformly from 1; capped at max_model_len/4)")
    ap.add_argument("--stream-fraction", type=_fraction, default=0.5, help="share of streaming requests")
    ap.add_argument("--chat-fraction", type=_fraction, default=0.5,
                    help="share sent to /v1/chat/completions (the rest: /v1/completions)")
    ap.add_argument("--cancel-fraction", type=_fraction, default=0.1,
                    help="share of requests cancelled mid-stream (streaming; at most --stream-fraction)")
    ap.add_argument("--prefix-fraction", type=_fraction, default=0.25,
                    help="share of prompts starting with one of the shared prefixes")
    ap.add_argument("--num-prefixes", type=_non_negative_int, default=4, help="number of shared prefixes")
    ap.add_argument("--prefix-tokens", type=_positive(int), default=1024,
                    help="length of a shared prefix (capped at max_model_len/4)")
    ap.add_argument("--logprobs-fraction", type=_fraction, default=0.1,
                    help="share of requests asking for logprobs (all must be finite)")
    ap.add_argument("--near-limit-fraction", type=_fraction, default=0.05,
                    help="share of prompts at 90-98%% of the room left by max_tokens in the context")
    ap.add_argument("--repeat-groups", type=_non_negative_int, default=8,
                    help="groups of identical temperature-0 requests")
    ap.add_argument("--repeat-size", type=_non_negative_int, default=4, help="requests per repeat group")
    ap.add_argument("--metrics-interval", type=_positive(float), default=1.0,
                    help="seconds between GET /metrics samples")
    ap.add_argument("--max-errors", type=_non_negative_int, default=0, help="counted errors tolerated (exit 0)")
    ap.add_argument("--out", help="output folder (default: soak-<UTC timestamp>)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.base = check_target(args.url, args.allow_remote)
    except ValueError as e:
        ap.error(str(e))
    if args.cancel_fraction > args.stream_fraction:
        ap.error(f"--cancel-fraction {args.cancel_fraction} exceeds --stream-fraction {args.stream_fraction}: "
                 "cancelled requests are streams")
    if args.max_model_len is not None and args.max_model_len < 256:
        ap.error(f"--max-model-len {args.max_model_len}: expected at least 256")
    if args.duration_limit is not None and args.duration_limit < 0:
        ap.error(f"--duration-limit {args.duration_limit}: expected seconds >= 0")
    return args


def plan_config_from_args(args: argparse.Namespace, max_model_len: int, tokens_per_word: float) -> PlanConfig:
    return PlanConfig(requests=args.requests, seed=args.seed, max_model_len=max_model_len,
                      tokens_per_word=round(tokens_per_word, 4), max_tokens=args.max_tokens,
                      stream_fraction=args.stream_fraction, chat_fraction=args.chat_fraction,
                      cancel_fraction=args.cancel_fraction, prefix_fraction=args.prefix_fraction,
                      num_prefixes=args.num_prefixes, prefix_tokens=args.prefix_tokens,
                      logprobs_fraction=args.logprobs_fraction, near_limit_fraction=args.near_limit_fraction,
                      repeat_groups=args.repeat_groups, repeat_size=args.repeat_size)


async def _discover(client, args) -> tuple[str, int, str]:
    """Model name and context length from the arguments or GET /v1/models; SetupError with the reason."""
    try:
        resp = await client.get(args.base + "/v1/models", timeout=30.0)
    except httpx.HTTPError as e:
        raise SetupError(f"cannot reach {args.base}/v1/models: {type(e).__name__}: {e}") from None
    if resp.status_code == 401:
        raise SetupError("GET /v1/models: HTTP 401; pass --api-key or set OPENAI_API_KEY")
    entries = []
    if resp.status_code == 200:
        try:
            entries = [m for m in resp.json().get("data", []) if isinstance(m, dict)]
        except ValueError:
            entries = []
    model = args.model or (entries[0].get("id") if entries else None)
    if not model:
        raise SetupError(f"GET /v1/models gave HTTP {resp.status_code} and no model; pass --model")
    if args.max_model_len:
        return model, args.max_model_len, "--max-model-len"
    mml = next((m.get("max_model_len") for m in entries if m.get("id") == model), None)
    if not isinstance(mml, int):
        raise SetupError(f"the server reports no max_model_len for {model!r}; pass --max-model-len")
    if mml < 256:
        raise SetupError(f"max_model_len {mml} of {model!r} is below 256, too small for the mix")
    return model, mml, "GET /v1/models"


async def _tokens_per_word(client, args, model: str) -> tuple[float, str]:
    if args.tokens_per_word:
        return args.tokens_per_word, "--tokens-per-word"
    counts = []
    for n in (100, 600):
        try:
            resp = await client.post(args.base + "/tokenize", json=dict(model=model, prompt=_words("soak-cal", n)),
                                     timeout=30.0)
            counts.append(int(resp.json()["count"]) if resp.status_code == 200 else None)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            counts.append(None)
    if None in counts or counts[1] <= counts[0]:
        return DEFAULT_TOKENS_PER_WORD, "assumed (no POST /tokenize)"
    return min(4.0, max(0.5, (counts[1] - counts[0]) / 500)), "POST /tokenize"


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with the --api-key value hidden (the report records the command)."""
    out = []
    for k, a in enumerate(argv):
        hidden = k > 0 and argv[k - 1] == "--api-key"
        out.append("***" if hidden else "--api-key=***" if a.startswith("--api-key=") else a)
    return out


async def soak(args: argparse.Namespace, api_key: str | None) -> int:
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers) as ctl:
        model, mml, mml_source = await _discover(ctl, args)
        tpw, tpw_source = await _tokens_per_word(ctl, args, model)
        plan = make_plan(plan_config_from_args(args, mml, tpw))
        print(f"[soak] {args.base}: model {model!r}, max_model_len {mml} ({mml_source}), {tpw:.3f} tokens/word "
              f"({tpw_source}); {len(plan)} requests at concurrency {args.concurrency}", file=sys.stderr, flush=True)
        sampler = MetricsSampler(ctl, args.base + "/metrics", args.metrics_interval)
        before = await sampler.snapshot()
        first_error = sampler.error
        stop = asyncio.Event()
        t_run = time.monotonic()
        sampling = asyncio.ensure_future(sampler.run(stop, t_run)) if before is not None else None
        bar = tqdm(total=len(plan), desc="soak", unit="req", disable=args.no_progress, file=sys.stderr)
        errors = 0

        def on_done(r: dict) -> None:
            nonlocal errors
            errors += r["outcome"] in ERROR_OUTCOMES or bool(r.get("nonfinite_logprobs"))
            bar.set_postfix(errors=errors, refresh=False)
            bar.update(1)

        try:
            results, run = await run_plan(plan, Target(args.base, model, headers),
                                          RunConfig(args.concurrency, args.timeout, args.duration_limit, args.seed),
                                          on_done)
        finally:
            bar.close()
            stop.set()
            if sampling is not None:
                await sampling
        after = await sampler.snapshot() if before is not None else None
    metrics = summarize_metrics(before, after, sampler.samples, sampler.error or first_error)
    meta = dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(["scripts/soak.py", *redact_argv(getattr(args, "argv", None) or sys.argv[1:])]),
                target=dict(url=args.base, model=model, max_model_len=mml, max_model_len_source=mml_source,
                            tokens_per_word=round(tpw, 4), tokens_per_word_source=tpw_source),
                settings=dict({k: v for k, v in vars(args).items() if k not in ("api_key", "argv", "base")},
                              api_key="set" if api_key else "none"))
    report = build_report(meta, plan, results, run, metrics, args.max_errors)
    report["metrics_timeline"] = sampler.samples
    out = Path(args.out or f"soak-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(_json_safe(report), indent=1))
    (out / "report.md").write_text(render_markdown(report))
    with open(out / "requests.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(_json_safe({k: v for k, v in r.items() if k != "text"})) + "\n")
    oc = report["outcomes"]
    print(f"[soak] {'PASS' if report['verdict']['passed'] else 'FAIL'}: {oc['ok']} ok, {oc['cancelled']} cancelled "
          f"as planned, {report['verdict']['counted_errors']} counted errors (--max-errors {args.max_errors}), "
          f"{oc['not_started']} not started -> {out}/report.md", file=sys.stderr, flush=True)
    return report["verdict"]["exit_status"]


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = None if argv is None else list(argv)
    if httpx is None:
        print("[soak] needs httpx (pip install httpx); vLLM's environment has it", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        return asyncio.run(soak(args, api_key))
    except SetupError as e:
        print(f"[soak] {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""scripts/soak.py without a GPU: the seeded request plan, the loopback check, SSE and Prometheus parsing, the report
and its markdown on synthetic results, argument errors, and end-to-end runs of the real runner against a small
OpenAI-compatible server in a thread (deterministic answers; a 500, malformed JSON, a hang, an error inside a stream,
a stream without [DONE] and a NaN logprob injected)."""

import hashlib
import importlib.util
import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("soak", None)


# ------------------------------------------------------------------------------------------------------------------
# Plan


def test_plan_is_seeded_and_shares_hold(soak):
    cfg = soak.PlanConfig(requests=2000, seed=7, max_model_len=8192, tokens_per_word=1.2)
    plan = soak.make_plan(cfg)
    assert plan == soak.make_plan(cfg)
    assert soak.plan_digest(plan) == soak.plan_digest(soak.make_plan(cfg))
    assert soak.plan_digest(plan) != soak.plan_digest(soak.make_plan(soak.PlanConfig(**{**cfg.__dict__, "seed": 8})))
    assert [p.index for p in plan] == list(range(2000))
    n = len(plan)

    def share(pred):
        return sum(map(pred, plan)) / n

    assert share(lambda p: p.stream) == pytest.approx(0.5, abs=0.02)
    assert share(lambda p: p.endpoint == "chat") == pytest.approx(0.5, abs=0.02)
    assert share(lambda p: p.cancel_after is not None) == pytest.approx(0.1, abs=0.005)
    assert share(lambda p: p.prefix_id is not None) == pytest.approx(0.25, abs=0.005)
    assert share(lambda p: p.logprobs) == pytest.approx(0.1, abs=0.005)
    assert share(lambda p: p.near_limit) == pytest.approx(0.05, abs=0.005)
    assert all(p.stream for p in plan if p.cancel_after is not None)
    assert all(p.max_tokens > p.cancel_after for p in plan if p.cancel_after is not None)
    assert {p.prefix_id for p in plan if p.prefix_id is not None} == {0, 1, 2, 3}

    groups = {}
    for p in plan:
        if p.repeat_group is not None:
            groups.setdefault(p.repeat_group, []).append(p)
    assert sorted(groups) == list(range(8)) and all(len(g) == 4 for g in groups.values())
    for members in groups.values():  # identical requests at temperature 0, spread over the run
        assert len({(m.endpoint, m.stream, m.prompt_seed, m.body_words, m.max_tokens) for m in members}) == 1
        assert all(m.temperature == 0.0 and m.cancel_after is None and m.prefix_id is None for m in members)
        assert len({soak.prompt_text(m, cfg.seed) for m in members}) == 1
    assert max(max(p.index for p in g) - min(p.index for p in g) for g in groups.values()) > 100

    mt_cap, prefix_tokens, _ = soak.plan_limits(cfg)
    assert max(p.max_tokens for p in plan) <= mt_cap and min(p.max_tokens for p in plan) >= 1
    assert len({p.max_tokens for p in plan}) > 50 and {0.0, 0.7, 1.0} <= {p.temperature for p in plan}
    for p in plan:  # lengths: within the context with max_tokens, from a few tokens to near the limit
        used = (p.body_words + p.prefix_words) * cfg.tokens_per_word + soak.OVERHEAD_TOKENS[p.endpoint]
        assert used + p.max_tokens <= cfg.max_model_len
    tokens = sorted(p.est_prompt_tokens - soak.OVERHEAD_TOKENS[p.endpoint] for p in plan)
    assert tokens[0] <= 10 and tokens[-1] >= 0.85 * (cfg.max_model_len - mt_cap)
    near = [p for p in plan if p.near_limit]
    assert all(p.est_prompt_tokens + p.max_tokens >= 0.85 * cfg.max_model_len for p in near)
    # prompts: the prefix is shared text, bodies differ
    pre = [p for p in plan if p.prefix_id == 2][:2]
    a, b = (soak.prompt_text(p, cfg.seed) for p in pre)
    head = soak.prefix_text(cfg.seed, 2, pre[0].prefix_words)
    assert a.startswith(head) and b.startswith(head) and a != b and len(head.split()) > 0.9 * prefix_tokens / 1.2


def test_plan_edge_cases(soak):
    small = soak.make_plan(soak.PlanConfig(requests=5, repeat_groups=8, repeat_size=4, max_model_len=256))
    assert sum(p.repeat_group is not None for p in small) == 4  # one group fits
    none = soak.make_plan(soak.PlanConfig(requests=50, repeat_size=1, cancel_fraction=0, num_prefixes=0))
    assert all(p.repeat_group is None and p.cancel_after is None and p.prefix_id is None for p in none)
    only_chat = soak.make_plan(soak.PlanConfig(requests=50, chat_fraction=1.0, stream_fraction=1.0, repeat_groups=0))
    assert all(p.endpoint == "chat" and p.stream for p in only_chat)
    item = small[0]
    body = soak.request_body(item, "m", "hi")
    assert body["model"] == "m" and body["max_tokens"] == item.max_tokens


# ------------------------------------------------------------------------------------------------------------------
# Loopback check, arguments


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:8000/",
                                 "https://127.3.4.5", "http://LOCALHOST"])
def test_loopback_targets_accepted(soak, url):
    base = soak.check_target(url, allow_remote=False)
    assert not base.endswith("/") and not base.endswith("/v1")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://[2001:db8::1]:80",
                                 "http://localhost.example.com"])
def test_remote_targets_refused_unless_allowed(soak, url, capsys):
    with pytest.raises(ValueError, match="--allow-remote"):
        soak.check_target(url, allow_remote=False)
    assert soak.check_target(url, allow_remote=True).startswith("http")
    with pytest.raises(SystemExit) as e:
        soak.parse_args(["--url", url])
    assert e.value.code == 2 and "--allow-remote" in capsys.readouterr().err
    assert soak.parse_args(["--url", url, "--allow-remote"]).base.startswith("http")


def test_argument_errors_name_the_valid_range(soak, capsys):
    for argv, needle in ((["--cancel-fraction", "1.5"], "from 0 to 1"),
                         (["--stream-fraction", "0.05"], "exceeds --stream-fraction"),
                         (["--concurrency", "0"], "positive integer"),
                         (["--max-model-len", "100"], "at least 256"),
                         (["--url", "ftp://127.0.0.1"], "http, https"),
                         (["--max-errors", "-1"], "integer >= 0")):
        with pytest.raises(SystemExit):
            soak.parse_args(argv)
        assert needle in capsys.readouterr().err, argv
    args = soak.parse_args([])
    assert (args.requests, args.concurrency, args.cancel_fraction, args.base) == (1000, 200, 0.1,
                                                                                  "http://127.0.0.1:8000")


# ------------------------------------------------------------------------------------------------------------------
# Parsers


def test_sse_parsing(soak):
    text = ('data: {"a": 1}\n\n: keep-alive comment\n\ndata: {"b":\r\ndata: 2}\r\n\r\nevent: x\nid: 3\n'
            "data:no-space\n\ndata: [DONE]")
    assert soak.parse_sse(text) == ['{"a": 1}', '{"b":\n2}', "no-space", "[DONE]"]
    dec = soak.SSEDecoder()
    assert dec.feed_line("data: x") is None and dec.feed_line("") == "x" and dec.feed_line("") is None
    assert soak.parse_sse("") == []


PROM = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:kv_cache_usage_perc{engine="0",model_name="a,b}c \\"q\\""} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5 1700000000000
vllm:num_requests_running{engine="0"} 7
vllm:num_requests_running{engine="1"} 1
vllm:prefix_cache_hits_total 10
bad line here
process_cpu_seconds_total NaN
"""


def test_prometheus_parsing(soak):
    parsed = soak.parse_prometheus(PROM)
    assert [v for _, v in parsed["vllm:num_preemptions_total"]] == [3.0, 2.0]
    assert parsed["vllm:kv_cache_usage_perc"][0][0] == {"engine": "0", "model_name": 'a,b}c "q"'}
    assert parsed["vllm:kv_cache_usage_perc"][1][1] == 0.5
    assert math.isnan(parsed["process_cpu_seconds_total"][0][1])
    assert "bad" not in parsed
    assert soak.tracked_metrics(parsed) == {"vllm:num_preemptions_total": 5.0, "vllm:kv_cache_usage_perc": 0.5,
                                            "vllm:num_requests_running": 8.0, "vllm:prefix_cache_hits_total": 10.0}


def test_metrics_summary_reports_absent_metrics(soak):
    before = {"vllm:num_preemptions_total": 1.0, "vllm:gpu_cache_usage_perc": 0.1}
    samples = [dict(t=1.0, values={"vllm:num_preemptions_total": 2.0, "vllm:gpu_cache_usage_perc": 0.9,
                                   "vllm:num_requests_running": 12.0})]
    after = {"vllm:num_preemptions_total": 4.0, "vllm:gpu_cache_usage_perc": 0.0, "vllm:num_requests_running": 0.0}
    m = soak.summarize_metrics(before, after, samples, None)
    assert m["available"] and m["samples"] == 1
    assert m["preemptions"]["delta"] == 3.0 and m["preemptions"]["name"] == "vllm:num_preemptions_total"
    assert m["kv_cache_usage"]["peak"] == 0.9 and m["kv_cache_usage"]["name"] == "vllm:gpu_cache_usage_perc"
    assert m["requests_running"]["peak"] == 12.0 and m["requests_running"]["before"] is None
    assert m["requests_waiting"] == dict(present=False, label="requests waiting",
                                         names_tried=["vllm:num_requests_waiting"])
    assert m["prefix_cache_hit_rate"] is None
    off = soak.summarize_metrics(None, None, [], "GET /metrics: HTTP 404")
    assert not off["available"] and not off["preemptions"]["present"]


def test_logprob_values(soak):
    comp = {"tokens": ["a", "b"], "token_logprobs": [-0.1, None], "top_logprobs": [{"a": -0.1, "c": -2.0}, None]}
    assert soak.logprob_values(comp) == [-0.1, -0.1, -2.0]
    chat = {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": float("-inf")}]}]}
    values = soak.logprob_values(chat)
    assert values[0] == -0.5 and math.isinf(values[1]) and not soak._is_finite(values[1])
    assert soak.logprob_values(None) == []


# ------------------------------------------------------------------------------------------------------------------
# Report and markdown on synthetic results


def _result(i, outcome="ok", **kw):
    base = dict(index=i, endpoint="chat", stream=False, planned_cancel=None, repeat_group=None, logprobs=False,
                outcome=outcome, status=200, error=None, ttft_s=None, latency_s=1.0, chunks=0, output_tokens=10,
                tokens_source="usage", output_chars=5, logprobs_returned=False, logprob_values=0,
                nonfinite_logprobs=0, cancel_missed=False)
    return {**base, **kw}


def test_report_and_markdown_on_synthetic_results(soak):
    plan = soak.make_plan(soak.PlanConfig(requests=12, repeat_groups=1, repeat_size=3, max_model_len=1024))
    results = [_result(0, latency_s=0.5), _result(1, latency_s=1.5, output_chars=0),
               _result(2, "cancelled", stream=True, ttft_s=0.2, planned_cancel=3, chunks=3, output_tokens=3,
                       tokens_source="chunks"),
               _result(3, "http_error", status=500, error="HTTP 500: boom", output_tokens=None),
               _result(4, "http_error", status=429, error="HTTP 429: slow down", output_tokens=None),
               _result(5, "protocol_error", error="invalid JSON", output_tokens=None),
               _result(6, "timeout", error="no complete answer within 5 s", output_tokens=None),
               _result(7, logprobs=True, logprobs_returned=True, logprob_values=8, nonfinite_logprobs=1),
               _result(8, repeat_group=0, text="same"), _result(9, repeat_group=0, text="same"),
               _result(10, repeat_group=0, text="sane"), _result(11, "not_started")]
    metrics = soak.summarize_metrics({"vllm:num_preemptions": 0.0}, {"vllm:num_preemptions": 2.0}, [], None)
    meta = dict(date="2026-01-01T00:00:00+00:00", command="scripts/soak.py",
                target=dict(url="http://127.0.0.1:8000", model="m", max_model_len=1024,
                            max_model_len_source="GET /v1/models", tokens_per_word=1.0,
                            tokens_per_word_source="POST /tokenize"),
                settings=dict(concurrency=4, seed=0))
    run = dict(wall_s=2.0, duration_limit_hit=True, started=11)
    report = soak.build_report(meta, plan, results, run, metrics, max_errors=0)
    oc = report["outcomes"]
    assert (oc["ok"], oc["cancelled"], oc["http_error"], oc["protocol_error"], oc["timeout"], oc["not_started"]) == (
        6, 1, 2, 1, 1, 1)
    assert oc["http_error_by_status"] == {"429": 1, "500": 1}
    assert set(report["errors"]["by_kind"]) == {"http_500", "http_429", "protocol_error", "timeout"}
    assert report["errors"]["by_kind"]["http_500"]["examples"][0]["message"] == "HTTP 500: boom"
    assert report["empty_outputs"] == dict(count=1, indices=[1])
    assert report["logprobs"]["requests_with_nonfinite"] == 1 and report["logprobs"]["values_checked"] == 8
    assert report["repeats"] == dict(report["repeats"], groups=1, compared=2, agreeing=1, rate=0.5)
    assert report["repeats"]["disagreeing_groups"][0]["first_difference_at_char"] == 2
    assert report["latency"]["ttft_s"]["n"] == 1 and report["latency"]["total_s"]["n"] == 6
    assert report["throughput"]["output_tokens"] == 6 * 10 + 3 and report["throughput"]["output_tokens_per_s"] == 31.5
    assert report["verdict"] == dict(counted_errors=5, max_errors=0, passed=False, exit_status=1)
    assert soak.exit_status(report) == 1 and soak.exit_status(report, max_errors=5) == 0
    assert report["server_metrics"]["preemptions"]["delta"] == 2.0
    assert not report["server_metrics"]["kv_cache_usage"]["present"]
    json.dumps(report, allow_nan=False)

    md = soak.render_markdown(report)
    for needle in ("**FAIL**", "| HTTP 500 | 1 |", "| HTTP 429 | 1 |", "| protocol/JSON error | 1 |",
                   "| not started (duration limit) | 1 |", "duration limit reached", "`HTTP 500: boom`",
                   "empty outputs (completed requests with no text): 1", "1 non-finite values in 1 requests",
                   "1 of 2 repeats identical", "| preemptions | vllm:num_preemptions | 0 | 2 | +2 |",
                   "| KV-cache usage (1.0 = full) | absent (", "| time to first token (streams) | 1 | 0.2 |"):
        assert needle in md, needle


def test_percentiles(soak):
    p = soak.percentiles([float(x) for x in range(1, 101)])
    assert (p["n"], p["p50"], p["p90"], p["p99"], p["max"]) == (100, 50.5, 90.1, 99.01, 100.0)
    assert soak.percentiles([]) == dict(n=0, p50=None, p90=None, p99=None, mean=None, max=None)


# ------------------------------------------------------------------------------------------------------------------
# End to end against a small OpenAI-compatible server


MAX_MODEL_LEN = 512


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog (5) resets connections when the client opens many at once

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.lock = threading.Lock()
        self.arrived = self.running = self.peak = 0
        self.fail_500, self.fail_json, self.hang, self.nan_logprobs = set(), set(), set(), set()
        self.stream_error, self.no_done = set(), set()


def answer_words(prompt: str, n: int) -> list[str]:
    h = hashlib.sha256(prompt.encode()).hexdigest()
    return [f" w{h[(2 * k) % 64:(2 * k) % 64 + 2]}{k}" for k in range(n)]


class FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code, body: bytes, ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        srv = self.server
        if self.path == "/v1/models":
            doc = {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": MAX_MODEL_LEN}]}
            self._send(200, json.dumps(doc).encode())
        elif self.path == "/metrics":
            with srv.lock:
                text = ("# TYPE vllm:num_preemptions counter\n"
                        f'vllm:num_preemptions_total{{engine="0",model_name="fake-model"}} {float(srv.arrived)}\n'
                        f'vllm:num_preemptions_created{{engine="0",model_name="fake-model"}} 1.7e9\n'
                        f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake-model"}} {srv.running / 8}\n'
                        f'vllm:num_requests_running{{engine="0",model_name="fake-model"}} {float(srv.running)}\n')
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._send(200, json.dumps({"count": len(body["prompt"].split()) + 1}).encode())
            return
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._send(404, b'{"detail": "Not Found"}')
            return
        with srv.lock:
            srv.arrived += 1
            srv.running += 1
            srv.peak = max(srv.peak, srv.running)
        try:
            self._generate(srv, body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cancelled or gave up
        finally:
            with srv.lock:
                srv.running -= 1

    def _generate(self, srv, body):
        assert self.headers.get("Authorization") == "Bearer test-key"
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        time.sleep(0.01)
        if prompt in srv.fail_500:
            self._send(500, b'{"error": {"message": "injected failure", "type": "InternalServerError", "code": 500}}')
            return
        if prompt in srv.fail_json:
            self._send(200, b'{"choices": [{"text": "trunc')
            return
        if prompt in srv.hang:
            time.sleep(1.5)
        words = answer_words(prompt, body["max_tokens"])
        lp_value = float("nan") if prompt in srv.nan_logprobs else -0.25
        want_lp = bool(body.get("logprobs"))

        def logprobs(ws):
            if not want_lp:
                return None
            if chat:
                return {"content": [{"token": w, "logprob": lp_value, "top_logprobs": [{"token": w, "logprob": -0.25}]}
                                    for w in ws]}
            return {"tokens": ws, "token_logprobs": [lp_value] * len(ws), "top_logprobs": [{w: -0.25} for w in ws]}

        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words),
                 "total_tokens": len(prompt.split()) + len(words)}
        if not body.get("stream"):
            text = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs(words)}
                      if chat else {"index": 0, "text": text, "logprobs": logprobs(words)})
            self._send(200, json.dumps({"id": "x", "choices": [choice], "usage": usage}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}}] if chat else []
        for w in words:
            chunks.append({"index": 0, "delta": {"content": w}, "logprobs": logprobs([w])} if chat
                          else {"index": 0, "text": w, "logprobs": logprobs([w])})
        for k, c in enumerate(chunks):
            if k == 2 and prompt in srv.stream_error:  # vLLM reports an engine error inside the stream
                self.wfile.write(b'data: {"error": {"message": "injected engine error", "code": 500}}\n\n')
                return
            self.wfile.write(f"data: {json.dumps({'id': 'x', 'choices': [c]})}\n\n".encode())
            self.wfile.flush()
        if prompt in srv.no_done:
            return
        if (body.get("stream_options") or {}).get("include_usage"):
            self.wfile.write(f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture()
def server():
    srv = FakeServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_end_to_end_against_a_local_server(soak, server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    out = tmp_path / "soak-test"
    argv = ["--url", f"http://127.0.0.1:{server.server_address[1]}", "--requests", "60", "--concurrency", "8",
            "--seed", "3", "--max-tokens", "24", "--timeout", "1.0", "--metrics-interval", "0.1",
                    "--repeat-groups", "4", "--repeat-size", "3", "--logprobs-fraction", "0.2", "--no-progress",
            "--out", str(out)]
    # the runner's plan, computed here: its max_model_len comes from /v1/models, 1 token per word from /tokenize
    plan = soak.make_plan(soak.plan_config_from_args(soak.parse_args(argv), MAX_MODEL_LEN, 1.0))
    plain = [p for p in plan if p.repeat_group is None and p.cancel_after is None and not p.stream]
    with_lp = [p for p in plain if p.logprobs]
    without_lp = [p for p in plain if not p.logprobs]
    streams = [p for p in plan if p.repeat_group is None and p.cancel_after is None and p.stream and p.max_tokens > 3]
    assert len(with_lp) >= 1 and len(without_lp) >= 3 and len(streams) >= 2
    prompt = {p.index: soak.prompt_text(p, 3) for p in plan}
    server.fail_500.add(prompt[without_lp[0].index])
    server.fail_json.add(prompt[without_lp[1].index])
    server.hang.add(prompt[without_lp[2].index])
    server.nan_logprobs.add(prompt[with_lp[0].index])
    server.stream_error.add(prompt[streams[0].index])
    server.no_done.add(prompt[streams[1].index])

    t0 = time.perf_counter()
    assert soak.main(argv) == 1
    assert time.perf_counter() - t0 < 30
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# Soak: fake-model at http://127.0.0.1:")
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 60 and "text" not in json.loads(lines[0])

    cancels = sum(p.cancel_after is not None for p in plan)
    oc = report["outcomes"]
    assert report["plan"]["sha256"] == soak.plan_digest(plan)
    assert report["target"]["tokens_per_word"] == 1.0 and report["target"]["max_model_len"] == MAX_MODEL_LEN
    assert (oc["ok"], oc["cancelled"], oc["http_error"], oc["protocol_error"], oc["stream_error"], oc["timeout"]) == (
        60 - cancels - 5, cancels, 1, 2, 1, 1)
    assert oc["http_error_by_status"] == {"500": 1} and oc["connection_error"] == oc["not_started"] == 0
    assert "injected failure" in report["errors"]["by_kind"]["http_500"]["examples"][0]["message"]
    messages = sorted(e["message"] for e in report["errors"]["by_kind"]["protocol_error"]["examples"])
    assert messages[0].startswith("invalid JSON") and messages[1].startswith("stream ended without data: [DONE]")
    assert "injected engine error" in report["errors"]["by_kind"]["stream_error"]["examples"][0]["message"]
    assert report["logprobs"]["requests_with_nonfinite"] == 1
    assert report["logprobs"]["nonfinite_indices"] == [with_lp[0].index]
    assert report["logprobs"]["missing"] == 0 and report["logprobs"]["values_checked"] > 0
    assert report["empty_outputs"]["count"] == 0 and report["cancel_missed"] == 0
    assert report["repeats"]["groups"] == 4 and report["repeats"]["compared"] == 8
    assert report["repeats"]["rate"] == 1.0
    assert report["verdict"] == dict(counted_errors=6, max_errors=0, passed=False, exit_status=1)
    assert soak.exit_status(report, max_errors=6) == 0
    assert report["latency"]["ttft_s"]["n"] > 0 and report["latency"]["total_s"]["p50"] > 0
    assert report["throughput"]["output_tokens"] > 0 and report["throughput"]["output_tokens_per_s"] > 0
    m = report["server_metrics"]
    assert m["available"] and m["samples"] >= 1
    assert m["preemptions"]["delta"] == 60.0  # the fake counts every request as a "preemption"
    assert m["requests_running"]["peak"] >= 1 and 0 < m["kv_cache_usage"]["peak"] <= 1
    assert m["requests_waiting"]["present"] is False
    assert "absent" in (out / "report.md").read_text()


def test_duration_limit_and_unreachable_server(soak, server, tmp_path, capsys):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    out = tmp_path / "d0"
    code = soak.main(["--url", url, "--requests", "20", "--duration-limit", "0", "--no-progress",
                      "--api-key", "test-key", "--tokens-per-word", "1", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert "test-key" not in (out / "report.json").read_text() and "--api-key ***" in report["command"]
    assert soak.redact_argv(["--api-key=abc", "--seed", "1"]) == ["--api-key=***", "--seed", "1"]
    assert code == 0 and report["outcomes"]["not_started"] == 20 and report["run"]["duration_limit_hit"]
    assert report["target"]["tokens_per_word_source"] == "--tokens-per-word"
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    assert soak.main(["--url", f"http://127.0.0.1:{port}", "--no-progress", "--out", str(tmp_path / "x")]) == 2
    assert "cannot reach" in capsys.readouterr().err

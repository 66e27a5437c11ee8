# SPDX-License-Identifier: Apache-2.0
"""``tq eval-ppl`` on a tiny random Llama saved as a local Hugging Face folder, with a word-level tokenizer."""

import argparse
import json
import math
import warnings
from importlib import resources

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from turboquant_core.integrations.perplexity import (  # noqa: E402
    CacheScore,
    add_eval_ppl_arguments,
    evaluate_perplexity,
    format_table,
    parse_prefill_chunks,
    parse_presets,
    read_text,
    run_eval_ppl,
    token_windows,
)
from turboquant_core.integrations.transformers_cache import cache_kwargs  # noqa: E402

TEXT = " ".join(f"w{(7 * i * i + 3 * i) % 53}" for i in range(400))


def _tokenizer(bos: bool):
    words = sorted(set(TEXT.split()))
    vocab = {"[UNK]": 0, "[BOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    if bos:
        tk.post_processor = tokenizers.processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="[BOS]")


def _model(vocab_size: int):
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=None, pad_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return m


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = _tokenizer(bos=True)
    _model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_token_windows_with_and_without_bos():
    plain = token_windows(_tokenizer(bos=False), TEXT, window=50, max_windows=3)
    assert plain.shape == (3, 50) and (plain != 1).all()
    with_bos = token_windows(_tokenizer(bos=True), TEXT, window=50)
    assert with_bos.shape == (400 // 49, 50) and (with_bos[:, 0] == 1).all()
    # Consecutive, non-overlapping pieces of the text.
    assert torch.equal(with_bos[1, 1:], torch.tensor(_tokenizer(bos=False)(TEXT)["input_ids"][49:98]))
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(_tokenizer(bos=False), "w1 w2", window=50)


def test_scores_match_model_loss_and_order_by_bits():
    tok = _tokenizer(bos=True)
    model = _model(len(tok))
    windows = token_windows(tok, TEXT, window=40, max_windows=2)
    presets = ["turboquant_4bit_nc", "turboquant_2bit_nc"]
    baseline, scores = evaluate_perplexity(model, windows, presets, progress=False)
    with torch.no_grad():
        losses = [float(model(w[None], labels=w[None], **cache_kwargs(model, DynamicCache())).loss) for w in windows]
    assert baseline.ppl == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)
    assert baseline.tokens == 2 * 39
    four, two = scores
    assert 0 < four.kl_per_token < two.kl_per_token
    assert four.top1_agreement >= two.top1_agreement and 0 < two.top1_agreement <= 1
    assert abs(four.delta_ppl_pct) < abs(two.delta_ppl_pct)
    assert four.cache_bytes_per_window == 2 * 40 * 68  # 2 layers x 40 tokens x 1 head x 68 B (d=64, 4-bit)


def test_all_layers_skipped_is_the_baseline():
    tok = _tokenizer(bos=False)
    model = _model(len(tok))
    windows = token_windows(tok, TEXT, window=32, max_windows=1)
    baseline, (score,) = evaluate_perplexity(model, windows, ["turboquant_2bit_nc"], skip_layers=[0, 1],
                                             progress=False)
    assert score.ppl == pytest.approx(baseline.ppl, rel=1e-6)
    assert score.kl_per_token == pytest.approx(0.0, abs=1e-6) and score.top1_agreement == 1.0


def _decode_mode_kl(model, windows, preset, first_row):
    """Mean KL(baseline || preset) of one decode-faithful forward per window, over rows >= ``first_row``."""
    from turboquant_core.integrations.transformers_cache import TurboQuantCache

    kl = rows = 0
    with torch.no_grad():
        for w in windows:
            ref = torch.log_softmax(model(w[None], **cache_kwargs(model, DynamicCache())).logits[0, first_row:-1], -1)
            got = model(w[None], **cache_kwargs(model, TurboQuantCache(model.config, preset=preset,
                                                                 fresh_full_precision=False))).logits
            got = torch.log_softmax(got[0, first_row:-1], -1)
            kl += float((ref.exp() * (ref - got)).sum())
            rows += ref.shape[0]
    return kl / rows


def test_prefill_chunk_scores_positions_after_the_first_chunk():
    tok = _tokenizer(bos=True)
    model = _model(len(tok))
    window, chunk = 40, 16
    windows = token_windows(tok, TEXT, window=window, max_windows=2)
    presets = ["turboquant_2bit_nc", "turboquant_k8v4"]
    baseline, scores = evaluate_perplexity(model, windows, presets, prefill_chunk=chunk, progress=False)
    # Query positions chunk .. window - 2 predict targets chunk + 1 .. window - 1.
    assert baseline.tokens == 2 * (window - 1 - chunk) == 46
    with torch.no_grad():
        nll = [-torch.log_softmax(model(w[None]).logits[0, chunk:-1], -1).gather(-1, w[chunk + 1 :, None]).mean()
               for w in windows]
    assert baseline.ppl == pytest.approx(math.exp(float(sum(nll)) / 2), rel=1e-5)
    two, k8v4 = scores
    for score in scores:
        assert score.tokens == 46 and len(score.window_ppl) == 2
        assert math.isfinite(score.ppl) and 0 < score.kl_per_token < math.inf
        # Fresh chunk in full precision: closer to the baseline than decode mode on the same positions.
        assert score.kl_per_token < _decode_mode_kl(model, windows, score.name, chunk)
    assert k8v4.kl_per_token < two.kl_per_token


def test_prefill_chunk_with_everything_full_precision_is_the_baseline():
    """Chunks fed through the cache with nothing compressed == one full-precision forward (positions, masks)."""
    tok = _tokenizer(bos=False)
    model = _model(len(tok))
    windows = token_windows(tok, TEXT, window=30, max_windows=2)
    baseline, (score,) = evaluate_perplexity(model, windows, ["turboquant_2bit_nc"], residual_tokens=30,
                                             prefill_chunk=7, progress=False)
    assert baseline.tokens == 2 * (30 - 1 - 7)
    assert score.ppl == pytest.approx(baseline.ppl, rel=1e-5)
    assert score.kl_per_token == pytest.approx(0.0, abs=1e-6) and score.top1_agreement == 1.0


@pytest.mark.parametrize("chunk", [-1, 39, 40, 100])
def test_bad_prefill_chunk_names_the_valid_range(chunk):
    tok = _tokenizer(bos=False)
    windows = token_windows(tok, TEXT, window=40, max_windows=1)
    with pytest.raises(ValueError, match=r"0 \(decode mode\) or between 1 and window - 2 = 38.*got " + str(chunk)):
        evaluate_perplexity(_model(len(tok)), windows, ["turboquant_4bit_nc"], prefill_chunk=chunk, progress=False)


def test_largest_prefill_chunk_scores_the_last_token():
    tok = _tokenizer(bos=False)
    windows = token_windows(tok, TEXT, window=12, max_windows=3)
    baseline, (score,) = evaluate_perplexity(_model(len(tok)), windows, ["turboquant_4bit_nc"], prefill_chunk=10,
                                             progress=False)
    assert baseline.tokens == score.tokens == 3


def _args(*argv):
    return add_eval_ppl_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def _cli_json(tiny_model_dir, tmp_path, *argv, name="ppl.json"):
    """Run ``tq eval-ppl`` on the tiny model and the test text; (exit code, the JSON report)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "res" / name
    rc = run_eval_ppl(_args("--model", str(tiny_model_dir), "--text", str(text), "--device", "cpu",
                            "--json", str(out), "--no-progress", *argv))
    return rc, json.loads(out.read_text()) if rc == 0 else None


def test_cli_writes_table_and_json(tiny_model_dir, tmp_path, capsys):
    rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc,turboquant_k8v4",
                           "--window", "48", "--windows", "3", "--skip-layers", "-1", "--prefill-chunk", "0")
    assert rc == 0
    table = capsys.readouterr().out
    assert "turboquant_k3v4_nc" in table and "turboquant_k8v4" in table and "DynamicCache" in table
    assert table.splitlines()[0].startswith("--prefill-chunk 0, decode:")
    assert report["windows"] == 3 and report["window"] == 48
    assert report["bos_prepended"] is True and report["skip_layers"] == [-1]
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    assert report["transformers"] == transformers.__version__ and report["date"] and report["command"]
    assert report["load_seconds"] >= 0
    # Per-regime fields live only under "regimes".
    for old_key in ("prefill_chunk", "attention_mode", "tokens_scored", "baseline", "presets", "eval_seconds",
                    "eval_cpu_seconds"):
        assert old_key not in report
    (regime,) = report["regimes"]
    assert regime["prefill_chunk"] == 0 and regime["attention_mode"].startswith("decode:")
    assert regime["tokens_scored"] == regime["baseline"]["tokens"] == 3 * 47
    assert regime["eval_seconds"] >= 0 and regime["eval_cpu_seconds"] >= 0
    assert [p["name"] for p in regime["presets"]] == ["turboquant_k3v4_nc", "turboquant_k8v4"]
    for p in regime["presets"]:
        assert math.isfinite(p["ppl"]) and p["kl_per_token"] > 0 and len(p["window_ppl"]) == 3


def test_cli_prefill_chunk(tiny_model_dir, tmp_path, capsys):
    rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc", "--window", "48",
                           "--windows", "2", "--prefill-chunk", "16")
    assert rc == 0
    captured = capsys.readouterr()
    assert "chunked prefill" in captured.err and "decode" not in captured.err
    assert captured.out.splitlines()[0].startswith("--prefill-chunk 16, chunked prefill:")
    (regime,) = report["regimes"]
    assert regime["prefill_chunk"] == 16 and regime["attention_mode"].startswith("chunked prefill:")
    assert regime["tokens_scored"] == 2 * (47 - 16) and regime["presets"][0]["tokens"] == 2 * 31


def test_cli_two_regimes_in_the_order_given(tiny_model_dir, tmp_path, capsys):
    """A list runs one regime per entry on the one loaded model, in order: a heading and a table each."""
    rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc,turboquant_k8v4",
                           "--window", "48", "--windows", "2", "--prefill-chunk", "16,0")
    assert rc == 0
    captured = capsys.readouterr()
    headings = [line for line in captured.out.splitlines() if line.startswith("--prefill-chunk ")]
    assert headings == ["--prefill-chunk 16, chunked prefill: fresh tokens in full precision, earlier chunks "
                        "compressed (as served; targets 17..47 of each window scored)",
                        "--prefill-chunk 0, decode: every position attends to quantized K/V, its own included "
                        "(the strict bound; targets 1..47 of each window scored)"]
    assert captured.out.count("DynamicCache") == 2 and captured.out.count("turboquant_k8v4") == 2
    info = [line for line in captured.err.splitlines() if line.startswith("model ")]  # one per regime, in order
    assert len(info) == 2 and "chunked prefill" in info[0] and "decode" in info[1]
    chunked, decode = report["regimes"]
    assert (chunked["prefill_chunk"], decode["prefill_chunk"]) == (16, 0)
    assert chunked["attention_mode"].startswith("chunked prefill:") and decode["attention_mode"].startswith("decode:")
    assert chunked["tokens_scored"] == 2 * 31 and decode["tokens_scored"] == 2 * 47
    for regime in report["regimes"]:
        assert [p["name"] for p in regime["presets"]] == ["turboquant_k3v4_nc", "turboquant_k8v4"]
        assert regime["baseline"]["tokens"] == regime["tokens_scored"]
    # Fresh chunks in full precision are closer to the baseline than the strict bound.
    assert chunked["presets"][0]["kl_per_token"] < decode["presets"][0]["kl_per_token"]


def test_cli_default_is_serving_then_strict(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Default --prefill-chunk 256,0: too long for 48-token windows (the error names the valid range); with
    windows of 258 the regimes run in the order 256, 0."""
    assert _args().prefill_chunk == "256,0"
    rc, _ = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc", "--window", "48")
    assert rc == 2
    err = capsys.readouterr().err
    assert "0 (decode mode) or between 1 and window - 2 = 46" in err and "got 256" in err
    assert "needs --window >= 258" in err

    from turboquant_core.integrations import perplexity

    chunks_run = []
    real = perplexity.evaluate_perplexity

    def recording(*args, prefill_chunk, **kwargs):
        chunks_run.append(prefill_chunk)
        return real(*args, prefill_chunk=prefill_chunk, **kwargs)

    # The test text has 400 words: one window of 258 tokens, scored once per regime.
    monkeypatch.setattr(perplexity, "evaluate_perplexity", recording)
    rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_4bit_nc", "--window", "258",
                           "--windows", "1")
    assert rc == 0 and chunks_run == [256, 0]
    assert [r["prefill_chunk"] for r in report["regimes"]] == [256, 0]
    assert [r["tokens_scored"] for r in report["regimes"]] == [1, 257]


@pytest.mark.parametrize(("spec", "problem"), [
    ("16,16", "lists 16 twice"),
    ("0,16,0", "lists 0 twice"),
    ("16,,0", "empty entry"),
    ("16,", "empty entry"),
    ("", "empty entry"),
    ("16;0", "'16;0' is not an integer"),
    ("sixteen", "'sixteen' is not an integer"),
    ("16,47", "got 47"),
])
def test_cli_bad_prefill_chunk_list_exits_2(tiny_model_dir, spec, problem, capsys):
    """Rejected before the model is loaded (a bad --model would otherwise be the error)."""
    assert run_eval_ppl(_args("--model", "no-such-model", "--window", "48", "--prefill-chunk", spec)) == 2
    err = capsys.readouterr().err
    assert problem in err and "0 (decode mode) or between 1 and window - 2 = 46" in err
    assert "smollm2" not in err


def test_parse_prefill_chunks():
    assert parse_prefill_chunks("256,0", 512) == [256, 0]
    assert parse_prefill_chunks(" 0 , 7 ", 12) == [0, 7]
    assert parse_prefill_chunks("0", 2) == [0]
    with pytest.raises(ValueError, match="window - 2 = 10.*got 11"):
        parse_prefill_chunks("0,11", 12)


def test_cli_key_centering(tiny_model_dir, tmp_path):
    """Key centering is on by default (as the patched vLLM stores keys), off with --no-key-centering; on
    48-token windows (16 plain, 32 centred) the 3-bit-key scores move, the fp8-key preset runs uncentred and
    unchanged, and the report says so."""
    reports = {}
    for flags in ((), ("--no-key-centering",), ("--key-centering",)):
        rc, reports[flags] = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc,turboquant_k8v4",
                                       "--window", "48", "--windows", "2", "--prefill-chunk", "0", *flags,
                                       name=f"ppl{len(reports)}.json")
        assert rc == 0
    default, off, on = reports[()], reports[("--no-key-centering",)], reports[("--key-centering",)]
    assert default["key_centering"] is True and on["key_centering"] is True and off["key_centering"] is False
    (k3v4, k8v4), (k3v4_off, k8v4_off) = default["regimes"][0]["presets"], off["regimes"][0]["presets"]
    assert on["regimes"][0]["presets"][0]["kl_per_token"] == k3v4["kl_per_token"]
    assert (k3v4["key_centered"], k8v4["key_centered"]) == (True, False)
    assert not k3v4_off["key_centered"] and not k8v4_off["key_centered"]
    assert k3v4["kl_per_token"] != k3v4_off["kl_per_token"] and math.isfinite(k3v4["kl_per_token"])
    assert k8v4["kl_per_token"] == k8v4_off["kl_per_token"] and k8v4["ppl"] == k8v4_off["ppl"]


def test_cli_key_centering_without_rope_runs_uncentred(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A model without a rotary embedding is evaluated uncentred, as the patched vLLM serves it, not refused."""
    from turboquant_core.integrations import transformers_cache

    def no_rope(model, page=16):
        raise ValueError(f"{type(model).__name__} has no rotary embedding with inv_freq: key centering needs RoPE")

    monkeypatch.setattr(transformers_cache, "key_centering_for_model", no_rope)
    rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_k3v4_nc", "--window", "48",
                           "--windows", "1", "--prefill-chunk", "0")
    assert rc == 0 and "key centering not applied: LlamaForCausalLM has no rotary" in capsys.readouterr().err
    assert report["key_centering"] is False and report["regimes"][0]["presets"][0]["key_centered"] is False


def test_cli_bad_input_is_a_clear_error(tiny_model_dir, capsys):
    assert run_eval_ppl(_args("--model", str(tiny_model_dir), "--presets", "turboquant_5bit")) == 2
    assert "valid formats" in capsys.readouterr().err
    assert run_eval_ppl(_args("--model", "no-such-model", "--presets", "turboquant_4bit_nc",
                              "--prefill-chunk", "0")) == 2
    assert "smollm2-135m-instruct" in capsys.readouterr().err
    for chunk in ("-3", "47"):
        assert run_eval_ppl(_args("--model", str(tiny_model_dir), "--window", "48", "--prefill-chunk", chunk)) == 2
        err = capsys.readouterr().err
        assert "between 1 and window - 2 = 46" in err and "needs --window" not in err


def test_bundled_text_and_presets():
    text, label = read_text(None)
    assert label.startswith("bundled:") and "Robert Boulter" in text and len(text) > 20_000
    licence = resources.files("turboquant_core").joinpath("data", "LICENSE-wikitext2.txt").read_text()
    assert "CC BY-SA" in licence and "Merity" in licence
    assert parse_presets(None)[0] == "turboquant_k8v4" and parse_presets("turboquant_4bit_nc") == ["turboquant_4bit_nc"]


def _table_cells(lines: list[str]) -> list[list[str]]:
    """The cells of a printed table (header, dashes, rows), cut at the column spans the dashes mark; fails if
    any text of any row, the header included, sits outside its column."""
    spans, start = [], None
    for i, ch in enumerate(lines[1] + " "):
        if ch == "-" and start is None:
            start = i
        elif ch != "-" and start is not None:
            spans.append((start, i))
            start = None
    rows = []
    for line in [lines[0], *lines[2:]]:
        gaps = [line[end:nxt] for (_, end), (nxt, _) in zip(spans, spans[1:])]
        assert all(not g.strip() for g in gaps) and len(line) <= spans[-1][1], f"misaligned row: {line!r}"
        rows.append([line[a:b].strip() for a, b in spans])
    return rows


def test_table_columns_line_up_for_long_cells():
    baseline = CacheScore("full precision (DynamicCache)", ppl=12.9542)
    wide = CacheScore("turboquant_3p5bit_nc", "3.5-bit Lloyd-Max +nc", "3.5-bit Lloyd-Max +nc",
                      bytes_per_token_per_head=60, head_dim=64, compression_vs_bf16=4.27, ppl=1234.5678,
                      delta_ppl_pct=9430.1, kl_per_token=0.01089, top1_agreement=1.0)
    fp8 = CacheScore("turboquant_k8v4", "fp8 e4m3 (rotated)", "4-bit Lloyd-Max +nc", bytes_per_token_per_head=98,
                     head_dim=64, compression_vs_bf16=2.61, ppl=12.99, delta_ppl_pct=-0.31, kl_per_token=0.00139,
                     top1_agreement=0.9804)
    lines = format_table(baseline, [wide, fp8]).splitlines()
    assert _table_cells(lines) == [
        ["cache", "K", "V", "bytes/token/head (d=64)", "x bf16", "ppl", "d ppl %", "KL nats", "top-1"],
        ["full precision (DynamicCache)", "full precision", "full precision", "", "", "12.9542", "", "", ""],
        ["turboquant_3p5bit_nc", "3.5-bit Lloyd-Max +nc", "3.5-bit Lloyd-Max +nc", "60", "4.27", "1234.5678",
         "+9430.10", "0.01089", "100.00%"],
        ["turboquant_k8v4", "fp8 e4m3 (rotated)", "4-bit Lloyd-Max +nc", "98", "2.61", "12.9900", "-0.31", "0.00139",
         "98.04%"],
    ]
    # Numbers are right-aligned: they end where their column ends.
    assert lines[4].index("12.9900") + len("12.9900") == lines[3].index("1234.5678") + len("1234.5678")


def test_cli_prints_no_future_warning_and_aligned_tables(tiny_model_dir, tmp_path, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded, also one a library would catch as an error
        rc, report = _cli_json(tiny_model_dir, tmp_path, "--presets", "turboquant_3p5bit_nc,turboquant_k8v4",
                               "--window", "24", "--windows", "1", "--prefill-chunk", "8,0")
    assert rc == 0
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)]
    assert not future
    out = capsys.readouterr().out.splitlines()
    starts = [i for i, line in enumerate(out) if line.startswith("cache ")]
    assert len(starts) == 2  # one table per regime
    for start, regime in zip(starts, report["regimes"]):
        header, baseline, wide, fp8 = _table_cells(out[start : start + 5])
        assert header[3] == "bytes/token/head (d=64)"
        assert baseline[0] == "full precision (DynamicCache)" and baseline[3] == ""
        assert wide[:4] == ["turboquant_3p5bit_nc", "3.5-bit Lloyd-Max +nc", "3.5-bit Lloyd-Max +nc",
                            str(regime["presets"][0]["bytes_per_token_per_head"])]
        assert fp8[0] == "turboquant_k8v4" and regime["presets"][1]["head_dim"] == 64

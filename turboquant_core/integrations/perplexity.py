# SPDX-License-Identifier: Apache-2.0
"""``tq eval-ppl``: perplexity of a model with TurboQuant-compressed K/V against a full-precision cache.

The text is cut into non-overlapping windows of ``--window`` tokens (a leading BOS token is added
when the tokenizer adds one by default). For each window the baseline is one forward over the whole
window with a full-precision ``DynamicCache``; each preset runs in each attention regime listed by
``--prefill-chunk`` (default ``256,0``: the serving regime first, then the strict bound), one table
and one JSON entry per regime, the model loaded once:

- chunked prefill (``--prefill-chunk N``, N > 0): the window is fed in consecutive forwards of N
  tokens to one ``TurboQuantCache(fresh_full_precision=True)``, so the tokens of a chunk attend to
  each other in full precision and to earlier chunks through the compressed cache, as in vLLM serving
  with a TurboQuant KV cache (chunked prefill). Only predictions made at query positions >= N, which
  have at least the first chunk compressed behind them, are scored (targets N + 1 .. window - 1), for
  the baseline too; N = 256 matches the GPU runs under ``eval/``.
- decode (``--prefill-chunk 0``): one forward over the window with a ``TurboQuantCache``, so every
  position attends to the quantized keys and values of itself and all earlier positions (what a
  decode step sees: the strict bound). All positions are scored.

Keys are stored as the patched vLLM stores them by default (key centering, ``--no-key-centering``
turns it off): on full-attention layers of a RoPE model with MSE keys; fp8-key presets such as
``turboquant_k8v4`` store keys as they are, as in vLLM.

Reported per preset, over all scored tokens: perplexity, its change vs the baseline (%), the mean
KL(baseline || preset) of the next-token distributions (nats/token), and top-1 agreement (how often
the preset's argmax equals the baseline's).

Standalone: ``python -m turboquant_core.integrations.perplexity --help``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ..formats import format_names, get_format

BUNDLED_TEXT = "wikitext2_sample.txt"
DEFAULT_WINDOW = 512
DEFAULT_WINDOWS = 8
# Serving regime first (chunks of 256 as in the vLLM runs under eval/), then the strict decode bound.
DEFAULT_PREFILL_CHUNKS = "256,0"
KL_CHUNK_ROWS = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def read_text(path: str | None) -> tuple[str, str]:
    """(text, label): the file at ``path``, or the bundled WikiText-2 excerpt when ``path`` is None."""
    if path is None:
        text = resources.files("turboquant_core").joinpath("data", BUNDLED_TEXT).read_text(encoding="utf-8")
        return text, f"bundled:{BUNDLED_TEXT}"
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--text {path}: no such file")
    return p.read_text(encoding="utf-8"), str(p)


def leading_bos(tokenizer) -> int | None:
    """The BOS id if the tokenizer puts one in front of a text by default, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def token_windows(tokenizer, text: str, window: int, max_windows: int | None = None) -> torch.Tensor:
    """[n, window] token ids: consecutive non-overlapping pieces of ``text`` (BOS first when the tokenizer adds one)."""
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    bos = leading_bos(tokenizer)
    body = window - (bos is not None)
    n = len(ids) // body
    if max_windows is not None:
        if max_windows < 1:
            raise ValueError(f"--windows must be >= 1, got {max_windows}")
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than one window of {window}; "
            "use a smaller --window or a longer --text"
        )
    rows = []
    for i in range(n):
        chunk = ids[i * body : (i + 1) * body]
        rows.append(([bos] if bos is not None else []) + chunk)
    return torch.tensor(rows, dtype=torch.long)


def parse_presets(spec: str | None) -> list[str]:
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(format_names())
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        get_format(name)  # unknown name -> ValueError listing the valid ones
    return names


def parse_layer_list(spec: str | None) -> list[int]:
    if not spec:
        return []
    try:
        return [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--skip-layers expects comma-separated layer indices such as 0,-1; got {spec!r}") from None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available; valid choices: auto, cpu, cuda")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown --device {name!r}; valid choices: auto, cpu, cuda")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown --dtype {name!r}; valid choices: auto, {', '.join(DTYPES)}") from None


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class CacheScore:
    """Scores of one cache configuration over all windows."""

    name: str
    key: str = "full precision"
    value: str = "full precision"
    # Whether keys were stored centred (key centering asked for and the preset's keys are MSE, not fp8).
    key_centered: bool = False
    bytes_per_token_per_head: int | None = None
    head_dim: int | None = None  # the head_dim bytes_per_token_per_head is for
    compression_vs_bf16: float | None = None
    cache_bytes_per_window: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_agree: int = 0
    tokens: int = 0
    window_ppl: list[float] = field(default_factory=list)
    ppl: float = float("nan")
    delta_ppl_pct: float = 0.0
    kl_per_token: float = 0.0
    top1_agreement: float = 1.0

    def finish(self, baseline: CacheScore | None) -> None:
        self.ppl = math.exp(self.nll_sum / self.tokens)
        if baseline is not None:
            self.delta_ppl_pct = 100.0 * (self.ppl / baseline.ppl - 1.0)
            self.kl_per_token = self.kl_sum / self.tokens
            self.top1_agreement = self.top1_agree / self.tokens


def valid_prefill_chunks(window: int) -> str:
    """The valid ``--prefill-chunk`` values for windows of ``window`` tokens, in words."""
    return f"0 (decode mode) or between 1 and window - 2 = {window - 2}"


def check_prefill_chunk(prefill_chunk: int, window: int) -> int:
    """``prefill_chunk`` if valid for windows of ``window`` tokens: 0 (decode) or 1 .. window - 2."""
    if prefill_chunk != 0 and not 1 <= prefill_chunk <= window - 2:
        raise ValueError(
            f"--prefill-chunk must be {valid_prefill_chunks(window)} "
            f"(chunked prefill needs at least one scored position after the first chunk); got {prefill_chunk}"
        )
    return prefill_chunk


def parse_prefill_chunks(spec: str, window: int) -> list[int]:
    """The chunk sizes of ``--prefill-chunk`` (``"256,0"``: one regime per entry, in that order), each
    checked by ``check_prefill_chunk``; empty entries, non-integers and repeats are errors."""
    valid = f"comma-separated chunk sizes, each {valid_prefill_chunks(window)}, each at most once"
    chunks: list[int] = []
    for entry in str(spec).split(","):
        entry = entry.strip()
        if not entry:
            raise ValueError(f"--prefill-chunk {spec!r} has an empty entry; expected {valid}")
        try:
            chunk = int(entry)
        except ValueError:
            raise ValueError(f"--prefill-chunk {spec!r}: {entry!r} is not an integer; expected {valid}") from None
        if chunk in chunks:
            raise ValueError(f"--prefill-chunk {spec!r} lists {chunk} twice; expected {valid}")
        chunks.append(check_prefill_chunk(chunk, window))
    return chunks


def attention_mode(prefill_chunk: int) -> str:
    """How the presets' forwards attend, in words (see module docstring)."""
    if prefill_chunk == 0:
        return "decode: every position attends to quantized K/V, its own included"
    return "chunked prefill: fresh tokens in full precision, earlier chunks compressed"


def regime_heading(prefill_chunk: int, window: int) -> str:
    """One line naming a regime and what it scores, printed above its table."""
    if prefill_chunk == 0:
        scope = f"the strict bound; targets 1..{window - 1} of each window scored"
    else:
        scope = f"as served; targets {prefill_chunk + 1}..{window - 1} of each window scored"
    return f"--prefill-chunk {prefill_chunk}, {attention_mode(prefill_chunk)} ({scope})"


def _kv_bytes(cache) -> int:
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.is_initialized)


@torch.no_grad()
def evaluate_perplexity(model, windows: torch.Tensor, presets: list[str], *, skip_layers=(), residual_tokens: int = 0,
                        prefill_chunk: int = 0, progress: bool = True,
                        key_centering=None) -> tuple[CacheScore, list[CacheScore]]:
    """Baseline and per-preset scores for ``windows`` [n, window] (see module docstring).

    ``prefill_chunk``: 0 scores every position of one decode-faithful forward per window; N > 0 feeds
    each window to the presets in chunks of N tokens (``fresh_full_precision`` cache) and scores, for
    every cache, only the predictions made at query positions N .. window - 2 (targets N + 1 ..
    window - 1). Valid: 0 or 1 .. window - 2. ``key_centering``: tables from
    ``transformers_cache.key_centering_for_model`` (the patched vLLM's key encoding), or None; fp8-key
    presets ignore them (``TurboQuantCache``), recorded per preset as ``key_centered``.
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from .transformers_cache import TurboQuantCache, cache_kwargs

    window = windows.shape[1]
    check_prefill_chunk(prefill_chunk, window)
    # Row q of ``logits[0, :-1]`` is the prediction made at query position q for the token at q + 1.
    # Decode mode scores all rows; chunked prefill the rows q >= N (compressed context behind them).
    first_row = prefill_chunk
    device = next(model.parameters()).device
    d_head = None
    baseline = CacheScore("full precision (DynamicCache)")
    scores = []
    for name in presets:
        f = get_format(name)
        scores.append(CacheScore(name, f.key.describe(), f.value.describe()))
    bar = tqdm(total=len(windows) * (1 + len(presets)), desc="eval-ppl", unit="fwd", disable=not progress)
    for row in windows:
        ids = row.unsqueeze(0).to(device)
        targets = ids[0, first_row + 1 :]
        cache = DynamicCache(config=model.config)
        base_logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[0, first_row:-1].float()
        base_logp = torch.log_softmax(base_logits, dim=-1)
        del base_logits
        baseline.cache_bytes_per_window = _kv_bytes(cache)
        _accumulate(baseline, base_logp, targets)
        base_top1 = base_logp.argmax(dim=-1)
        bar.update(1)
        for score in scores:
            cache = TurboQuantCache(model.config, preset=score.name, skip_layers=skip_layers,
                                    residual_tokens=residual_tokens, fresh_full_precision=prefill_chunk > 0,
                                    key_centering=key_centering)
            if prefill_chunk == 0:
                logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[0, :-1]
            else:
                # One forward per chunk through the same cache; the first chunk's rows are not scored.
                logits = torch.cat([
                    model(input_ids=ids[:, start : start + prefill_chunk], **cache_kwargs(model, cache),
                          use_cache=True).logits[0]
                    for start in range(0, window, prefill_chunk)
                ])[first_row:-1]
            score.cache_bytes_per_window = cache.memory_bytes()
            score.key_centered = cache.key_centering is not None
            d_head = cache.head_dim
            del cache
            # Row chunks: with a 262k vocabulary a full [window, vocab] float32 temporary is ~0.5 GB.
            nll = kl = agree = 0.0
            for rows in torch.split(torch.arange(logits.shape[0], device=logits.device), KL_CHUNK_ROWS):
                logp = torch.log_softmax(logits[rows].float(), dim=-1)
                blp = base_logp[rows]
                nll += float(-logp.gather(-1, targets[rows].unsqueeze(-1)).double().sum())
                kl += float((blp.exp() * (blp - logp)).sum(dim=-1).double().sum())
                agree += int((logp.argmax(dim=-1) == base_top1[rows]).sum())
            score.nll_sum += nll
            score.tokens += targets.numel()
            score.window_ppl.append(math.exp(nll / targets.numel()))
            score.kl_sum += kl
            score.top1_agree += int(agree)
            bar.update(1)
            del logits
    bar.close()
    baseline.finish(None)
    for score in scores:
        score.finish(baseline)
        if d_head is not None:
            f = get_format(score.name)
            score.bytes_per_token_per_head = f.bytes_per_token_per_head(d_head)
            score.head_dim = d_head
            score.compression_vs_bf16 = round(f.compression_vs_bf16(d_head), 3)
    return baseline, scores


def _accumulate(score: CacheScore, logp: torch.Tensor, targets: torch.Tensor) -> None:
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()
    score.nll_sum += float(nll.sum())
    score.tokens += nll.numel()
    score.window_ppl.append(math.exp(float(nll.mean())))


def format_table(baseline: CacheScore, scores: list[CacheScore]) -> str:
    """The results as aligned text: every row, the header included, has the same column widths (wide enough for
    the longest cell), text left-aligned and numbers right-aligned."""
    dims = {s.head_dim for s in scores if s.head_dim is not None}
    per_head = "bytes/token/head" + (f" (d={next(iter(dims))})" if len(dims) == 1 else "")
    header = ["cache", "K", "V", per_head, "x bf16", "ppl", "d ppl %", "KL nats", "top-1"]
    numeric = [False, False, False, True, True, True, True, True, True]
    rows = [[baseline.name, baseline.key, baseline.value, "", "", f"{baseline.ppl:.4f}", "", "", ""]]
    for s in scores:
        nbytes = "-" if s.bytes_per_token_per_head is None else str(s.bytes_per_token_per_head)
        vs_bf16 = "-" if s.compression_vs_bf16 is None else f"{s.compression_vs_bf16:.2f}"
        rows.append([s.name, s.key, s.value, nbytes, vs_bf16, f"{s.ppl:.4f}", f"{s.delta_ppl_pct:+.2f}",
                     f"{s.kl_per_token:.5f}", f"{100 * s.top1_agreement:.2f}%"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_eval_ppl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="smollm2-135m-instruct (default), gemma-3-270m, a local .gguf file "
                        "or a local Hugging Face folder")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file to score (default: the bundled WikiText-2 excerpt)")
    parser.add_argument("--presets", default=None,
                        help=f"comma-separated formats (default: all): {', '.join(format_names())}")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per window (default %(default)s)")
    parser.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                        help="at most this many windows (default %(default)s; 0: all the text has)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--skip-layers", default="",
                        help="comma-separated layer indices kept in full precision, e.g. 0,-1 (default: none)")
    parser.add_argument("--residual-tokens", type=int, default=0,
                        help="most recent tokens per layer kept in full precision (default 0)")
    parser.add_argument("--prefill-chunk", default=DEFAULT_PREFILL_CHUNKS, metavar="N[,N...]",
                        help="attention regimes to run, one table each, in the order given (default "
                        f"{DEFAULT_PREFILL_CHUNKS}: serving, then the strict bound). N > 0: chunked prefill as in vLLM "
                        "serving, each window fed in forwards of N tokens that attend to each other in full precision "
                        "and to earlier chunks compressed; only positions after the first chunk are scored, for the "
                        "baseline too; 256 matches the vLLM runs under eval/. 0: decode mode, one forward per window "
                        "in which every position attends to quantized K/V, its own included (the strict bound); all "
                        "positions scored. Valid: 0 or 1 .. window - 2, each at most once")
    parser.add_argument("--key-smoothing", action="store_true",
                        help="fold weight-derived key smoothing into the model first (data-free, logits unchanged; "
                             "see turboquant_core.integrations.key_smoothing)")
    parser.add_argument("--key-centering", action=argparse.BooleanOptionalAction, default=True,
                        help="store keys as the patched vLLM does by default (--tq-key-centering): the first 16 "
                             "tokens plain, later keys minus their page's share of the pre-RoPE key mean derived "
                             "from those (see turboquant_core.ops.key_centering); MSE-key presets of RoPE models "
                             "only, fp8-key presets store keys as they are (default: on; --no-key-centering: off)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run_eval_ppl(args: argparse.Namespace) -> int:
    """Run ``tq eval-ppl``; bad input prints ``error: ...`` and returns 2."""
    try:
        return _run_eval_ppl(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_eval_ppl(args: argparse.Namespace) -> int:
    import transformers

    from .models import load_model

    presets = parse_presets(args.presets)
    skip_layers = parse_layer_list(args.skip_layers)
    try:
        prefill_chunks = parse_prefill_chunks(args.prefill_chunk, args.window)
    except ValueError as e:
        if args.prefill_chunk != DEFAULT_PREFILL_CHUNKS:
            raise
        min_window = max(int(n) for n in DEFAULT_PREFILL_CHUNKS.split(",")) + 2
        raise ValueError(f"{e}; the default --prefill-chunk {DEFAULT_PREFILL_CHUNKS} needs --window >= {min_window}, "
                         "pass a smaller N or 0 for shorter windows") from None
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    text, text_label = read_text(args.text)

    t0 = time.perf_counter()
    loaded = load_model(args.model, device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    if args.key_smoothing:
        from .key_smoothing import apply_key_smoothing

        apply_key_smoothing(loaded.model)
    key_centering = None
    if args.key_centering:
        from .transformers_cache import key_centering_for_model

        try:
            key_centering = key_centering_for_model(loaded.model)
        except ValueError as e:
            # As the patched vLLM does for layers without a plain rotary embedding: run them uncentred.
            print(f"key centering not applied: {e}", file=sys.stderr)
    windows = token_windows(loaded.tokenizer, text, args.window, args.windows or None)
    dtype_name = str(dtype).removeprefix("torch.")

    regimes = []
    for regime_index, prefill_chunk in enumerate(prefill_chunks):
        print(f"model {args.model} ({loaded.source}), {loaded.model.config.model_type}, {device} {dtype_name}; "
              f"text {text_label}: {len(windows)} windows x {args.window} tokens; {attention_mode(prefill_chunk)}"
              + (f" (chunks of {prefill_chunk}, scoring targets {prefill_chunk + 1}..{args.window - 1} of each "
                 "window)" if prefill_chunk else ""), file=sys.stderr)
        t1, cpu1 = time.perf_counter(), time.process_time()
        baseline, scores = evaluate_perplexity(loaded.model, windows, presets, skip_layers=skip_layers,
                                               residual_tokens=args.residual_tokens, prefill_chunk=prefill_chunk,
                                               progress=not args.no_progress, key_centering=key_centering)
        eval_s, eval_cpu_s = time.perf_counter() - t1, time.process_time() - cpu1
        if regime_index:
            print()
        print(regime_heading(prefill_chunk, args.window))
        print(format_table(baseline, scores), flush=True)
        regimes.append({
            "prefill_chunk": prefill_chunk,
            "attention_mode": attention_mode(prefill_chunk),
            "tokens_scored": baseline.tokens,
            "eval_seconds": round(eval_s, 1),
            "eval_cpu_seconds": round(eval_cpu_s, 1),  # process CPU time, all threads
            "baseline": asdict(baseline),
            "presets": [asdict(s) for s in scores],
        })

    if args.json:
        cfg = loaded.model.config.get_text_config(decoder=True)
        report = {
            "model": args.model,
            "model_source": loaded.source,
            "model_type": cfg.model_type,
            "num_layers": cfg.num_hidden_layers,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "text": text_label,
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "window": args.window,
            "windows": len(windows),
            "bos_prepended": leading_bos(loaded.tokenizer) is not None,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
            or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "dtype": dtype_name,
            "skip_layers": skip_layers,
            "residual_tokens": args.residual_tokens,
            "key_smoothing": bool(args.key_smoothing),
            # Whether the centering tables were built (asked for and the model has RoPE); per preset: key_centered.
            "key_centering": key_centering is not None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": getattr(args, "command_line", None) or _command_line(),
            "load_seconds": round(load_s, 1),
            "regimes": regimes,  # one per --prefill-chunk entry, in the order run
        }
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _command_line() -> str:
    """The command as typed: ``tq eval-ppl ...`` (console script or ``python -m turboquant_core.cli``)."""
    prog = Path(sys.argv[0]).name
    if prog == "cli.py":
        prog = "python -m turboquant_core.cli"
    return " ".join([prog, shlex.join(sys.argv[1:])])


def main(argv: list[str] | None = None) -> int:
    parser = add_eval_ppl_arguments(argparse.ArgumentParser(
        prog="python -m turboquant_core.integrations.perplexity", description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    args.command_line = "python -m turboquant_core.integrations.perplexity " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    return run_eval_ppl(args)


if __name__ == "__main__":
    sys.exit(main())

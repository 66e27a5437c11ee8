# SPDX-License-Identifier: Apache-2.0
"""The ``tq`` command: presets, validate, bench, memory, eval-ppl, convert-gguf, quantize.

Every subcommand prints a table, or JSON with ``--json``. Bad arguments exit with status 2 and
a message naming the valid choices. Heavy imports (Triton kernels, transformers) happen inside
the subcommand that needs them, so ``tq presets`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings

from .formats import (
    KV_FORMATS,
    MLA_KV_LORA_RANK,
    MLA_ROPE_DIM,
    WEIGHT_FORMATS,
    format_names,
    mla_baseline_bytes,
    mla_format,
)
from .rotation import SUPPORTED_HEAD_DIMS

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EVAL_PPL_MODULE = "turboquant_core.integrations.perplexity"


# ----------------------------------------------------------------------------- argument types


def _head_dim(text: str) -> int:
    try:
        d = int(text)
    except ValueError:
        d = None
    if d not in SUPPORTED_HEAD_DIMS:
        raise argparse.ArgumentTypeError(
            f"head dim {text!r} not supported; supported head dims: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    return d


def _head_dims(text: str) -> list[int]:
    dims = [_head_dim(p.strip()) for p in text.split(",") if p.strip()]
    if not dims:
        raise argparse.ArgumentTypeError("no head dims given")
    return dims


def _preset_names(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    for n in names:
        if n not in KV_FORMATS:
            raise argparse.ArgumentTypeError(f"unknown preset {n!r}; valid presets: {', '.join(format_names())}")
    if not names:
        raise argparse.ArgumentTypeError("no presets given")
    return names


def _codec_bits(text: str) -> list[float]:
    from .bench import parse_bits

    try:
        return parse_bits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


# ----------------------------------------------------------------------------- printing


def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain aligned text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]] + [[_fmt(r.get(k), s) for k, _, s in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, allow_nan=True))


# ----------------------------------------------------------------------------- presets


def presets_table(head_dim: int = 128) -> list[dict]:
    """One row per preset: encodings, exact bytes and compression at ``head_dim``."""
    rows = []
    for f in KV_FORMATS.values():
        n = f.bytes_per_token_per_head(head_dim)
        rows.append({
            "name": f.name,
            "origin": f.origin,
            "key": f.key.describe(),
            "value": f.value.describe(),
            "bytes_per_token_per_head": n,
            "key_bytes": f.key_bytes(head_dim),
            "value_bytes": f.value_bytes(head_dim),
            "bits_per_coord": 8.0 * n / (2 * head_dim),
            "vs_bf16": f.compression_vs_bf16(head_dim),
            "vs_fp8": 2 * head_dim / n,
            "summary": f.summary,
        })
    return rows


def mla_presets_table(kv_lora_rank: int = MLA_KV_LORA_RANK, rope_dim: int = MLA_ROPE_DIM) -> list[dict]:
    """One row per preset's MLA entry (``formats.MLAFormat``): latent encoding, exact bytes per token and layer,
    and the tokens it holds per token of vLLM's bf16, fp8 and fp8_ds_mla MLA entries."""
    rows = []
    for name in KV_FORMATS:
        m = mla_format(name, kv_lora_rank, rope_dim)
        rows.append({
            "name": name,
            "latent": m.latent.describe(),
            "latent_index_bytes": m.latent_index_bytes(),
            "latent_scale_bytes": m.latent_scale_bytes(),
            "k_pe_bytes": m.rope_bytes(),
            "bytes_per_token": m.bytes_per_token(),
            "vs_bf16": m.compression_vs("bf16"),
            "vs_fp8": m.compression_vs("fp8"),
            "vs_fp8_ds_mla": m.compression_vs("fp8_ds_mla"),
        })
    return rows


def weight_presets_table() -> list[dict]:
    """One row per weight preset: code, group, exact bytes per group and per parameter."""
    return [{
        "name": f.name,
        "code": f"{f.code.describe()}, rotated",
        "group_size": f.group_size,
        "bytes_per_group": f.bytes_per_group(),
        "bits_per_weight": f.bits_per_weight(),
        "bytes_per_param": f.bytes_per_param(),
        "fraction_of_bf16": f.fraction_of_bf16(),
        "packing": f.packing,
        "summary": f.summary,
    } for f in WEIGHT_FORMATS.values()]


def cmd_presets(args) -> int:
    rows = presets_table(args.head_dim)
    weights = weight_presets_table()
    mla = mla_presets_table()
    mla_base = mla_baseline_bytes()
    if args.json:
        _print_json({"head_dim": args.head_dim, "bf16_bytes": 4 * args.head_dim, "fp8_bytes": 2 * args.head_dim,
                     "presets": rows, "weight_presets": weights,
                     "mla": {"kv_lora_rank": MLA_KV_LORA_RANK, "rope_dim": MLA_ROPE_DIM, "baseline_bytes": mla_base,
                             "presets": mla}})
        return EXIT_OK
    print(f"KV-cache presets at head_dim={args.head_dim} (bytes per token per KV head, K+V; "
          f"bf16 = {4 * args.head_dim}, fp8 = {2 * args.head_dim})")
    print(format_table(rows, [
        ("name", "name", ""), ("origin", "origin", ""), ("key", "K", ""), ("value", "V", ""),
        ("bytes_per_token_per_head", "bytes", ""), ("bits_per_coord", "bits/coord", ".2f"),
        ("vs_bf16", "x bf16", ".2f"), ("vs_fp8", "x fp8", ".2f"), ("summary", "summary", ""),
    ]))
    print("\nWeight presets (library format and reference codec; not yet a vLLM --quantization method), bytes per "
          "group of weights along the input dimension, scale included")
    print(format_table(weights, [
        ("name", "name", ""), ("code", "code", ""), ("group_size", "group", ""), ("bytes_per_group", "bytes", ""),
        ("bits_per_weight", "bits/weight", ".3f"), ("fraction_of_bf16", "of bf16", ".3f"), ("packing", "packing", ""),
    ]))
    print(f"\nMLA latent caches (DeepSeek V2/V3: kv_lora_rank {MLA_KV_LORA_RANK} + rope {MLA_ROPE_DIM}), bytes per "
          f"token per layer: the latent in the preset's key encoding (one rotation over all {MLA_KV_LORA_RANK}), "
          f"k_pe bf16; vLLM: bf16 = {mla_base['bf16']}, fp8 = {mla_base['fp8']}, "
          f"fp8_ds_mla = {mla_base['fp8_ds_mla']}")
    print(format_table(mla, [
        ("name", "name", ""), ("latent", "latent", ""), ("latent_index_bytes", "latent B", ""),
        ("latent_scale_bytes", "scale B", ""), ("k_pe_bytes", "k_pe B", ""), ("bytes_per_token", "bytes", ""),
        ("vs_bf16", "x bf16", ".2f"), ("vs_fp8", "x fp8", ".2f"), ("vs_fp8_ds_mla", "x fp8_ds_mla", ".2f"),
    ]))
    return EXIT_OK


# ----------------------------------------------------------------------------- validate


def cmd_validate(args) -> int:
    from .validate import run_validation

    result = run_validation(args.presets, args.dims, args.vectors, args.seed, args.backend, args.tolerance,
                            qjl=not args.no_qjl, progress=not args.json)
    if args.json:
        _print_json(result)
        return EXIT_OK if result["ok"] else EXIT_FAILED
    print(f"{result['vectors']} random unit vectors per row, device {result['device']}, "
          f"backend {result['backend']}, seed {result['seed']}")
    print("mse: E||x - x_hat||^2 (unit x); theory: Lloyd-Max distortion of the codebook; "
          "ip: <q, x_hat> - <q, x> with <q, x> ~ 0.7")
    print(format_table(result["presets"], [
        ("preset", "preset", ""), ("dim", "d", ""), ("component", "K/V", ""), ("encoding", "encoding", ""),
        ("mse", "mse", ".5f"), ("theory_mse", "theory", ".5f"), ("rel_dev", "dev", "+.2%"),
        ("ok", f"within {result['tolerance']:.0%}", ""), ("ip_mean", "ip mean", "+.2e"), ("ip_std", "ip std", ".2e"),
    ]))
    if result["qjl"]:
        print("\nQJL variant ((b-1)-bit MSE + 1-bit sketch): mean ip error in standard errors (z), "
              "vs the plain b-bit MSE quantizer")
        print(format_table(result["qjl"], [
            ("dim", "d", ""), ("bits", "bits", ""), ("mse", "mse", ".5f"), ("ip_mean", "ip mean", "+.2e"),
            ("ip_std", "ip std", ".2e"), ("ip_z", "z", "+.2f"), ("unbiased", "unbiased", ""),
            ("mse_only_ip_mean", "mse-only ip mean", "+.2e"), ("mse_only_ip_z", "mse-only z", "+.1f"),
        ]))
    print(f"\n{'PASS' if result['ok'] else 'FAIL'}")
    return EXIT_OK if result["ok"] else EXIT_FAILED


# ----------------------------------------------------------------------------- bench


def cmd_bench(args, argv: list[str]) -> int:
    from .bench import bench_codec

    command = "tq " + " ".join(argv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = bench_codec(args.vectors, args.dim, args.bits, args.seed, command=command)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.json:
        _print_json(result)
        return EXIT_OK
    c = result["copy"]
    print(f"{result['device']} ({result['backend']}), torch {result['torch']}, triton {result['triton']}, "
          f"{result['date']}")
    print(f"copy_ bandwidth: {c['gbs']:.1f} GB/s ({c['bytes'] / 2**20:.0f} MiB buffer, read + write)")
    print(format_table(result["results"], [
        ("op", "op", ""), ("bits", "bits", "g"), ("dim", "d", ""), ("vectors", "vectors", ""),
        ("ms", "ms", ".3f"), ("vectors_per_s", "vectors/s", ".3e"), ("gbs", "GB/s", ".1f"),
        ("fraction_of_copy", "of copy", ".1%"),
    ]))
    return EXIT_OK


# ----------------------------------------------------------------------------- memory


def cmd_memory(args) -> int:
    from .memory import context_warning, load_config, memory_report

    cfg = load_config(args.config)
    report = memory_report(cfg, args.context, args.batch, args.gpu_mem_gb, args.presets, args.tensor_parallel_size)
    warning = context_warning(cfg, args.context)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        _print_json(report)
        return EXIT_OK
    if report.get("attention") == "mla":
        _print_mla_memory(report)
        return EXIT_OK
    r = report
    print(f"{r['model_type']}: {r['num_layers']} layers ({r['full_layers']} full, {r['windowed_layers']} windowed, "
          f"{r['no_kv_layers']} without KV; {r['layer_types_source']}), {r['num_kv_heads']} KV heads, "
          f"head_dim {r['head_dim']}")
    tp = r["tensor_parallel_size"]
    per_gpu = f"; per GPU of {tp} (tensor parallel): {r['kv_heads_per_gpu']} KV heads" if tp > 1 else ""
    print(f"context {r['context']} tokens x batch {r['batch']}"
          + (f", {r['gpu_mem_gib']:g} GiB for the KV cache" + (" on each GPU" if tp > 1 else "")
             if r["gpu_mem_gib"] else "") + per_gpu)
    columns = [
        ("name", "format", ""), ("origin", "origin", ""), ("bytes_per_token_per_head", "B/token/head", ""),
        ("kv_gib", "KV GiB per GPU" if tp > 1 else "KV GiB", ".3f"), ("vs_bf16", "x bf16", ".2f"),
        ("vs_fp8", "x fp8", ".2f"),
    ]
    rows, columns = _with_fit_columns(r, columns)
    print(format_table(rows, columns))
    return EXIT_OK


def _with_fit_columns(report: dict, columns: list[tuple[str, str, str]]) -> tuple[list[dict], list]:
    """The rows and columns with the fit columns added when the report has a memory budget."""
    if not report["gpu_mem_gib"]:
        return report["rows"], columns
    rows = [{**row, "max_context": "unlimited" if row["max_context"] is None else row["max_context"],
             "max_total_tokens": "unlimited" if row["max_total_tokens"] is None else row["max_total_tokens"]}
            for row in report["rows"]]
    return rows, columns + [("fits", "fits", ""), ("max_context", "max context/seq", ""),
                            ("max_total_tokens", "max tokens total", "")]


def _print_mla_memory(r: dict) -> None:
    tp = r["tensor_parallel_size"]
    print(f"{r['model_type']}: {r['num_layers']} MLA layers, {r['num_heads']} heads sharing one latent entry per token "
          f"and layer (kv_lora_rank {r['kv_lora_rank']} + rope {r['rope_dim']})"
          + (f"; the whole latent cache on each of {tp} GPUs (tensor parallel)" if tp > 1 else ""))
    print(f"context {r['context']} tokens x batch {r['batch']}"
          + (f", {r['gpu_mem_gib']:g} GiB for the KV cache" + (" on each GPU" if tp > 1 else "")
             if r["gpu_mem_gib"] else ""))
    rows, columns = _with_fit_columns(r, [
        ("name", "format", ""), ("origin", "origin", ""), ("bytes_per_token_per_layer", "B/token/layer", ""),
        ("kv_gib", "KV GiB per GPU" if tp > 1 else "KV GiB", ".3f"), ("tokens_per_gib", "tokens/GiB", ""),
        ("vs_bf16", "x bf16", ".2f"), ("vs_fp8", "x fp8", ".2f"), ("vs_fp8_ds_mla", "x fp8_ds_mla", ".2f"),
    ])
    print(format_table(rows, columns))


# ----------------------------------------------------------------------------- eval-ppl


def run_eval_ppl_command(rest: list[str]) -> int:
    """``tq eval-ppl``: arguments and logic live in the perplexity integration, imported only here."""
    import importlib

    try:
        module = importlib.import_module(EVAL_PPL_MODULE)
    except ModuleNotFoundError as e:
        if e.name == EVAL_PPL_MODULE:
            print(f"tq eval-ppl: {EVAL_PPL_MODULE} is not part of this installation", file=sys.stderr)
        else:
            print(f"tq eval-ppl: missing dependency {e.name!r}; install the extras with "
                  "pip install -e \".[hf]\"", file=sys.stderr)
        return EXIT_USAGE
    parser = argparse.ArgumentParser(prog="tq eval-ppl", description="Perplexity of a model with a TurboQuant KV cache")
    module.add_eval_ppl_arguments(parser)
    try:
        args = parser.parse_args(rest)
    except SystemExit as e:
        return _exit_code(e)
    return int(module.run_eval_ppl(args))


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tq", description="TurboQuant KV-cache formats: tables, checks, benchmarks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("presets", help="the KV-cache format table")
    p.add_argument("--head-dim", type=_head_dim, default=128, help="head dimension (default 128)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("validate", help="measured distortion vs Lloyd-Max theory, inner-product bias, QJL")
    p.add_argument("--dims", type=_head_dims, default=[64, 128, 256], help="comma-separated head dims (64,128,256)")
    p.add_argument("--vectors", type=_positive_int, default=100_000, help="random unit vectors per row (100000)")
    p.add_argument("--presets", type=_preset_names, default=list(format_names()),
                   help="comma-separated presets (default: all)")
    p.add_argument("--seed", type=int, default=0, help="data seed (0)")
    p.add_argument("--backend", choices=("auto", "triton", "reference"), default="auto",
                   help="auto: Triton kernels on CUDA, torch reference otherwise")
    p.add_argument("--tolerance", type=_positive_float, default=0.05,
                   help="allowed relative deviation of the MSE from theory (0.05)")
    p.add_argument("--no-qjl", action="store_true", help="skip the QJL rows")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("bench", help="encode/decode throughput vs the device's copy bandwidth")
    p.add_argument("--vectors", type=_positive_int, default=None,
                   help="vectors per call (default 1000000 on CUDA, 20000 on CPU)")
    p.add_argument("--dim", type=_head_dim, default=128, help="head dimension (128)")
    p.add_argument("--bits", type=_codec_bits, default=[3.0, 4.0], help="comma-separated bit widths (3,4)")
    p.add_argument("--seed", type=int, default=0, help="rotation and data seed (0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")

    p = sub.add_parser("memory", help="KV-cache size of a Hugging Face model per preset (MLA models too)")
    p.add_argument("--config", required=True, help="path to the model's config.json (or its folder)")
    p.add_argument("--context", type=_positive_int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=_positive_int, default=1, help="concurrent sequences (1)")
    p.add_argument("--gpu-mem-gb", type=_positive_float, default=None,
                   help="GiB available to the KV cache: also report how many tokens fit")
    p.add_argument("--presets", type=_preset_names, default=None, help="comma-separated presets (default: all)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="GPUs the model's heads are split over, as vLLM's --tensor-parallel-size: sizes are per GPU "
                        "(1)")
    p.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("eval-ppl", help="perplexity with each KV format (tq eval-ppl --help)", add_help=False)
    sub.add_parser("convert-gguf", help="GGUF model -> Hugging Face folder with a correct tokenizer "
                   "(tq convert-gguf --help)", add_help=False)
    sub.add_parser("quantize", help="Hugging Face checkpoint -> its linear weights in tq3 / tq4 "
                   "(tq quantize --help)", add_help=False)
    return parser


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return EXIT_OK
    return e.code if isinstance(e.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval-ppl":
        return run_eval_ppl_command(argv[1:])
    if argv and argv[0] in ("convert-gguf", "quantize"):
        if argv[0] == "convert-gguf":
            from .integrations.gguf_convert import main as command_main
        else:
            from .integrations.quantize_checkpoint import main as command_main
        try:
            return command_main(argv[1:])
        except SystemExit as e:
            return _exit_code(e)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return _exit_code(e)
    try:
        if args.command == "presets":
            return cmd_presets(args)
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "bench":
            return cmd_bench(args, argv)
        if args.command == "memory":
            return cmd_memory(args)
    except ValueError as e:  # bad input found past argument parsing: named, with the valid choices
        print(f"tq {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE  # unreachable: argparse only accepts the commands above


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""What one quality run is made of: (model, KV-cache dtype, install, weights) configs and their settings.

An *install* is a Python path holding a vLLM build: ``stock`` (unpatched vLLM 0.26.0) or
``patched`` (this fork's patch series applied). Each config runs in its own process with that
install first on PYTHONPATH, one vLLM engine for all tasks.

*Weights* say how the linear weights are served: ``none`` (the checkpoint as it is, bf16), vLLM's online
``fp8``, ``tq4``/``tq3`` (this fork's ``--quantization``), ``tq4-fp16-decode``/``tq3-fp16-decode`` (the same with
``--no-tq-weights-decode-int8``: decode-sized products keep the activation in fp16; a prefill chunk of at most 64
tokens runs them), or ``rtn4``/``rtn3``, the round-to-nearest control at tq's group size and bytes
(``tq_eval.rtn``), served as a fake-quantized copy of the model folder. The
KV-cache dtype configs keep weights ``none``; each other weights name is one config, KV dtype ``auto``, patched.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

INSTALLS = ("stock", "patched")
REFERENCE_DTYPE = "auto"  # the model's own dtype (bf16 for the models here)
BASELINE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
ALIASES = {"bf16": "auto", "bfloat16": "auto"}
# The TurboQuant presets stock vLLM 0.26.0 knows; mirrors the "stock" rows of
# turboquant_core.formats (checked by a test) without importing torch here.
STOCK_TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
# The presets the acceptance check compares between stock and ours.
ACCEPTANCE_PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc")

NO_WEIGHTS = "none"  # the checkpoint's own weights (bf16 for the models here)
WEIGHT_ALIASES = {"bf16": "none", "bfloat16": "none"}
WEIGHT_BASELINES = ("none", "fp8")  # vLLM's own: the checkpoint as it is, online fp8
RTN_PREFIX = "rtn"
FP16_DECODE_SUFFIX = "-fp16-decode"  # tq4-fp16-decode: --quantization tq4 --no-tq-weights-decode-int8
WEIGHTS_INSTALL = "patched"  # tq3/tq4 exist only there; the other weight configs run beside them


def turboquant_names() -> tuple[str, ...]:
    from turboquant_core.formats import format_names

    return format_names()


def valid_dtypes() -> tuple[str, ...]:
    return BASELINE_DTYPES + turboquant_names()


def normalize_dtype(name: str) -> str:
    """Canonical KV-cache dtype name; unknown names raise with the list of valid ones."""
    n = ALIASES.get(name.strip(), name.strip())
    valid = valid_dtypes()
    if n not in valid:
        raise ValueError(
            f"unknown KV-cache dtype {name!r}; valid: {', '.join(valid)} (aliases: {', '.join(ALIASES)})"
        )
    return n


def tq_weight_names() -> tuple[str, ...]:
    from turboquant_core.formats import WEIGHT_FORMATS

    return tuple(WEIGHT_FORMATS)


def rtn_name(tq_name: str) -> str:
    """The RTN control of a tq weight format: same bits, group size and bytes (``tq4`` -> ``rtn4``)."""
    from turboquant_core.formats import get_weight_format

    return f"{RTN_PREFIX}{get_weight_format(tq_name).bits}"


def valid_weights() -> tuple[str, ...]:
    tq = tq_weight_names()
    return WEIGHT_BASELINES + tq + tuple(rtn_name(n) for n in tq) + tuple(n + FP16_DECODE_SUFFIX for n in tq)


def normalize_weights(name: str) -> str:
    """Canonical weights name; unknown names raise with the list of valid ones."""
    n = WEIGHT_ALIASES.get(name.strip(), name.strip())
    valid = valid_weights()
    if n not in valid:
        raise ValueError(
            f"unknown weights {name!r}; valid: {', '.join(valid)} (aliases: {', '.join(WEIGHT_ALIASES)})"
        )
    return n


def parse_weights(text: str) -> list[str]:
    out = []
    for name in (x for x in text.split(",") if x.strip()):
        n = normalize_weights(name)
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("no weights given")
    return out


def rtn_bits(weights: str) -> int | None:
    """Bits of an RTN control (``rtn4`` -> 4), None for any other weights."""
    return int(weights[len(RTN_PREFIX):]) if weights.startswith(RTN_PREFIX) else None


def vllm_quantization(weights: str) -> str | None:
    """vLLM's ``quantization=`` for these weights: None for the checkpoint as it is and for the RTN control
    (a plain checkpoint too, only its values are rounded)."""
    if weights == NO_WEIGHTS or rtn_bits(weights) is not None:
        return None
    return weights.removesuffix(FP16_DECODE_SUFFIX)


def weights_engine_options(weights: str) -> dict:
    """vLLM engine arguments these weights add besides ``quantization=``."""
    return {"tq_weights_decode_int8": False} if weights.endswith(FP16_DECODE_SUFFIX) else {}


def parse_installs(text: str) -> list[str]:
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name not in INSTALLS:
            raise ValueError(f"unknown install {name!r}; valid: {', '.join(INSTALLS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no install given; valid: {', '.join(INSTALLS)}")
    return out


def parse_dtypes(text: str) -> list[str]:
    out = []
    for name in (x for x in text.split(",") if x.strip()):
        n = normalize_dtype(name)
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("no KV-cache dtype given")
    return out


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return vals


def parse_float_list(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ValueError(f"{what} is empty")
    return vals


@dataclass(frozen=True)
class ModelInfo:
    """What the report needs from a model folder's config.json (no transformers import)."""

    name: str
    path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    architecture: str

    @staticmethod
    def from_path(path: str | Path, name: str | None = None) -> ModelInfo:
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: --model must be a Hugging Face model folder")
        cfg = json.loads(cfg_file.read_text())
        text = cfg.get("text_config") or cfg
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        return ModelInfo(
            name=safe_name(name or p.name),
            path=str(p.resolve()),
            num_layers=int(text["num_hidden_layers"]),
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=text.get("max_position_embeddings"),
            architecture=(cfg.get("architectures") or ["?"])[0],
        )


def safe_name(text: str) -> str:
    """A file-name-safe label (letters, digits, . _ -)."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    return s or "model"


def prefill_label(prefill_chunk: int) -> str:
    """How prompts are prefilled, for reports."""
    return f"in chunks of {prefill_chunk} tokens" if prefill_chunk else "whole (chunked prefill off)"


@dataclass
class EngineSettings:
    """vLLM engine arguments shared by every config of a run."""

    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.2
    kv_cache_gib: float = 6.0  # fixed KV pool (vLLM kv_cache_memory_bytes); 0: size by utilization
    max_model_len: int | None = None  # None: the model's limit
    max_num_batched_tokens: int = 8192
    # Prefill tokens per request per step (vLLM long_prefill_token_threshold). 0: chunked prefill off,
    # every prompt is prefilled whole in one step (vLLM's single-request path; no position of a prompt
    # reads the KV cache then, so perplexity needs a chunk).
    prefill_chunk: int = 256
    seed: int = 1234
    max_num_seqs: int | None = None  # None: vLLM's default

    def __post_init__(self):
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: whole prompts), got {self.prefill_chunk}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def engine_kwargs(self, model_path: str, kv_cache_dtype: str, topk: int, quantization: str | None = None,
                      options: dict | None = None) -> dict:
        kw = dict(
            model=model_path,
            tokenizer=model_path,
            dtype="auto",
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=self.enforce_eager,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.prefill_chunk,
            enable_chunked_prefill=self.prefill_chunk > 0,
            max_logprobs=topk,
            enable_prefix_caching=False,
            enable_flashinfer_autotune=False,
            seed=self.seed,
        )
        if quantization:
            kw["quantization"] = quantization
        kw.update(options or {})
        if self.max_model_len:
            kw["max_model_len"] = self.max_model_len
        if self.max_num_seqs:
            kw["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_gib > 0:
            kw["kv_cache_memory_bytes"] = int(self.kv_cache_gib * (1 << 30))
        return kw


@dataclass
class TaskSettings:
    """Sizes of the three tasks (small defaults: a tiny model, a short GPU slot)."""

    text_path: str | None = None  # perplexity text; None: skip perplexity
    ppl_window_tokens: int = 1024
    ppl_windows: int = 24
    topk: int = 20
    niah_lengths: list[int] | None = None  # None: powers of two from 1024 to the model's limit
    niah_depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    niah_samples: int = 4
    niah_seed: int = 0
    niah_gen_tokens: int = 16
    gsm8k_data: str | None = None  # directory with train/test.jsonl, "hub", or None: skip
    gsm8k_limit: int | None = 100
    gsm8k_fewshot: int = 5
    tasks: list[str] = field(default_factory=lambda: ["ppl", "niah", "gsm8k"])

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in ("ppl", "niah", "gsm8k")]
        if bad:
            raise ValueError(f"unknown task(s) {bad}; valid: ppl, niah, gsm8k")
        if not 512 <= self.ppl_window_tokens <= 8192:
            raise ValueError(f"ppl window must be 512..8192 tokens, got {self.ppl_window_tokens}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")


@dataclass(frozen=True)
class RunConfig:
    """One engine: a model, a KV-cache dtype, an install and how the weights are served."""

    model: ModelInfo
    dtype: str
    install: str
    weights: str = NO_WEIGHTS
    # The folder vLLM loads where it is not the model's own: the RTN control's fake-quantized copy.
    served_path: str | None = None

    @property
    def id(self) -> str:
        # Weights "none" keeps the id of the runs that had no weight axis, so their reports stay comparable.
        base = f"{self.install}__{self.dtype}"
        return base if self.weights == NO_WEIGHTS else f"{base}__weights-{self.weights}"

    def to_dict(self) -> dict:
        return {"id": self.id, "dtype": self.dtype, "install": self.install, "weights": self.weights,
                "served_path": self.served_path, "model": asdict(self.model)}


def rtn_folder(base: Path, model: ModelInfo, weights: str) -> Path:
    """Where the RTN control ``weights`` of ``model`` is written under ``base`` (one folder per model and bits)."""
    return Path(base) / f"{model.name}__{weights}"


def weights_rank(weights: str) -> int:
    """Order of plans and reports: none, tq4, tq4-fp16-decode, rtn4, tq3, ..., fp8 (each tq format next to its
    fp16-decode run and its control)."""
    order = [NO_WEIGHTS] + [n for tq in tq_weight_names() for n in (tq, tq + FP16_DECODE_SUFFIX, rtn_name(tq))]
    order += ["fp8"]
    return order.index(weights) if weights in order else len(order)


def plan_configs(
    models: list[ModelInfo],
    dtypes: list[str],
    installs: list[str],
    baseline_installs: list[str] | None = None,
    weights: list[str] | None = None,
) -> tuple[list[RunConfig], list[dict]]:
    """The configs to run, most informative first, and the (dtype, install) pairs left out, why.

    Baselines (auto, fp8*) run on ``baseline_installs`` only (default: patched if requested,
    else the first install): the patch series does not touch them. Stock runs only the four
    presets stock vLLM 0.26 knows. Every name in ``weights`` but ``none`` adds one config: KV dtype
    ``auto``, install patched. Order per model: the bf16 reference, the acceptance presets
    (ours, then stock), the weight configs (each tq format next to its RTN control), the other
    baselines, then the rest -- so a run cut short keeps what the report needs most.
    """
    if baseline_installs is None:
        baseline_installs = ["patched"] if "patched" in installs else installs[:1]
    plans, skipped = [], []
    for m in models:
        cfgs = [RunConfig(m, REFERENCE_DTYPE, WEIGHTS_INSTALL, weights=w) for w in weights or () if w != NO_WEIGHTS]
        for d in dtypes:
            for inst in installs:
                if d in BASELINE_DTYPES and inst not in baseline_installs:
                    skipped.append({"model": m.name, "dtype": d, "install": inst, "reason": "baseline runs once"})
                    continue
                if inst == "stock" and d not in BASELINE_DTYPES and d not in STOCK_TURBOQUANT:
                    skipped.append({"model": m.name, "dtype": d, "install": inst,
                                    "reason": "not a stock vLLM 0.26 KV-cache dtype"})
                    continue
                cfgs.append(RunConfig(m, d, inst))

        def rank(c: RunConfig) -> tuple:
            if c.weights != NO_WEIGHTS:
                return (2, weights_rank(c.weights), 0)
            if c.dtype == REFERENCE_DTYPE:
                group = 0
            elif c.dtype in ACCEPTANCE_PRESETS:
                group = 1
            elif c.dtype in BASELINE_DTYPES:
                group = 3
            else:
                group = 4
            return (group, ACCEPTANCE_PRESETS.index(c.dtype) if group == 1 else 0, INSTALLS.index(c.install) * -1)

        plans.extend(sorted(cfgs, key=rank))
    return plans, skipped


def subprocess_env(
    base_env: dict[str, str], install_path: str | None, extra_paths: list[str], offline: bool
) -> dict[str, str]:
    """Environment of one config's process: the install first on PYTHONPATH, then ``extra_paths``
    (this package, the project root); offline Hugging Face; fast vLLM start."""
    env = dict(base_env)
    head = install_path if install_path is not None else env.get("PYTHONPATH", "")
    parts = [p for p in head.split(os.pathsep) if p] + [p for p in extra_paths if p]
    seen, ordered = set(), []
    for p in parts:
        if p not in seen:
            seen.add(p)
            ordered.append(p)
    env["PYTHONPATH"] = os.pathsep.join(ordered)
    if offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # In-process engine core: exceptions reach the worker with their real message, and killing
    # the worker's process group frees the GPU.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env

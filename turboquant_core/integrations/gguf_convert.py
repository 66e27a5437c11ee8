# SPDX-License-Identifier: Apache-2.0
"""GGUF -> Hugging Face folder (bf16 safetensors + a correct fast tokenizer), written atomically.

Why this exists: transformers 5.17 converts a GGUF whose tokenizer is SentencePiece-BPE
(``tokenizer.ggml.model == "llama"`` with merge ranks stored as scores, no merges list; Gemma 3) into
a *Unigram* tokenizer, and the tokenizer.json it saves from that keeps no usable scores: reloaded,
"The capital of France is" becomes 24 single-character pieces with no <bos>. A serving engine fed
those ids (vLLM tokenizes with the saved folder) produces garbage such as "1 1 1 1", while the
in-process GGUF tokenizer looks fine. The fix rebuilds the tokenizer as what it is, a byte-fallback
BPE whose merges follow the SentencePiece scores (the same rule transformers' SentencePieceExtractor
uses for .model files), with <bos> added as llama.cpp's ``add_bos_token`` says.

The source file is only read; the destination appears complete or not at all (temporary sibling
folder, then one rename). A truncated or foreign file is refused first, by its header alone
(``check_gguf_file``): the error names the file and says which it is.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
from pathlib import Path

from .atomic_folder import atomic_folder

# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# GGUF metadata value types: struct codes of the fixed-size ones; 8 is a string, 9 an array.
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)  # what gguf.GGUFReader reads
_MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFFileError(ValueError):
    """A GGUF file that cannot be loaded: truncated, or not a GGUF file at all. The message names the file."""


class _HeaderEnds(Exception):
    """The file ends inside its header."""


class _BadHeader(Exception):
    """The header is not GGUF (the message says why)."""


class _Header:
    """Sequential reads of a GGUF header from a memory map, each checked against the end of the file."""

    def __init__(self, buf):
        self.buf, self.pos, self.order, self.where = buf, 4, "<", "the version"

    def take(self, code: str):
        fmt, start = self.order + code, self.pos
        self.skip(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _HeaderEnds
        self.pos += n

    def string(self) -> str:
        n = self.take("Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        """Read one metadata value; strings and arrays are stepped over (None)."""
        if kind in _SCALAR_CODES:
            return self.take(_SCALAR_CODES[kind])
        if kind == _STRING:
            self.skip(self.take("Q"))
            return None
        if kind != _ARRAY:
            raise _BadHeader(f"metadata key {key!r} has unknown value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item in _SCALAR_CODES:
            self.skip(count * struct.calcsize(self.order + _SCALAR_CODES[item]))
        else:
            for _ in range(count):
                self.value(item, key)
        return None


def _tensor_extents(h: _Header, size: int) -> list[tuple[int, int, str]]:
    """(offset in the file, bytes, name) of every tensor the header at ``h`` declares."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    version = h.take("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (the rule gguf.GGUFReader uses)
        h.order, h.pos = ">", 4
        version = h.take("I")
    if version not in _GGUF_VERSIONS:
        raise _BadHeader(f"GGUF version {version}; readable versions: {', '.join(map(str, _GGUF_VERSIONS))}")
    h.where = "the tensor and metadata counts"
    n_tensors, n_kv = h.take("Q"), h.take("Q")
    if max(n_tensors, n_kv) > size:  # each entry takes bytes of the file: these are not counts
        raise _BadHeader(f"it declares {n_tensors} tensors and {n_kv} metadata keys")
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        h.where = f"metadata key {i + 1} of {n_kv}"
        key = h.string()
        h.where = f"metadata key {key!r}"
        kind = h.take("I")
        value = h.value(kind, key)
        if key == "general.alignment" and kind == 4:
            alignment = value
    if alignment < 1 or alignment & (alignment - 1):
        raise _BadHeader(f"general.alignment {alignment} is not a power of two")
    tensors = []
    for i in range(n_tensors):
        h.where = f"tensor info {i + 1} of {n_tensors}"
        name = h.string()
        h.where = f"the info of tensor {name!r}"
        n_dims = h.take("I")
        if n_dims > _MAX_DIMS:
            raise _BadHeader(f"tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        elements = 1
        for _ in range(n_dims):
            elements *= h.take("Q")
        kind, offset = h.take("I"), h.take("Q")
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise _BadHeader(f"tensor {name!r} has unknown type {kind}") from None
        tensors.append((offset, elements // block * block_bytes, name))
    data_start = -(-h.pos // alignment) * alignment  # tensor offsets count from the aligned end of the header
    return [(data_start + offset, n, name) for offset, n, name in tensors]


def check_gguf_file(path: str | os.PathLike) -> None:
    """Raise ``GGUFFileError`` naming ``path`` if it is not a GGUF file, or if it is shorter than the header and
    tensor data it declares (an interrupted download or copy). Reads the header only, not the tensor data, so a
    bad file is refused up front instead of failing deep inside a loader (numpy's "cannot reshape array")."""
    path = Path(path)
    size = path.stat().st_size
    if size < 4:
        raise GGUFFileError(f"{path} is not a valid GGUF file: it has {size} bytes, too few for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFFileError(f"{path} is not a valid GGUF file: it starts with {bytes(buf[:4])!r}, not b'GGUF'")
        h = _Header(buf)
        try:
            tensors = _tensor_extents(h, size)
        except _HeaderEnds:
            raise GGUFFileError(f"{path} is truncated: the file ({size:,} bytes) ends inside its header, "
                                f"in {h.where}") from None
        except _BadHeader as e:
            raise GGUFFileError(f"{path} is not a valid GGUF file: {e}") from None
    short = sorted(t for t in tensors if t[0] + t[1] > size)
    if short:
        declared = max(start + n for start, n, _ in tensors)
        raise GGUFFileError(
            f"{path} is truncated: the file has {size:,} bytes, but its header declares tensor data up to byte "
            f"{declared:,}; {len(short)} of {len(tensors)} tensors run past the end, starting with "
            f"{short[0][2]!r} (an incomplete download or copy?)"
        )


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def needs_spm_bpe_rebuild(reader) -> bool:
    """SentencePiece-BPE vocabularies stored without merges (Gemma family) need the rebuild."""
    return _field(reader, "tokenizer.ggml.model") == "llama" and "tokenizer.ggml.merges" not in reader.fields \
        and _field(reader, "general.architecture", "").startswith("gemma")


def spm_bpe_merges(tokens: list[str], scores, types) -> list[tuple[str, str]]:
    """Merges of a SentencePiece BPE vocabulary: every split of a normal piece into two normal pieces,
    ranked by the merged piece's score (higher first), ties by the ids of the parts."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for tok, i in vocab.items():
        if types[i] != _NORMAL:
            continue
        local = []
        for k in range(1, len(tok)):
            ia, ib = vocab.get(tok[:k]), vocab.get(tok[k:])
            if ia is not None and ib is not None and types[ia] == _NORMAL and types[ib] == _NORMAL:
                local.append((ia, ib, k))
        local.sort()
        ranked.extend((-float(scores[i]), n, tok[:k], tok[k:]) for n, (_, _, k) in enumerate(local))
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(a, b) for _, _, a, b in ranked]


def build_spm_bpe_tokenizer(tokens: list[str], scores, types, bos_id: int | None, add_bos: bool):
    """A ``tokenizers.Tokenizer`` equivalent to the SentencePiece BPE model the GGUF describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for i, t in enumerate(tokens) if types[i] == _UNKNOWN), "<unk>")
    bpe = models.BPE(vocab=vocab, merges=spm_bpe_merges(tokens, scores, types), unk_token=unk,
                     byte_fallback=True, fuse_unk=True)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for i, t in enumerate(tokens) if types[i] in (_CONTROL, _UNKNOWN)])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for i, t in enumerate(tokens) if types[i] == _USER_DEFINED])
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tk


def _rebuild_tokenizer(reader, folder: Path) -> None:
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    scores = list(_field(reader, "tokenizer.ggml.scores"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    tk = build_spm_bpe_tokenizer(tokens, scores, types, bos_id, add_bos)
    tk.save(str(folder / "tokenizer.json"))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(add_bos_token=add_bos, add_eos_token=False, tokenizer_class="GemmaTokenizerFast"
               if "gemma" in _field(reader, "general.architecture", "") else cfg.get("tokenizer_class"))
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def convert_gguf(src: str | os.PathLike, dest: str | os.PathLike, dtype: str = "bfloat16",
                 overwrite: bool = False) -> Path:
    """Write a Hugging Face folder for the GGUF model ``src`` at ``dest`` (weights dequantized to ``dtype``)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dest = Path(src).resolve(), Path(dest).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be one of bfloat16, float16, float32; got {dtype!r}")
    check_gguf_file(src)  # truncated or foreign: refused here, naming the file, before anything is written
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as e:  # a corruption the header check does not see
        raise GGUFFileError(f"{src} is not a valid GGUF file: {e}") from e
    with atomic_folder(dest) as tmp:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     dtype=getattr(torch, dtype))
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        clean = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
        missing, _ = clean.load_state_dict(model.state_dict(), strict=False)
        missing = [k for k in missing if "lm_head" not in k]
        if missing:
            raise ValueError(f"{src}: tensors missing after conversion: {missing[:5]}")
        clean.tie_weights()
        clean.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if needs_spm_bpe_rebuild(reader):
            _rebuild_tokenizer(reader, tmp)
    return dest


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="tq convert-gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="model .gguf file (read only)")
    ap.add_argument("dest", help="output Hugging Face folder")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    try:
        out = convert_gguf(args.src, args.dest, args.dtype, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

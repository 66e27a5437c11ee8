# SPDX-License-Identifier: Apache-2.0
"""The format tables: one row per KV-cache preset and per weight preset, frozen and checked at import.

In the spirit of ggml's ``type_traits``: every format states its K and V encodings, the norm
precision, the packing layout and, derived from those, its exact bytes per token per KV head.
Names shared with stock vLLM 0.26 keep their bit meaning (``k3v4`` = 3-bit keys, 4-bit values,
``nc`` = norm correction); the fork adds presets stock lacks. Format names never change meaning;
a retired name stays in ``RETIRED_FORMATS`` with a note.

Per token and KV head, a component (K or V) is one of
- ``CodebookComponent(bits)``: packed codebook indices (``packing.PACKING_LAYOUT``) + one fp16 scale (2 B),
- ``Fp8Component()``: d float8 e4m3 bytes of the rotated vector, no scale.
Each answers for itself (bytes, quantizer, ``has_codebook``, ``stores_scale``, ...): callers do not test a kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from .packing import PACKING_LAYOUT, packed_bytes
from .quantizer import FP8Quantizer, MSEQuantizer, split_segments
from .rotation import SUPPORTED_HEAD_DIMS, check_head_dim

NORM_BYTES = 2  # fp16 scale per vector
BF16_BYTES = 2
KEY_ROTATION_SEED = 0x7C01
VALUE_ROTATION_SEED = 0x7C02


class ComponentFormat(ABC):
    """How one of K or V is stored: the base of ``CodebookComponent`` and ``Fp8Component``.

    Callers ask the component (``has_codebook``, ``stores_scale``, ...) instead of testing its kind.
    """

    kind: ClassVar[str]  # "mse" | "fp8": a label for output, not for branching
    bits: float  # bits per coordinate of the stored code (8 for fp8)
    norm_correction: bool
    has_codebook: ClassVar[bool]  # packed Lloyd-Max indices: ``segments`` and a theory MSE exist
    is_fp8: ClassVar[bool]  # d float8 e4m3 bytes of the rotated vector (the kernels' K_FP8 path)
    stores_scale: ClassVar[bool]  # one fp16 scale per vector after the indices
    centerable: ClassVar[bool]  # key centering applies to keys stored this way

    @property
    def kernel_bits(self) -> float:
        """Bits of the codec tables the paged kernels build for this component."""
        return self.bits

    @abstractmethod
    def segments(self, head_dim: int) -> tuple[tuple[int, int], ...]:
        """(channels, bits) per codebook segment of the rotated vector; ValueError without a codebook."""

    @abstractmethod
    def index_bytes(self, head_dim: int) -> int:
        """Bytes of the per-vector code (indices or fp8 values), scale excluded."""

    def scale_bytes(self) -> int:
        return NORM_BYTES if self.stores_scale else 0

    def bytes_per_vector(self, head_dim: int) -> int:
        check_head_dim(head_dim)
        return self.index_bytes(head_dim) + self.scale_bytes()

    def bits_per_coordinate(self, head_dim: int) -> float:
        return 8.0 * self.bytes_per_vector(head_dim) / head_dim

    @abstractmethod
    def quantizer(self, head_dim: int, seed: int):
        """The reference (torch) quantizer of this encoding."""

    @abstractmethod
    def describe(self) -> str:
        """A short human-readable label (``tq presets``, ``tq validate``)."""


@dataclass(frozen=True)
class CodebookComponent(ComponentFormat):
    """Packed Lloyd-Max indices (``packing.PACKING_LAYOUT``) + one fp16 scale per vector.

    Fractional ``bits`` (3.5, 2.5) split the rotated channels into two segments.
    """

    bits: float
    norm_correction: bool = True

    kind: ClassVar[str] = "mse"
    has_codebook: ClassVar[bool] = True
    is_fp8: ClassVar[bool] = False
    stores_scale: ClassVar[bool] = True
    centerable: ClassVar[bool] = True

    def segments(self, head_dim: int) -> tuple[tuple[int, int], ...]:
        return split_segments(head_dim, self.bits)

    def index_bytes(self, head_dim: int) -> int:
        return sum(packed_bytes(n, b) for n, b in self.segments(head_dim))

    def quantizer(self, head_dim: int, seed: int) -> MSEQuantizer:
        return MSEQuantizer(head_dim, self.bits, self.norm_correction, seed)

    def describe(self) -> str:
        return f"{self.bits:g}-bit Lloyd-Max{' +nc' if self.norm_correction else ''}"


@dataclass(frozen=True)
class Fp8Component(ComponentFormat):
    """d float8 e4m3 bytes of the rotated vector, no scale and no codebook."""

    kind: ClassVar[str] = "fp8"
    bits: ClassVar[float] = 8
    norm_correction: ClassVar[bool] = False
    has_codebook: ClassVar[bool] = False
    is_fp8: ClassVar[bool] = True
    stores_scale: ClassVar[bool] = False
    centerable: ClassVar[bool] = False

    @property
    def kernel_bits(self) -> float:
        # The kernels borrow a 4-bit codec's rotation table (one segment at every head dim): only its rows are used.
        return 4

    def segments(self, head_dim: int) -> tuple[tuple[int, int], ...]:
        raise ValueError("fp8 has no codebook segments (it stores d float8 e4m3 bytes)")

    def index_bytes(self, head_dim: int) -> int:
        return head_dim

    def quantizer(self, head_dim: int, seed: int) -> FP8Quantizer:
        return FP8Quantizer(head_dim, seed)

    def describe(self) -> str:
        return "fp8 e4m3 (rotated)"


@dataclass(frozen=True)
class KVFormat:
    """A KV-cache preset: ``--kv-cache-dtype NAME``."""

    name: str
    key: ComponentFormat
    value: ComponentFormat
    origin: str  # "stock" (name exists in vLLM 0.26, same bit meaning) | "new"
    summary: str
    key_seed: int = KEY_ROTATION_SEED
    value_seed: int = VALUE_ROTATION_SEED
    packing: str = PACKING_LAYOUT

    def key_bytes(self, head_dim: int) -> int:
        return self.key.bytes_per_vector(head_dim)

    def value_bytes(self, head_dim: int) -> int:
        return self.value.bytes_per_vector(head_dim)

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        """Exact K+V bytes one token occupies for one KV head."""
        return self.key_bytes(head_dim) + self.value_bytes(head_dim)

    def compression_vs_bf16(self, head_dim: int) -> float:
        return 2 * BF16_BYTES * head_dim / self.bytes_per_token_per_head(head_dim)

    def key_quantizer(self, head_dim: int):
        return self.key.quantizer(head_dim, self.key_seed)

    def value_quantizer(self, head_dim: int):
        return self.value.quantizer(head_dim, self.value_seed)


_CB = CodebookComponent
KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("turboquant_k8v4", Fp8Component(), _CB(4), "stock",
                 "fp8 keys, 4-bit codebook values (stock: uniform values)"),
        KVFormat("turboquant_4bit_nc", _CB(4), _CB(4), "stock",
                 "4-bit keys and values, norm-corrected"),
        KVFormat("turboquant_k3v4_nc", _CB(3), _CB(4), "stock",
                 "3-bit keys, 4-bit values, norm-corrected"),
        KVFormat("turboquant_3bit_nc", _CB(3), _CB(3), "stock",
                 "3-bit keys and values, norm-corrected"),
        KVFormat("turboquant_k4v3_nc", _CB(4), _CB(3), "new",
                 "4-bit keys, 3-bit values: the bytes of k3v4 with the bit on the keys (lower KL)"),
        KVFormat("turboquant_3p5bit_nc", _CB(3.5), _CB(3.5), "new",
                 "3.5-bit keys and values (half the rotated channels at 4, half at 3)"),
        KVFormat("turboquant_k3v2_nc", _CB(3), _CB(2), "new",
                 "3-bit keys, 2-bit values: values average out in attention, keys do not"),
        KVFormat("turboquant_2p5bit_nc", _CB(2.5), _CB(2.5), "new",
                 "2.5-bit keys and values (half at 3, half at 2)"),
        KVFormat("turboquant_2bit_nc", _CB(2), _CB(2), "new",
                 "2-bit keys and values: maximum capacity"),
    )
}

# Names that once existed; they must never be reused with another meaning.
RETIRED_FORMATS: dict[str, str] = {}

WEIGHT_GROUP_SIZE = 128
WEIGHT_ROTATION_SEED = 0x7C03


@dataclass(frozen=True)
class WeightFormat:
    """A weight preset (``tq3``, ``tq4``): a linear layer's weight [out, in] cut along the input dimension into
    groups of ``group_size`` (the last zero-padded when it does not divide ``in``), each group stored as one
    ``CodebookComponent`` vector: its packed Lloyd-Max indices after the rotation seeded by ``seed`` (``packing``,
    ``code.bits`` bytes per 8 weights) and one fp16 norm-corrected scale. ``ops.weight_codec`` holds the reference
    encoding and the exact storage."""

    name: str
    code: CodebookComponent
    summary: str
    group_size: int = WEIGHT_GROUP_SIZE
    seed: int = WEIGHT_ROTATION_SEED
    packing: str = PACKING_LAYOUT

    @property
    def bits(self) -> int:
        return int(self.code.bits)

    def bytes_per_group(self) -> int:
        return self.code.bytes_per_vector(self.group_size)

    def bits_per_weight(self) -> float:
        """Stored bits per weight, the group's scale included."""
        return 8.0 * self.bytes_per_group() / self.group_size

    def bytes_per_param(self) -> float:
        return self.bytes_per_group() / self.group_size

    def fraction_of_bf16(self) -> float:
        return self.bytes_per_param() / BF16_BYTES

    def groups(self, in_features: int) -> int:
        """Groups of an input dimension: the last one zero-padded when ``group_size`` does not divide it."""
        if in_features <= 0:
            raise ValueError(f"{self.name}: input dimension must be positive, got {in_features}")
        return -(-in_features // self.group_size)

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        """Exact bytes of an [out_features, in_features] weight."""
        return out_features * self.groups(in_features) * self.bytes_per_group()

    def quantizer(self) -> MSEQuantizer:
        """The reference quantizer of one group."""
        return self.code.quantizer(self.group_size, self.seed)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("tq4", _CB(4), "4-bit Lloyd-Max codebook per rotated group of 128, fp16 scale"),
        WeightFormat("tq3", _CB(3), "3-bit Lloyd-Max codebook per rotated group of 128, fp16 scale"),
    )
}


def get_weight_format(name: str) -> WeightFormat:
    """The weight preset called ``name``; an unknown name raises with the list of valid ones."""
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown TurboQuant weight format {name!r}; valid formats: {', '.join(WEIGHT_FORMATS)}"
        ) from None


def format_names() -> tuple[str, ...]:
    return tuple(KV_FORMATS)


def get_format(name: str) -> KVFormat:
    """The preset called ``name``; an unknown name raises with the list of valid ones."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown TurboQuant KV-cache format {name!r}; valid formats: {', '.join(KV_FORMATS)}"
        ) from None


def _check_table() -> None:
    for f in KV_FORMATS.values():
        assert f.name.startswith("turboquant_"), f.name
        assert f.origin in ("stock", "new"), f.name
        assert f.name not in RETIRED_FORMATS, f.name
        for d in SUPPORTED_HEAD_DIMS:
            n = f.bytes_per_token_per_head(d)
            assert 0 < n < 2 * BF16_BYTES * d, (f.name, d, n)
    for w in WEIGHT_FORMATS.values():
        assert w.name not in KV_FORMATS and w.code.bits in (2, 3, 4), w.name
        assert w.bytes_per_group() * 8 == w.group_size * w.bits + 8 * NORM_BYTES, w.name


_check_table()

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

MLA layers (DeepSeek V2/V3 style) cache one latent per token and layer instead of K and V per head; every
preset has an MLA variant (``MLAFormat``, ``mla_format``), whose exact bytes and page entry are stated there.
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

# ----------------------------------------------------------------------------------------------
# MLA (multi-head latent attention) page entries
# ----------------------------------------------------------------------------------------------

MLA_KV_LORA_RANK = 512  # DeepSeek V2 / V3 / Kimi K2: the latent kv_c
MLA_ROPE_DIM = 64  # qk_rope_head_dim: the rope key k_pe, shared by all heads
MLA_FP8_DS_TILE = 128  # vLLM's fp8_ds_mla: one fp32 scale per 128 latent coordinates


@dataclass(frozen=True)
class MLAFormat:
    """The MLA variant of a KV preset: what one token occupies per MLA layer (``kv_lora_rank`` + ``rope_dim``).

    An MLA layer caches, per token, the normalized latent kv_c (``kv_lora_rank`` coordinates) and the rope key
    k_pe (``rope_dim``), both shared by every head. Here:

    - the latent takes the preset's *key* encoding (``KVFormat.key``, seed ``key_seed``): in MLA the latent is
      both the key (scores read q_nope_absorbed . kv_c) and the value (the output is sum_j p_j kv_c_j), and the
      key is what the softmax is sensitive to, value error averaging out over the tokens. So k3v4 gives a 3-bit
      latent, k4v3 a 4-bit one, k8v4 an fp8 one; presets with equal key encodings have equal MLA entries;
    - the rotation spans all ``kv_lora_rank`` coordinates, with one norm per token: ``rotation.rotate`` supports
      512 (a randomized Hadamard: O(d log d) as ``rotation.fwht``, a +-1 product of 512 multiply-adds per
      coordinate in the kernels, four times 4 blocks of 128). That cost is paid once per stored token and once
      per query head and step (attention runs in the rotated domain: the absorbed query is rotated once, the
      latent output un-rotated once), never per cached token read. Blocks of 128 would store 4 scales (6 more
      bytes per token) and spread an outlier channel over 128 coordinates instead of 512;
    - k_pe stays bf16 (2 bytes per coordinate, as given): 64 of the 576 coordinates, a fifth of bf16's bytes
      here and a third of a 3-bit entry, and the part of the score that carries position; vLLM's fp8_ds_mla
      keeps it in bf16 too.

    One token's entry, in page section order (``ops.mla_layout.MLAPagedLayout``: each section is contiguous over the
    page's tokens and starts 16-byte aligned):

    =================  ====================================  ===============================================
    section            bytes per token                       content
    =================  ====================================  ===============================================
    latent indices     ``latent.index_bytes(kv_lora_rank)``  planar8 codebook indices per segment of the
                                                             rotated latent (``ops.codec.encode``'s bytes);
                                                             fp8 latents: kv_lora_rank e4m3fn bytes of R kv_c
    k_pe               2 * rope_dim                          rope_dim bf16 values
    latent scale       2 (codebook latents only)             fp16 norm-corrected scale
    =================  ====================================  ===============================================

    >>> mla_format("turboquant_k3v4_nc").bytes_per_token()  # 192 + 128 + 2
    322
    """

    preset: KVFormat
    kv_lora_rank: int = MLA_KV_LORA_RANK
    rope_dim: int = MLA_ROPE_DIM

    def __post_init__(self):
        check_head_dim(self.kv_lora_rank)
        if self.rope_dim <= 0 or self.rope_dim % 8:
            raise ValueError(f"rope_dim must be a positive multiple of 8 (16-byte bf16 rows), got {self.rope_dim}")

    @property
    def name(self) -> str:
        return self.preset.name

    @property
    def latent(self) -> ComponentFormat:
        return self.preset.key

    @property
    def seed(self) -> int:
        return self.preset.key_seed

    @property
    def head_size(self) -> int:
        """kv_lora_rank + rope_dim: what vLLM calls the MLA cache's head size (576)."""
        return self.kv_lora_rank + self.rope_dim

    def latent_index_bytes(self) -> int:
        return self.latent.index_bytes(self.kv_lora_rank)

    def latent_scale_bytes(self) -> int:
        return self.latent.scale_bytes()

    def rope_bytes(self) -> int:
        return BF16_BYTES * self.rope_dim

    def bytes_per_token(self) -> int:
        """Exact bytes of one token's entry in one MLA layer."""
        return self.latent_index_bytes() + self.rope_bytes() + self.latent_scale_bytes()

    def entry_sections(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes per token) in page order; a scale section only for codebook latents."""
        out = (("latent_index", self.latent_index_bytes()), ("k_pe", self.rope_bytes()))
        return out + ((("latent_scale", self.latent_scale_bytes()),) if self.latent.stores_scale else ())

    def compression_vs(self, baseline: str) -> float:
        """Tokens held per token of ``baseline`` in the same memory (``mla_baseline_bytes``)."""
        return mla_baseline_bytes(self.kv_lora_rank, self.rope_dim)[baseline] / self.bytes_per_token()

    def latent_quantizer(self):
        """The reference (torch) quantizer of the latent."""
        return self.latent.quantizer(self.kv_lora_rank, self.seed)


def mla_baseline_bytes(kv_lora_rank: int = MLA_KV_LORA_RANK, rope_dim: int = MLA_ROPE_DIM) -> dict[str, int]:
    """vLLM 0.26's own MLA entries, bytes per token and layer:

    - ``bf16``: kv_c and k_pe in bf16 (``auto`` on a bf16 model): 2 * 576 = 1152;
    - ``fp8``: kv_c and k_pe as e4m3 with one per-tensor scale (``--kv-cache-dtype fp8`` with the dense MLA
      backends, FlashMLA and Triton MLA: DeepSeek V2/V3): 576;
    - ``fp8_ds_mla``: 512 e4m3 + one fp32 scale per 128 + 64 bf16 rope (DeepSeek V3.2's sparse MLA): 656.
    """
    return {
        "bf16": BF16_BYTES * (kv_lora_rank + rope_dim),
        "fp8": kv_lora_rank + rope_dim,
        "fp8_ds_mla": kv_lora_rank + 4 * -(-kv_lora_rank // MLA_FP8_DS_TILE) + BF16_BYTES * rope_dim,
    }


def mla_format(name: str | KVFormat, kv_lora_rank: int = MLA_KV_LORA_RANK, rope_dim: int = MLA_ROPE_DIM) -> MLAFormat:
    """The MLA variant of preset ``name`` (an unknown name raises with the list of valid ones)."""
    return MLAFormat(name if isinstance(name, KVFormat) else get_format(name), kv_lora_rank, rope_dim)

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
    base = mla_baseline_bytes()
    assert base == {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}, base
    for f in KV_FORMATS.values():
        m = mla_format(f)
        n = m.bytes_per_token()
        assert n == sum(b for _, b in m.entry_sections()) and 0 < n < base["bf16"], (f.name, n)
        assert all(b % 2 == 0 for _, b in m.entry_sections()), f.name  # fp16 / bf16 sections stay aligned
    for w in WEIGHT_FORMATS.values():
        assert w.name not in KV_FORMATS and w.code.bits in (2, 3, 4), w.name
        assert w.bytes_per_group() * 8 == w.group_size * w.bits + 8 * NORM_BYTES, w.name


_check_table()

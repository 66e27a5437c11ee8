# SPDX-License-Identifier: Apache-2.0
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import turboquant_core
from turboquant_core.formats import (
    BF16_BYTES,
    KV_FORMATS,
    NORM_BYTES,
    RETIRED_FORMATS,
    CodebookComponent,
    ComponentFormat,
    Fp8Component,
    KVFormat,
    MLAFormat,
    format_names,
    get_format,
    mla_baseline_bytes,
    mla_format,
)
from turboquant_core.packing import PACKING_LAYOUT, packed_bytes
from turboquant_core.quantizer import FP8Quantizer, MSEQuantizer
from turboquant_core.rotation import SUPPORTED_HEAD_DIMS

# Bytes per token per KV head at d=128 (K + V), worked out by hand:
#   k8v4:    K 128 fp8 bytes          + V 128*4/8 + 2 = 66  -> 194
#   4bit:    K 64 + 2 = 66            + V 66               -> 132
#   k3v4:    K 128*3/8 + 2 = 50       + V 66               -> 116
#   3bit:    K 50                     + V 50               -> 100
#   k4v3:    K 66                     + V 50               -> 116
#   3p5bit:  K 64*4/8 + 64*3/8 + 2 = 58 + V 58             -> 116
#   k3v2:    K 50                     + V 128*2/8 + 2 = 34 -> 84
#   2p5bit:  K 64*3/8 + 64*2/8 + 2 = 42 + V 42             -> 84
#   2bit:    K 34                     + V 34               -> 68
BYTES_D128 = {
    "turboquant_k8v4": 194,
    "turboquant_4bit_nc": 132,
    "turboquant_k3v4_nc": 116,
    "turboquant_3bit_nc": 100,
    "turboquant_k4v3_nc": 116,
    "turboquant_3p5bit_nc": 116,
    "turboquant_k3v2_nc": 84,
    "turboquant_2p5bit_nc": 84,
    "turboquant_2bit_nc": 68,
}
STOCK_NAMES = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def test_table_bytes_at_d128():
    assert {n: f.bytes_per_token_per_head(128) for n, f in KV_FORMATS.items()} == BYTES_D128
    assert [KV_FORMATS[n].bytes_per_token_per_head(128) for n in format_names()] == [194, 132, 116, 100, 116, 116,
                                                                                      84, 84, 68]


def test_key_and_value_bytes_at_d128():
    f = get_format("turboquant_k3v4_nc")
    assert (f.key_bytes(128), f.value_bytes(128)) == (50, 66)
    f = get_format("turboquant_k4v3_nc")
    assert (f.key_bytes(128), f.value_bytes(128)) == (66, 50)
    f = get_format("turboquant_k8v4")
    assert (f.key_bytes(128), f.value_bytes(128)) == (128, 66)
    assert get_format("turboquant_2p5bit_nc").key.index_bytes(128) == 40


def test_stock_names_present_with_stock_origin():
    for n in STOCK_NAMES:
        assert n in KV_FORMATS and get_format(n).origin == "stock"
    assert {f.origin for f in KV_FORMATS.values()} == {"stock", "new"}
    assert [n for n, f in KV_FORMATS.items() if f.origin == "new"] == [
        "turboquant_k4v3_nc", "turboquant_3p5bit_nc", "turboquant_k3v2_nc", "turboquant_2p5bit_nc",
        "turboquant_2bit_nc"]


def test_stock_bit_meaning():
    assert get_format("turboquant_k3v4_nc").key.bits == 3 and get_format("turboquant_k3v4_nc").value.bits == 4
    assert get_format("turboquant_k8v4").key == Fp8Component() and get_format("turboquant_k8v4").value.bits == 4
    assert all(f.key.norm_correction and f.value.norm_correction for n, f in KV_FORMATS.items() if n.endswith("_nc"))


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_format("turboquant_5bit")
    msg = str(e.value)
    assert "'turboquant_5bit'" in msg
    for n in KV_FORMATS:
        assert n in msg


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_bytes_positive_below_bf16_and_consistent(dim):
    for f in KV_FORMATS.values():
        n = f.bytes_per_token_per_head(dim)
        assert 0 < n < 2 * BF16_BYTES * dim
        assert n == f.key_bytes(dim) + f.value_bytes(dim)
        assert f.compression_vs_bf16(dim) == pytest.approx(4 * dim / n)
        assert f.compression_vs_bf16(dim) > 1
        for comp in (f.key, f.value):
            if comp.has_codebook:
                assert comp.index_bytes(dim) == dim * comp.bits / 8  # exact: no padding in planar8
                assert comp.scale_bytes() == 2
            else:
                assert comp.index_bytes(dim) == dim and comp.scale_bytes() == 0


def test_unsupported_head_dim_in_bytes():
    with pytest.raises(ValueError, match="supported head dims"):
        get_format("turboquant_3bit_nc").bytes_per_token_per_head(100)


def test_quantizers_follow_the_format():
    f = get_format("turboquant_k8v4")
    assert isinstance(f.key_quantizer(128), FP8Quantizer)
    vq = f.value_quantizer(128)
    assert isinstance(vq, MSEQuantizer) and vq.bits == 4 and vq.seed == f.value_seed
    assert f.key_seed != f.value_seed
    kq = get_format("turboquant_2p5bit_nc").key_quantizer(80)
    assert kq.segments == ((40, 3), (40, 2)) and kq.norm_correction
    x = torch.randn(3, 80)
    assert kq.dequantize(kq.quantize(x)).shape == (3, 80)


def test_describe_and_segments():
    assert CodebookComponent(3.5).describe() == "3.5-bit Lloyd-Max +nc"
    assert CodebookComponent(3, norm_correction=False).describe() == "3-bit Lloyd-Max"
    assert Fp8Component().describe() == "fp8 e4m3 (rotated)"
    assert CodebookComponent(2.5).segments(64) == ((32, 3), (32, 2))
    with pytest.raises(ValueError, match="no codebook segments"):
        Fp8Component().segments(64)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_fp8_component_row(dim):
    c = Fp8Component()
    assert (c.kind, c.bits, c.norm_correction) == ("fp8", 8, False)
    assert c.is_fp8 and not c.has_codebook and not c.stores_scale and not c.centerable
    assert c.kernel_bits == 4  # the paged kernels borrow a single-segment 4-bit codec's rotation rows
    assert c.index_bytes(dim) == dim and c.scale_bytes() == 0
    assert c.bytes_per_vector(dim) == dim and c.bits_per_coordinate(dim) == 8.0
    with pytest.raises(ValueError, match="no codebook segments"):
        c.segments(dim)
    q = c.quantizer(dim, 5)
    assert isinstance(q, FP8Quantizer)
    assert q.dequantize(q.quantize(torch.randn(2, dim))).shape == (2, dim)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 2.5, 3, 3.5, 4])
def test_codebook_component_row(dim, bits):
    c = CodebookComponent(bits)
    assert (c.kind, c.bits, c.norm_correction) == ("mse", bits, True)
    assert c.has_codebook and c.stores_scale and c.centerable and not c.is_fp8
    assert c.kernel_bits == bits
    segs = c.segments(dim)
    assert sum(n for n, _ in segs) == dim and len(segs) == (1 if bits == int(bits) else 2)
    assert c.index_bytes(dim) == sum(packed_bytes(n, b) for n, b in segs) == dim * bits / 8
    assert c.scale_bytes() == NORM_BYTES == 2
    assert c.bytes_per_vector(dim) == dim * bits / 8 + 2
    assert c.bits_per_coordinate(dim) == pytest.approx(bits + 16 / dim)
    q = c.quantizer(dim, 5)
    assert isinstance(q, MSEQuantizer) and (q.bits, q.norm_correction, q.seed) == (bits, True, 5)
    assert not CodebookComponent(bits, norm_correction=False).quantizer(dim, 5).norm_correction


def test_components_are_frozen_values():
    with pytest.raises(TypeError):
        ComponentFormat()  # the base only states the interface
    assert isinstance(Fp8Component(), ComponentFormat) and isinstance(CodebookComponent(3), ComponentFormat)
    assert CodebookComponent(3) == CodebookComponent(3) and hash(CodebookComponent(3)) == hash(CodebookComponent(3))
    assert CodebookComponent(3) != CodebookComponent(3, norm_correction=False)
    assert Fp8Component() == Fp8Component() and Fp8Component() != CodebookComponent(8, norm_correction=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CodebookComponent(3).bits = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fp8Component().kind = "mse"


# A component's kind compared as a string, or "mse"/"fp8" literals compared: callers ask the component instead.
_KIND_BRANCH = re.compile(
    r"""\.kind\s*(==|!=|in\b|not\s+in\b)"""
    r"""|(==|!=)\s*["'](mse|fp8)["']|["'](mse|fp8)["']\s*(==|!=)"""
    r"""|\bin\s*[(\[{]\s*["'](mse|fp8)["']"""
)


def test_no_caller_branches_on_a_kind_string():
    root = Path(turboquant_core.__file__).parent
    skip = {root / "formats.py", root / "gguf_convert.py"}  # gguf_convert: ``kind`` is a GGUF value type
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}"
            for p in sorted(root.rglob("*.py")) if p not in skip
            for i, line in enumerate(p.read_text().splitlines(), 1) if _KIND_BRANCH.search(line)]
    assert not hits, "branch on the component's properties, not its kind:\n" + "\n".join(hits)
    for line in ('if fmt.key.kind == "fp8":', "if c.kind not in ('mse', 'fp8'):", 'x = 4 if kind == "fp8" else b'):
        assert _KIND_BRANCH.search(line), line


def test_table_invariants():
    for name, f in KV_FORMATS.items():
        assert isinstance(f, KVFormat) and f.name == name and name.startswith("turboquant_")
        assert f.packing == PACKING_LAYOUT
        assert name not in RETIRED_FORMATS
    assert len(set(format_names())) == len(KV_FORMATS) == 9


# One token's MLA entry per layer (kv_lora_rank 512, rope 64), by hand: the latent in the preset's key encoding
# (512 * bits / 8 index bytes, + a 2-byte fp16 scale for codebooks; fp8: 512 bytes, no scale) + 64 bf16 of k_pe.
MLA_BYTES = {
    "turboquant_k8v4": 512 + 128,
    "turboquant_4bit_nc": 256 + 2 + 128,
    "turboquant_k3v4_nc": 192 + 2 + 128,
    "turboquant_3bit_nc": 192 + 2 + 128,
    "turboquant_k4v3_nc": 256 + 2 + 128,
    "turboquant_3p5bit_nc": 128 + 96 + 2 + 128,  # 256 rotated coordinates at 4 bits, 256 at 3
    "turboquant_k3v2_nc": 192 + 2 + 128,
    "turboquant_2p5bit_nc": 96 + 64 + 2 + 128,
    "turboquant_2bit_nc": 128 + 2 + 128,
}


def test_mla_entry_bytes_by_hand():
    assert {n: mla_format(n).bytes_per_token() for n in KV_FORMATS} == MLA_BYTES
    assert mla_baseline_bytes() == {"bf16": 1152, "fp8": 576, "fp8_ds_mla": 656}
    f = mla_format("turboquant_k3v4_nc")
    assert f.entry_sections() == (("latent_index", 192), ("k_pe", 128), ("latent_scale", 2))
    assert mla_format("turboquant_k8v4").entry_sections() == (("latent_index", 512), ("k_pe", 128))
    assert (f.head_size, f.seed, f.latent) == (576, get_format("turboquant_k3v4_nc").key_seed, CodebookComponent(3))
    assert f.compression_vs("bf16") == pytest.approx(1152 / 322) and f.compression_vs("fp8") == pytest.approx(576 / 322)
    assert f.compression_vs("fp8_ds_mla") == pytest.approx(656 / 322)
    # The latent takes the key's encoding: presets with equal keys share the MLA entry.
    assert mla_format("turboquant_k4v3_nc") == MLAFormat(get_format("turboquant_k4v3_nc"))
    assert mla_format("turboquant_k4v3_nc").latent == mla_format("turboquant_4bit_nc").latent


def test_mla_other_ranks_and_bad_shapes():
    f = mla_format("turboquant_2bit_nc", kv_lora_rank=256, rope_dim=32)
    assert f.bytes_per_token() == 64 + 2 + 64 and mla_baseline_bytes(256, 32)["fp8_ds_mla"] == 256 + 8 + 64
    with pytest.raises(ValueError, match="head_dim 500 is not supported"):
        mla_format("turboquant_2bit_nc", kv_lora_rank=500)
    with pytest.raises(ValueError, match="rope_dim must be a positive multiple of 8"):
        mla_format("turboquant_2bit_nc", rope_dim=60)
    with pytest.raises(ValueError, match="valid formats"):
        mla_format("turboquant_9bit")
    assert isinstance(mla_format("turboquant_4bit_nc").latent_quantizer(), MSEQuantizer)
    assert isinstance(mla_format("turboquant_k8v4").latent_quantizer(), FP8Quantizer)

# SPDX-License-Identifier: Apache-2.0
"""The RTN control (eval/tq_eval/rtn.py): the quantizer against hand-computed codes and values, and the
fake-quantized model folder: which tensors change and into what, what is copied as it is, that the source is
only read, that a finished folder is reused, and that a failure leaves nothing behind."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tq_eval import rtn

# ----------------------------------------------------------------------------- the quantizer

# Group size 4 so the groups can be followed by hand; 10 inputs: two full groups and one of 2 weights + 2 zeros.
W4 = torch.tensor([[3.75, -1.0, 0.26, -3.75, 0.0, 0.0, 0.0, 0.0, 1.5, -0.2],
                   [-0.7, 0.35, 0.0, 0.1, 1e-9, -1e-9, 0.0, 0.0, 0.0, 0.0]])


def test_4bit_codes_scales_and_values_by_hand():
    q, scale = rtn.rtn_quantize(W4, bits=4, group_size=4)
    # maxq 15, zero 8. Row 0, group 0: amax 3.75, scale 7.5 / 15 = 0.5 (exact in fp16); w / scale =
    # 7.5, -2, 0.52, -7.5 -> round half to even 8, -2, 1, -8 -> + 8 = 16 (clamped to 15), 6, 9, 0.
    # Group 1: all zeros, scale 1, every code the zero point. Group 2 (padded): amax 1.5, 3 / 15 = 0.2 is
    # 0.199951171875 in fp16; 1.5 / that = 7.5018 -> 8 -> 15 (clamped); -0.2 / that = -1.0002 -> -1 -> 7; the two
    # padding zeros -> 8 (they are cut off again below).
    # Row 1, group 0: amax 0.7, 1.4 / 15 = 0.09333 is 1529 / 16384 = 0.09332275390625 in fp16, and -0.7 divided
    # by the fp16 scale is -7.5008 -> -8 -> 0 (divided by the unrounded one it would sit on the tie, -7.5).
    # Group 1: amax 1e-9, its scale underflows fp16 to 0: treated as zeros (scale 1).
    assert q.dtype == torch.uint8 and q.shape == (2, 3, 4)
    assert q.tolist() == [[[15, 6, 9, 0], [8, 8, 8, 8], [15, 7, 8, 8]],
                          [[0, 12, 8, 9], [8, 8, 8, 8], [8, 8, 8, 8]]]
    assert scale.dtype == torch.float16
    assert scale.float().tolist() == [[0.5, 1.0, 0.199951171875], [0.09332275390625, 1.0, 1.0]]
    s = 0.09332275390625
    want = [[3.5, -1.0, 0.5, -4.0, 0.0, 0.0, 0.0, 0.0, 7 * 0.199951171875, -0.199951171875],
            [-8 * s, 4 * s, 0.0, s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    w_hat = rtn.rtn_fake_quant(W4, bits=4, group_size=4)
    assert w_hat.shape == W4.shape and w_hat.dtype == W4.dtype
    assert w_hat.tolist() == want  # bit-exact: every value is a small integer times an fp16 scale


def test_3bit_by_hand():
    # maxq 7, zero 4. amax 1: 2 / 7 = 0.285714 is 1170 / 4096 = 0.28564453125 in fp16; w / scale = 3.5009,
    # -3.5009, 1.7504, 0.7002 -> 4, -4, 2, 1 -> + 4 = 8 (clamped to 7), 0, 6, 5.
    w = torch.tensor([[1.0, -1.0, 0.5, 0.2]])
    q, scale = rtn.rtn_quantize(w, bits=3, group_size=4)
    assert q.tolist() == [[[7, 0, 6, 5]]] and scale.float().tolist() == [[0.28564453125]]
    s = 0.28564453125
    assert rtn.rtn_fake_quant(w, bits=3, group_size=4).tolist() == [[3 * s, -4 * s, 2 * s, s]]


def test_bf16_in_bf16_out_and_row_steps_do_not_change_the_result(monkeypatch):
    w = (torch.randn(37, 300, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    q, scale = rtn.rtn_quantize(w, 4)
    assert q.shape == (37, 3, 128) and scale.shape == (37, 3)  # 300 inputs: 3 groups, the last padded
    one_step = rtn.rtn_dequantize(q, scale, 4, 300, torch.bfloat16)
    monkeypatch.setattr(rtn, "ROWS_PER_STEP", 5)
    w_hat = rtn.rtn_fake_quant(w, 4)
    assert w_hat.dtype == torch.bfloat16 and torch.equal(w_hat, one_step)
    # at most 16 levels per group, and the group's largest weight is reproduced to within half a step
    assert all(len(set(row[g * 128:(g + 1) * 128].tolist())) <= 16 for row in w_hat.float() for g in range(3))
    err = (w_hat.float() - w.float()).abs().amax(dim=1)
    assert bool((err <= scale.float().amax(dim=1) * 1.01).all())


def test_bytes_match_the_tq_formats():
    from turboquant_core.formats import WEIGHT_FORMATS, WEIGHT_GROUP_SIZE

    assert rtn.GROUP_SIZE == WEIGHT_GROUP_SIZE
    for fmt in WEIGHT_FORMATS.values():
        assert rtn.bytes_per_group(fmt.bits) == fmt.bytes_per_group()
    assert (rtn.bytes_per_group(4), rtn.bytes_per_group(3)) == (66, 50)


def test_refuses_what_it_cannot_round():
    with pytest.raises(ValueError, match="2-D"):
        rtn.rtn_quantize(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="bits must be 2..8"):
        rtn.rtn_quantize(torch.zeros(2, 4), 1)


# ----------------------------------------------------------------------------- the model folder

def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_folder_rounds_exactly_the_projections(tmp_path, hub_model, arch, folder_tensors, folder_digest):
    src = tmp_path / "src"
    tensors = hub_model(src, arch)
    before = folder_digest(src)
    res = rtn.write_rtn_folder(src, tmp_path / "rtn4", 4, progress=False)
    assert folder_digest(src) == before  # the source is only read
    dest = tmp_path / "rtn4"
    projections = sorted(n for n in tensors if n.endswith("_proj.weight"))
    assert len(projections) == 14 and res.built and sorted(res.quantized) == projections
    out = folder_tensors(dest)
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        if name in projections:
            assert out[name].dtype == torch.bfloat16
            assert _same_bytes(out[name], rtn.rtn_fake_quant(t, 4)), name
            assert not torch.equal(out[name], t), name
        else:  # embeddings, output head, norms, the bias: the same bytes
            assert _same_bytes(out[name], t), name
    after = folder_digest(dest)
    for same in ("config.json", "tokenizer.json", "model.safetensors.index.json",
                 "model-00003-of-00003.safetensors"):  # the shard without projections is copied as it is
        assert after[same] == before[same], same
    assert "quantization_config" not in json.loads((dest / "config.json").read_text())  # served as the plain model
    manifest = json.loads((dest / rtn.MANIFEST).read_text())
    assert (manifest["bits"], manifest["group_size"], manifest["source"]) == (4, 128, str(src.resolve()))


def test_folder_is_reused_until_the_source_changes(tmp_path, hub_model):
    src = tmp_path / "src"
    hub_model(src, "llama")
    dest = tmp_path / "cache" / "m__rtn3"
    assert rtn.write_rtn_folder(src, dest, 3, progress=False).built
    stamp = (dest / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    again = rtn.write_rtn_folder(src, dest, 3, progress=False)
    assert not again.built and len(again.quantized) == 14
    assert (dest / "model-00001-of-00003.safetensors").stat().st_mtime_ns == stamp
    # Different bits in the same place, or a changed source file: rebuilt.
    assert rtn.write_rtn_folder(src, dest, 4, progress=False).built
    assert json.loads((dest / rtn.MANIFEST).read_text())["bits"] == 4
    shard = src / "model-00002-of-00003.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert rtn.write_rtn_folder(src, dest, 4, progress=False).built
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m__rtn3"]  # no temporary or old folders left


def test_failures_leave_nothing_behind(tmp_path, hub_model, folder_digest):
    src = tmp_path / "src"
    hub_model(src, "llama")
    before = folder_digest(src)
    # A file that cannot be read (a link to a missing blob, as in a damaged hub cache): fails while copying.
    (src / "special_tokens_map.json").symlink_to(tmp_path / "missing-blob")
    with pytest.raises(FileNotFoundError):
        rtn.write_rtn_folder(src, tmp_path / "out" / "a", 4, progress=False)
    (src / "special_tokens_map.json").unlink()
    # Projections that are not floating point: refused after every shard was written to the temporary folder.
    ints = tmp_path / "ints"
    ints.mkdir()
    for p in src.iterdir():
        (ints / p.name).write_bytes(p.read_bytes())
    for shard in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
        t = _read_one(ints / shard)
        save_file({k: (v.to(torch.int8) if k.endswith("_proj.weight") else v) for k, v in t.items()}, str(ints / shard))
    with pytest.raises(ValueError, match="no 2-D floating-point projection weights"):
        rtn.write_rtn_folder(ints, tmp_path / "out" / "b", 4, progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # neither a partial folder nor a temporary one
    # A folder that is not an RTN control is never replaced; the source itself is refused as the destination.
    (tmp_path / "out" / "c").mkdir()
    (tmp_path / "out" / "c" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an RTN control folder"):
        rtn.write_rtn_folder(src, tmp_path / "out" / "c", 4, progress=False)
    assert (tmp_path / "out" / "c" / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="overlaps the source"):
        rtn.write_rtn_folder(src, src / "rtn", 4, progress=False)
    with pytest.raises(ValueError, match="overlaps the source"):
        rtn.write_rtn_folder(src, tmp_path, 4, progress=False)
    assert folder_digest(src) == before


def _read_one(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_refuses_a_quantized_or_non_safetensors_source(tmp_path, hub_model):
    from turboquant_core.integrations.quantize_checkpoint import CheckpointError

    src = tmp_path / "src"
    hub_model(src, "gemma3")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match=r"already quantized \(fp8\)"):
        rtn.write_rtn_folder(src, tmp_path / "a", 4, progress=False)
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    (bin_only / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="only safetensors"):
        rtn.write_rtn_folder(bin_only, tmp_path / "b", 4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "src"]

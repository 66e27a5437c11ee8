# SPDX-License-Identifier: Apache-2.0
"""GGUF conversion: the SentencePiece-BPE tokenizer rebuild and the converter's refusals."""

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from turboquant_core.integrations.gguf_convert import (  # noqa: E402
    GGUFFileError,
    build_spm_bpe_tokenizer,
    check_gguf_file,
    convert_gguf,
    needs_spm_bpe_rebuild,
    spm_bpe_merges,
)

# A miniature SentencePiece-BPE vocabulary: control tokens, bytes, pieces whose scores are merge ranks.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<0x41>", "a", "b", "c", "\u2581", "ab", "\u2581a", "abc", "\u2581ab",
          "<start_of_turn>"]
TYPES = [3, 3, 3, 2, 6, 1, 1, 1, 1, 1, 1, 1, 1, 4]
SCORES = [0.0, 0.0, 0.0, 0.0, 0.0, -5, -6, -7, -8, -1.0, -2.0, -3.0, -4.0, 0.0]


def test_merges_follow_scores():
    merges = spm_bpe_merges(TOKENS, SCORES, TYPES)
    # "ab" (score -1) merges first, then "▁a", "abc", "▁ab" (two splits: ▁+ab and ▁a+b).
    assert merges[0] == ("a", "b")
    assert merges[1] == ("\u2581", "a")
    assert ("ab", "c") in merges and ("\u2581", "ab") in merges and ("\u2581a", "b") in merges
    assert all(a in TOKENS and b in TOKENS for a, b in merges)


def test_tokenizer_encodes_with_bos_and_round_trips():
    tk = build_spm_bpe_tokenizer(TOKENS, SCORES, TYPES, bos_id=2, add_bos=True)
    enc = tk.encode("abc ab")
    assert enc.ids[0] == 2
    assert enc.tokens[1:] == ["abc", "\u2581ab"]
    assert tk.decode(enc.ids, skip_special_tokens=True) == "abc ab"
    assert tk.encode("<start_of_turn>a").tokens[1:] == ["<start_of_turn>", "a"]
    # An unknown character falls back to bytes when the byte piece exists, else <unk>.
    assert "<0x41>" in tk.encode("A").tokens
    assert build_spm_bpe_tokenizer(TOKENS, SCORES, TYPES, bos_id=2, add_bos=False).encode("ab").ids == [9]


def _write_tokenizer_gguf(path, arch="gemma3"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([float(s) for s in SCORES])
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_rebuild_detection(tmp_path):
    _write_tokenizer_gguf(tmp_path / "g.gguf")
    assert needs_spm_bpe_rebuild(gguf.GGUFReader(str(tmp_path / "g.gguf")))
    _write_tokenizer_gguf(tmp_path / "l.gguf", arch="llama")
    assert not needs_spm_bpe_rebuild(gguf.GGUFReader(str(tmp_path / "l.gguf")))


def test_converter_refusals(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFFileError, match="not a valid GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert bad.read_bytes() == b"not a gguf file at all"  # the source is never touched
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf(bad, tmp_path / "taken")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(bad, tmp_path / "out2", dtype="int8")
    # Nothing half-written next to the destination.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "taken"]


def test_cli_convert_gguf_reports_errors(tmp_path, capsys):
    from turboquant_core.cli import main

    assert main(["convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["convert-gguf"]) == 2  # argparse: src and dest are required


def _data_end(path) -> int:
    return max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(str(path)).tensors)


def test_whole_file_passes_the_check(model_gguf):
    path = model_gguf
    check_gguf_file(path)
    assert _data_end(path) <= path.stat().st_size


def test_truncated_tensor_data_names_the_file_and_both_sizes(model_gguf):
    path = model_gguf
    declared = _data_end(path)
    data = path.read_bytes()
    path.write_bytes(data[: declared - 1000])
    with pytest.raises(GGUFFileError) as e:
        check_gguf_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path} is truncated: the file has {declared - 1000:,} bytes, but its header declares "
                          f"tensor data up to byte {declared:,}")
    assert "2 of 2 tensors run past the end, starting with 'token_embd.weight'" in msg
    assert "\n" not in msg
    # What the check replaces: gguf's own reader fails on this file with a bare numpy error.
    with pytest.raises(ValueError, match="cannot reshape"):
        gguf.GGUFReader(str(path))


def test_file_ending_inside_its_header(model_gguf):
    path = model_gguf
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(GGUFFileError, match=r"m\.gguf is truncated: the file \(60 bytes\) ends inside its header, "
                                            r"in metadata key"):
        check_gguf_file(path)


@pytest.mark.parametrize("content,reason", [
    (b"", "it has 0 bytes, too few for a GGUF header"),
    (b"PK\x03\x04 a zip archive", "it starts with b'PK\\x03\\x04', not b'GGUF'"),
    (b"GGUF" + (3).to_bytes(4, "little") + (2**60).to_bytes(8, "little") * 2,
     f"it declares {2**60} tensors and {2**60} metadata keys"),
    (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "GGUF version 7; readable versions: 2, 3"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
     + (1).to_bytes(8, "little") + b"k" + (99).to_bytes(4, "little"), "metadata key 'k' has unknown value type 99"),
], ids=["empty", "bad magic", "garbage counts", "unknown version", "unknown value type"])
def test_not_a_gguf_file(tmp_path, content, reason):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFileError) as e:
        check_gguf_file(path)
    assert str(e.value) == f"{path} is not a valid GGUF file: {reason}"


def test_converter_refuses_a_truncated_file_and_leaves_everything_as_it_was(model_gguf, tmp_path):
    src = model_gguf
    src.write_bytes(src.read_bytes()[:-500])
    before = (src.read_bytes(), src.stat().st_mtime_ns)
    with pytest.raises(GGUFFileError, match="is truncated"):
        convert_gguf(src, tmp_path / "out")
    assert (src.read_bytes(), src.stat().st_mtime_ns) == before  # the source is only read
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no destination, no temporary folder


def test_cli_convert_gguf_truncated_is_one_error_line(model_gguf, tmp_path, capsys):
    from turboquant_core.cli import main

    src = model_gguf
    src.write_bytes(src.read_bytes()[:-500])
    assert main(["convert-gguf", str(src), str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"error: {src} is truncated: the file has") and err.count("\n") == 1
    assert "Traceback" not in err and "reshape" not in err

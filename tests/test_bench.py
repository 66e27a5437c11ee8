# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from turboquant_core.bench import bench_codec, copy_bandwidth_gbs, index_bytes, parse_bits


def test_parse_bits():
    assert parse_bits("3,4") == [3.0, 4.0]
    assert parse_bits(" 2.5 ") == [2.5]
    for bad in ("5", "3,x", "1", ""):
        with pytest.raises(ValueError, match="valid bits: 2, 2.5, 3, 3.5, 4"):
            parse_bits(bad)


def test_index_bytes():
    assert index_bytes(128, 3) == 48
    assert index_bytes(128, 2.5) == 40
    assert index_bytes(80, 3.5) == 35


def test_copy_bandwidth_small_buffer():
    c = copy_bandwidth_gbs(torch.device("cpu"), nbytes=1 << 20)
    assert c["bytes"] == 1 << 20 and c["ms"] > 0
    assert c["gbs"] == pytest.approx(2 * c["bytes"] / (c["ms"] * 1e-3) / 1e9)


def test_cpu_bench_reports_reference_numbers_with_a_warning():
    with pytest.warns(UserWarning, match="no CUDA device"):
        res = bench_codec(48, dim=64, bits=[3, 2.5], device=torch.device("cpu"), command="tq bench --test")
    assert res["backend"] == "reference" and res["device_type"] == "cpu"
    assert res["torch"] == torch.__version__ and res["command"] == "tq bench --test"
    assert res["date"].endswith("+00:00") and res["copy"]["gbs"] > 0
    assert [(r["op"], r["bits"]) for r in res["results"]] == [("encode", 3), ("decode", 3), ("encode", 2.5),
                                                              ("decode", 2.5)]
    for r in res["results"]:
        ib = index_bytes(64, r["bits"])
        assert r["index_bytes"] == ib
        assert r["bytes_moved"] == 48 * 64 * 2 + 48 * (ib + 2)
        assert r["vectors_per_s"] == pytest.approx(48 / (r["ms"] * 1e-3))
        assert r["gbs"] == pytest.approx(r["bytes_moved"] / (r["ms"] * 1e-3) / 1e9)
        assert r["fraction_of_copy"] == pytest.approx(r["gbs"] / res["copy"]["gbs"])


def test_bench_argument_errors():
    with pytest.raises(ValueError, match="supported head dims"):
        bench_codec(10, dim=100, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="must be positive"), pytest.warns(UserWarning):
        bench_codec(0, dim=64, device=torch.device("cpu"))


@pytest.mark.gpu
def test_cuda_bench_times_the_kernels():
    res = bench_codec(4096, dim=128, bits=[4], device=torch.device("cuda"))
    assert res["backend"] == "triton" and res["device_type"] == "cuda"
    assert all(r["gbs"] > 0 and r["fraction_of_copy"] > 0 for r in res["results"])

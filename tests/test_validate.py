# SPDX-License-Identifier: Apache-2.0
import pytest
import torch

from turboquant_core.codebooks import lloyd_max_codebook
from turboquant_core.formats import CodebookComponent, Fp8Component
from turboquant_core.validate import (
    CHUNK_ROWS,
    resolve_backend,
    run_validation,
    theory_mse,
    unit_vector_chunks,
    validate_presets,
    validate_qjl,
)

CPU = torch.device("cpu")


def test_theory_mse():
    assert theory_mse(CodebookComponent(3), 128) == lloyd_max_codebook(3, 128).mse
    half = 0.5 * (lloyd_max_codebook(3, 64).mse + lloyd_max_codebook(2, 64).mse)
    assert theory_mse(CodebookComponent(2.5), 64) == pytest.approx(half)
    assert theory_mse(Fp8Component(), 64) is None


def test_resolve_backend(monkeypatch):
    assert resolve_backend("auto", CPU) == "reference"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("reference", torch.device("cuda")) == "reference"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", CPU) == "triton"
    with pytest.raises(ValueError, match="valid backends: auto, triton, reference"):
        resolve_backend("cuda", CPU)


def test_unit_vector_chunks_are_deterministic_unit_and_correlated():
    chunks = list(unit_vector_chunks(CHUNK_ROWS + 5, 64, seed=3, device=CPU))
    assert [len(x) for x, _ in chunks] == [CHUNK_ROWS, 5]
    x, q = chunks[1]
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(5))
    torch.testing.assert_close(q.norm(dim=-1), torch.ones(5))
    again = list(unit_vector_chunks(CHUNK_ROWS + 5, 64, seed=3, device=CPU))[1][0]
    assert torch.equal(x, again)
    x0, q0 = chunks[0]
    assert (x0 * q0).sum(-1).mean().item() == pytest.approx(0.707, abs=0.01)


@pytest.fixture(scope="module")
def rows_d128():
    return validate_presets(["turboquant_k3v4_nc", "turboquant_2bit_nc"], [128], 20_000,
                            backend="reference", device=CPU, tolerance=0.03, progress=False)


def test_presets_within_three_percent_of_theory_at_d128(rows_d128):
    assert [(r["preset"], r["component"]) for r in rows_d128] == [
        ("turboquant_k3v4_nc", "K"), ("turboquant_k3v4_nc", "V"), ("turboquant_2bit_nc", "K"),
        ("turboquant_2bit_nc", "V")]
    for r in rows_d128:
        assert r["ok"], r
        assert r["backend"] == "reference" and r["vectors"] == 20_000
        if r["theory_mse"] is not None:
            assert abs(r["rel_dev"]) <= 0.03
            assert r["rel_dev"] == pytest.approx(r["mse"] / r["theory_mse"] - 1)
    by = {(r["preset"], r["component"]): r for r in rows_d128}
    assert by["turboquant_2bit_nc", "K"]["theory_mse"] == pytest.approx(0.1160, abs=1e-4)
    assert by["turboquant_k3v4_nc", "K"]["theory_mse"] == pytest.approx(0.03397, abs=1e-5)
    assert by["turboquant_k3v4_nc", "V"]["theory_mse"] == pytest.approx(0.009315, abs=1e-5)


def test_fp8_rows_and_shared_components():
    rows = validate_presets(["turboquant_k8v4", "turboquant_4bit_nc"], [64], 2000, backend="reference", device=CPU,
                            progress=False)
    by = {(r["preset"], r["component"]): r for r in rows}
    fp8 = by["turboquant_k8v4", "K"]
    # fp8 keys: no codebook theory, error far below every codebook's.
    assert fp8["theory_mse"] is None and fp8["rel_dev"] is None and fp8["ok"]
    assert 0 < fp8["mse"] < 0.002 and fp8["encoding"] == "fp8 e4m3 (rotated)"
    # Same encoding and seed -> measured once, same numbers.
    assert by["turboquant_k8v4", "V"]["mse"] == by["turboquant_4bit_nc", "V"]["mse"]
    assert by["turboquant_4bit_nc", "K"]["mse"] != by["turboquant_4bit_nc", "V"]["mse"]  # other rotation seed


def test_mse_quantizers_shrink_inner_products(rows_d128):
    for r in rows_d128:
        if r["theory_mse"] is not None:
            assert r["ip_z"] < -20  # about -D/2 <q, x> with norm correction
            assert r["ip_mean"] == pytest.approx(-0.5 * 0.707 * r["theory_mse"], rel=0.25)


def test_tolerance_flags_failures():
    rows = validate_presets(["turboquant_3bit_nc"], [64], 2000, backend="reference", device=CPU, tolerance=1e-6,
                            progress=False)
    assert not any(r["ok"] for r in rows)


def test_triton_backend_agrees_with_reference(device):
    # CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1); CUDA: the compiled kernels.
    kwargs = dict(presets=["turboquant_2p5bit_nc"], dims=[64], n_vectors=300, device=torch.device(device),
                  progress=False)
    ref = validate_presets(backend="reference", **kwargs)
    tri = validate_presets(backend="triton", **kwargs)
    for a, b in zip(ref, tri):
        assert b["backend"] == "triton"
        # Near-boundary flips are between equidistant centroids: the error barely moves.
        assert b["mse"] == pytest.approx(a["mse"], rel=1e-4)
        assert b["ip_mean"] == pytest.approx(a["ip_mean"], rel=1e-3, abs=1e-6)


def test_qjl_rows_unbiased_where_mse_is_not():
    rows = validate_qjl([64], 6000, seed=1, bits=(2, 3), device=CPU, progress=False)
    assert [(r["dim"], r["bits"]) for r in rows] == [(64, 2), (64, 3)]
    for r in rows:
        assert r["unbiased"] and abs(r["ip_z"]) < 4
        assert r["mse_only_ip_z"] < -20
        assert r["ip_stderr"] == pytest.approx(r["ip_std"] / 6000**0.5)


def test_run_validation_summary_and_errors():
    res = run_validation(["turboquant_3bit_nc"], [64], 500, backend="reference", qjl=False, progress=False)
    assert res["ok"] and res["backend"] == "reference" and res["qjl"] == [] and len(res["presets"]) == 2
    with pytest.raises(ValueError, match="at least 2"):
        run_validation(["turboquant_3bit_nc"], [64], 1)
    with pytest.raises(ValueError, match="valid formats"):
        run_validation(["turboquant_9bit"], [64], 100)
    with pytest.raises(ValueError, match="supported head dims"):
        run_validation(["turboquant_3bit_nc"], [100], 100)

"""`ktrans bench kernels`: the case registry and the report, on the CPU (timings there are only a smoke run)."""
import pytest
import torch

from ktrans.bench import kernels


def test_cases_run_and_report(monkeypatch, capsys):
    calls = []

    def setup(dev):
        x = torch.ones(1000, device=dev)
        return kernels.Timed(fn=lambda: calls.append(x.sum()), bytes=x.numel() * 4)

    def broken(dev):
        raise ValueError("bad shape")

    monkeypatch.setattr(kernels, "CASES", [kernels.KernelCase("demo", "sum n=1000", setup),
                                           kernels.KernelCase("demo", "broken", broken),
                                           kernels.KernelCase("other", "skipped by family", setup)])
    # a family whose optional package is missing is reported skipped; a name missing from ktrans itself raises
    monkeypatch.setattr(kernels, "FAMILIES", ("ktrans.bench.no_such_family",))
    with pytest.raises(ImportError, match="no_such_family"):
        kernels.run(["demo"], None, reps=3, as_json=True, device="cpu")
    monkeypatch.setattr(kernels, "FAMILIES", ("no_such_package_family",))
    rows = kernels.run(["demo"], None, reps=3, as_json=True, device="cpu")
    by_case = {r.get("case"): r for r in rows}
    assert by_case["sum n=1000"]["bytes"] == 4000 and by_case["sum n=1000"]["us"] > 0 and len(calls) == 1
    assert "ValueError: bad shape" in by_case["broken"]["error"]
    assert "skipped by family" not in by_case
    assert any("skipped" in r and "no_such_package_family" in r["skipped"] for r in rows)
    assert capsys.readouterr().out.count("\n") == len(rows)
    # --match A|B: cases whose name contains either
    picked = kernels.run(None, "n=1000|by family", reps=1, as_json=True, device="cpu")
    assert {r.get("case") for r in picked if "case" in r} == {"sum n=1000", "skipped by family"}


def test_quant_family_registers_its_cases_and_runs_the_small_one(capsys):
    """The quant family's cases exist (the GPU runs them); the one small enough runs interpreted here and reports
    the packed weight bytes; the full-size ones say they need CUDA."""
    import pytest

    pytest.importorskip("triton")
    import ktrans.bench.kernels_quant  # noqa: F401  registers the cases

    names = [c.name for c in kernels.CASES if c.family == "quant"]
    for want in ("gemv q4_k deltanet layer projections M=1", "gemm q4_k in_proj_qkvz [12288x2048] M=4096",
                 "moe q4_k layer E=512 top-10 B=1", "moe q4_k layer E=512 top-10 B=16",
                 "moe q4_k layer E=512 top-10 B=256"):
        assert want in names
    rows = kernels.run(["quant"], "in_proj_ba", reps=1, as_json=True, device="cpu")
    small = next(r for r in rows if r.get("case") == "gemv q4_k deltanet.in_proj_ba [64x2048] M=1")
    assert small["bytes"] == 64 * 2048 * 148 // 256 + (2048 + 64) * 2, small
    rows = kernels.run(["quant"], "moe q4_k layer E=512 top-10 B=1", reps=1, as_json=True, device="cpu")
    assert "CUDA only" in rows[-1]["error"]

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


def test_stream_copies_exceed_twice_the_l2(monkeypatch):
    """The streamed timing's copies: enough that together they exceed twice the L2 (each call cold), at least 2, at
    most STREAM_MAX_COPIES (a small kernel's copies then fit the L2; the row says streamed_cold false)."""
    monkeypatch.setattr(kernels, "_l2_bytes", lambda dev: 50 << 20)
    dev = torch.device("cpu")
    layer = 22_600_000  # a DeltaNet layer's three Q4_K projections
    n = kernels.stream_copies(layer, dev)
    assert n * layer >= 2 * (50 << 20) and (n - 2) * layer < 2 * (50 << 20)
    assert kernels.stream_copies(1 << 30, dev) == 2  # lm_head-sized: one other copy
    assert kernels.stream_copies(74_000, dev) == kernels.STREAM_MAX_COPIES


def test_cases_with_copies_stream_only_on_cuda():
    """A case that can copy its inputs is timed streamed on CUDA only; on the CPU its row is the smoke run alone."""
    made = []

    def setup(dev):
        x = torch.ones(10, device=dev)
        return kernels.Timed(fn=lambda: x.sum(), bytes=40, copies=lambda i: made.append(i) or (lambda: x.sum()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "CASES", [kernels.KernelCase("demo", "copies", setup)])
        mp.setattr(kernels, "FAMILIES", ())
        rows = kernels.run(None, None, reps=1, as_json=True, device="cpu")
    assert rows[0]["case"] == "copies" and "streamed_us" not in rows[0] and made == []


@pytest.mark.gpu
def test_streamed_gemv_timing_on_the_gpu():
    """`bench kernels` on CUDA times the quantized GEMV streamed too: n copies of in_proj_qkvz's Q4_K weights (14.2
    MB each) back to back in one graph, together over twice the L2, next to the isolated replay's figure."""
    import ktrans.bench.kernels_quant  # noqa: F401  registers the cases

    rows = kernels.run(["quant"], "deltanet.in_proj_qkvz [12288x2048] M=1", reps=3, as_json=True, device="cuda")
    row = next(r for r in rows if r.get("case") == "gemv q4_k deltanet.in_proj_qkvz [12288x2048] M=1")
    assert "error" not in row and "streamed_error" not in row, row
    assert row["streamed_us"] > 0 and row["streamed_cold"] and row["streamed_copies"] >= 2

"""The gdn family of `ktrans bench kernels` runs end to end on the CPU (interpreted, toy shapes): every case builds
its inputs and calls its kernel without error; the figures themselves are the GPU's (the lead's run)."""
import pytest

from ktrans.bench import kernels

pytest.importorskip("triton")


@pytest.mark.triton
def test_gdn_cases_run(monkeypatch, triton_device):
    import ktrans.bench.kernels_gdn  # noqa: F401  (registers the cases)

    monkeypatch.setattr(kernels, "FAMILIES", ())
    names = {c.name for c in kernels.CASES if c.family == "gdn"}
    assert {"chunked prefill T=8192", "chunked prefill T=32768", "decode B=1", "decode B=64"} <= names
    rows = kernels.run(["gdn"], None, reps=3, as_json=True, device=str(triton_device))
    assert len(rows) == len(names)
    for row in rows:
        assert "error" not in row, row
        assert row["bytes"] > 0 and row["us"] > 0

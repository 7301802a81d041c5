"""`ktrans bench kernels`: the case registry and the report, on the CPU (timings there are only a smoke run)."""
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
    monkeypatch.setattr(kernels, "FAMILIES", ("ktrans.bench.no_such_family",))
    rows = kernels.run(["demo"], None, reps=3, as_json=True, device="cpu")
    by_case = {r.get("case"): r for r in rows}
    assert by_case["sum n=1000"]["bytes"] == 4000 and by_case["sum n=1000"]["us"] > 0 and len(calls) == 1
    assert "ValueError: bad shape" in by_case["broken"]["error"]
    assert "skipped by family" not in by_case
    assert any("skipped" in r and "no_such_family" in r["skipped"] for r in rows)
    assert capsys.readouterr().out.count("\n") == len(rows)

"""Programmatic dependent launch (ktrans.kernels.triton.pdl) on the quantized kernels: a chain of dependent launches
(RMSNorm, the one-row GEMV that loads its first weights before waiting, the GEMV pair, the split-K sums, the MoE's
few-token path, the dense GEMV) gives bitwise the same outputs with and without PDL, eagerly and replayed from a
CUDA graph five times (the fused sums' counters back at zero after each). GPU only, Hopper or newer: the
interpreter cannot run the wait (CI runs these kernels with PDL off, as every other test does)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf.quants")
from tests.kernels.test_quant_triton import _weight  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="programmatic dependent launch needs a Hopper or newer GPU")]
H = 1024


def _chain(ws, x):
    """x -> GEMV (Q4_K, split K) -> GEMV (Q6_K) -> pair -> MoE -> dense GEMV, each on the last one's output through
    an RMSNorm (which keeps the random weights' products in range), three times."""
    from ktrans.kernels.triton.dense_gemv import dense_gemv
    from ktrans.kernels.triton.moe_quant import moe_quant
    from ktrans.kernels.triton.norm import rms_norm
    from ktrans.kernels.triton.quant import qlinear, qlinear_pair

    def norm(t):
        return rms_norm(t, ws["norm"], 1e-6)

    outs = []
    h = x
    for _ in range(3):
        h = qlinear(norm(h), ws["q4"], split=4)
        h = qlinear(norm(h), ws["q6"])
        a, b = qlinear_pair(norm(h), ws["q4"], ws["q4b"], split=2)
        h = moe_quant(norm(a + b[:, :1]), ws["ids"], ws["rw"], ws["gate_up"], ws["down"])
        outs += [h, dense_gemv(norm(h), ws["dense"])]
    return torch.cat([o.float().flatten() for o in outs])


def test_quantized_chain_same_with_pdl(monkeypatch):
    from ktrans.kernels.triton import pdl
    from ktrans.kernels.triton.quant import counters
    from ktrans.kernels.triton.quant_layout import concat_rows
    from tests.kernels.test_moe_quant import _stack

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)  # on the host: the inputs are the same in every run, whatever ran before
    ws = {"norm": (torch.rand(H, generator=gen) + 0.5).to(dev, torch.bfloat16),
          "q4": _weight("Q4_K", H, H, dev, seed=1), "q6": _weight("Q6_K", H, H, dev, seed=2),
          "q4b": _weight("Q4_K", 40, H, dev, seed=3),
          "gate_up": concat_rows([_stack("Q4_K", 256, H, 10, dev), _stack("Q4_K", 256, H, 20, dev)]),
          "down": _stack("Q6_K", H, 256, 30, dev),
          "ids": torch.tensor([[0, 3, 5]], device=dev), "rw": torch.tensor([[0.5, 0.3, 0.2]], device=dev),
          "dense": (torch.randn(96, H, generator=gen) * 0.03).to(dev, torch.bfloat16)}
    x = (torch.randn(1, H, generator=torch.Generator().manual_seed(0)) * 0.5).to(torch.bfloat16).to(dev)
    results = {}
    for on in (False, True):
        monkeypatch.setitem(pdl.PDL, "on", on)
        assert ("launch_pdl" in pdl.launch()) == on
        eager = _chain(ws, x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(ws, x)
        replays = []
        for _ in range(5):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, eager) for r in replays), on
        assert not counters(dev).any()
        results[on] = eager
    assert torch.isfinite(results[True]).all() and torch.equal(results[False], results[True])

"""Programmatic dependent launch (KTRANS_PDL, ktrans.kernels.triton.pdl) changes when the decode path's kernels
launch, never what they compute: under the all-GPU rules and the serve placement (CPU experts on the stream's flag
path), an eager decode step's logits are bitwise those without it, and so are the tokens of three requests served
with CUDA-graph replays (greedy, one joining late; the chaotic random model makes any difference show). GPU only,
Hopper or newer (elsewhere PDL is never used)."""
from __future__ import annotations

import pytest
import torch

from tests.engine.test_graphs import _serve
from tests.engine.test_no_host_sync import _decode_step, _model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="programmatic dependent launch needs a Hopper or newer GPU")]


def _run(rules: str) -> tuple[torch.Tensor, list[list[int]], int]:
    model, runner = _model(rules)
    logits = runner.model(_decode_step(runner)).float().cpu()
    tokens, replays = _serve(model, 3, capture=True)
    return logits, tokens, replays


@pytest.mark.parametrize("rules", ["Qwen3Next-gpu.yaml", "Qwen3Next-serve-cpuexperts.yaml"])
def test_pdl_gives_the_same_logits_and_tokens(rules, monkeypatch):
    from ktrans.kernels.triton import pdl

    monkeypatch.setitem(pdl.PDL, "on", False)
    assert pdl.launch() == {"PDL": False}
    want = _run(rules)
    monkeypatch.setitem(pdl.PDL, "on", True)
    assert pdl.launch() == {"PDL": True, "launch_pdl": True}
    got = _run(rules)
    assert got[2] > 0, "no graph replays"
    assert torch.equal(want[0], got[0]) and want[1] == got[1], rules

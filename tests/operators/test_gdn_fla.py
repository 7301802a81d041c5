"""KGatedDeltaNetFLA (fla-core's kernels: recurrent for decode, chunked for prefill on a GPU) in a whole small
model against KGatedDeltaNetTorch: the same checkpoint, schedule and device, teacher-forced through chunked prefill
(continued from the slots), a mixed step and decode steps (tests/operators/helpers.compare_teacher_forced), as
test_gdn_triton does for the Triton op. Marked `triton`: on the CPU fla-core's recurrent kernel runs under Triton's
interpreter (prefill steps take ours there). Skipped where fla-core does not import (it is in the test extras)."""
from __future__ import annotations

import pytest

from .test_gdn_triton import TOL, matches_torch_op

pytest.importorskip("triton")
pytest.importorskip("fla.ops.gated_delta_rule")
pytestmark = pytest.mark.triton


def test_fla_op_matches_torch_op(tmp_path, triton_device, monkeypatch):
    from ktrans.operators import gdn_fla

    calls = []
    real, chunked = gdn_fla._kernels()
    monkeypatch.setattr(gdn_fla, "_kernels",
                        lambda: (lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw), chunked))
    # On a GPU the prefill steps take fla-core's chunked kernel, whose fp32 matrix products run in tf32 (10-bit
    # mantissas: ~1e-3 relative a product, through 3 layers); a wrong state or gate moves logits by O(1).
    matches_torch_op(tmp_path, triton_device, "KGatedDeltaNetFLA", tol=2e-2 if triton_device.type == "cuda" else TOL)
    assert calls and max(calls) > 1  # the decode steps went through fla-core, several rows at once


def test_missing_fla_core_is_named(monkeypatch):
    import builtins

    from ktrans.operators import gdn_fla

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ImportError("No module named 'fla'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fla)
    with pytest.raises(RuntimeError, match="pip install fla-core"):
        gdn_fla._kernels()

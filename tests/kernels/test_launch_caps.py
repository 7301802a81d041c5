"""The register caps of the quantized kernels' launches (ktrans.kernels.triton.quant._gemv_options,
ktrans.kernels.triton.moe_quant._lanes_cap): a cap goes only to a lane-group launch of a type it was timed at on the
H200 (Q4_K, Q6_K), never to the row-owning form or to Q5_K / Q8_0; the environment variables parse as
doc/serving.md states (one value for both MoE launches, G,D for each, 0 for none). Reads the options a launch would
get; launches nothing."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

quant = pytest.importorskip("ktrans.kernels.triton.quant")
moe_quant = importlib.import_module("ktrans.kernels.triton.moe_quant")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q8_0"])
def test_gemv_cap_only_where_timed(qtype, monkeypatch):
    monkeypatch.setitem(quant.GEMV, "maxnreg", 80)
    monkeypatch.setitem(quant.GEMV, "stages", None)
    timed = qtype in ("Q4_K", "Q6_K")
    assert quant._gemv_options(qtype, 0) == ({"maxnreg": 80} if timed else {})
    assert quant._gemv_options(qtype, 1) == {}  # the row-owning form: never capped
    monkeypatch.setitem(quant.GEMV, "maxnreg", None)
    assert quant._gemv_options(qtype, 0) == {}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q8_0"])
def test_moe_lanes_caps_per_launch(qtype, monkeypatch):
    monkeypatch.setitem(moe_quant.LANES, "maxnreg", (96, 80))
    timed = qtype in ("Q4_K", "Q6_K")
    assert moe_quant._lanes_cap(0, qtype, False) == ({"maxnreg": 96} if timed else {})
    assert moe_quant._lanes_cap(1, qtype, False) == ({"maxnreg": 80} if timed else {})
    assert moe_quant._lanes_cap(0, qtype, True) == {} and moe_quant._lanes_cap(1, qtype, True) == {}
    monkeypatch.setitem(moe_quant.LANES, "maxnreg", (0, 0))
    assert moe_quant._lanes_cap(0, qtype, False) == {} and moe_quant._lanes_cap(1, qtype, False) == {}


@pytest.mark.parametrize("env, gemv, lanes", [
    (None, 80, (80, 80)),  # the defaults (session 23)
    ("0", None, (0, 0)),
    ("96,72", 96, (96, 72)),
    ("72", 72, (72, 72)),
])
def test_caps_from_the_environment(env, gemv, lanes):
    code = ("from ktrans.kernels.triton import quant, moe_quant; "
            "print(quant.GEMV['maxnreg'], *moe_quant.LANES['maxnreg'])")
    environ = {k: v for k, v in os.environ.items() if k not in ("KTRANS_GEMV_MAXNREG", "KTRANS_MOE_LANES_MAXNREG")}
    if env is not None:
        environ["KTRANS_MOE_LANES_MAXNREG"] = env
        environ["KTRANS_GEMV_MAXNREG"] = env.split(",")[0]
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(gemv), *map(str, lanes)]

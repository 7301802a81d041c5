"""The dense quantized linear (CPULinear), kernel-path dispatch, the doctor report and the bandwidth probe."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans import _cpu  # noqa: E402
from ktrans.kernels import cpu  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402

PATHS = [p for p, why in _cpu.path_status().items() if why is None]
# relative error bound per format: int8 activations for the integer formats, exact products for the float ones
BOUND = {"Q8_0": 0.01, "Q4_0": 0.01, "Q4_1": 0.01, "Q5_0": 0.01, "Q5_1": 0.01, "Q4_K": 0.01, "Q5_K": 0.01,
         "Q6_K": 0.01, "BF16": 1e-5, "F16": 1e-5, "F32": 1e-5}
_TORCH_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def weight(qtype: str, n_out: int, n_in: int, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32)
    if qtype in _TORCH_FLOAT:
        w = torch.from_numpy(x).to(_TORCH_FLOAT[qtype])
        return w, w.double()
    raw = Q.quantize(x, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])).double()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", list(BOUND))
def test_linear_matches_reference(qtype, path, pool):
    n_in = 512 if qtype.endswith("_K") else (50 if qtype in ("BF16", "F16", "F32") else 96)
    n_out = 37  # not a multiple of any row block
    raw, deq = weight(qtype, n_out, n_in)
    lin = cpu.CPULinear(raw, n_out, n_in, qtype=qtype, pool=pool, isa=path)
    for t in (1, 6, 70):
        x = torch.randn(t, n_in)
        ref = x.double() @ deq.T
        y = lin(x)
        assert y.shape == (t, n_out)
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < BOUND[qtype], f"{qtype} {path} T={t}: {err:.2e}"


def test_paths_agree_with_scalar(pool):
    """The vector paths compute the same integer sums as the scalar one; only float summation order differs."""
    raw, _ = weight("Q6_K", 64, 1024, seed=1)
    x = torch.randn(5, 1024)
    ys = {p: cpu.CPULinear(raw, 64, 1024, qtype="Q6_K", pool=pool, isa=p)(x) for p in PATHS}
    for p, y in ys.items():
        torch.testing.assert_close(y, ys["scalar"], rtol=1e-5, atol=1e-4, msg=p)


def test_path_selection_and_errors(monkeypatch):
    assert "scalar" in PATHS
    for p in PATHS:
        assert _cpu.select_path(p) == p
    monkeypatch.setenv("KTRANS_CPU_ISA", "scalar")
    assert _cpu.select_path("auto") == "scalar"
    assert cpu.best_path()[0] == "scalar" and "KTRANS_CPU_ISA" in cpu.best_path()[1]
    monkeypatch.setenv("KTRANS_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="unknown CPU kernel path"):
        _cpu.select_path("auto")
    monkeypatch.delenv("KTRANS_CPU_ISA")
    best = _cpu.select_path("auto")
    assert best == PATHS[0]  # path_status lists the widest path first
    for p, why in _cpu.path_status().items():
        if why is not None:
            with pytest.raises(ValueError, match="cannot run here"):
                _cpu.select_path(p)


def test_doctor_reports_the_dispatched_path():
    env = dict(os.environ, KTRANS_CPU_ISA="avx2" if "avx2" in PATHS else "scalar")
    out = subprocess.run([sys.executable, "-m", "ktrans.cli", "doctor"], capture_output=True, text=True, env=env,
                         check=True).stdout
    assert f'"path": "{env["KTRANS_CPU_ISA"]}"' in out


def test_pool_errors_and_bandwidth_probe(pool):
    with pytest.raises(ValueError):
        _cpu.ThreadPool(0)
    with pytest.raises(ValueError, match="never submitted"):
        pool.wait(10**9)
    assert cpu.read_bandwidth(64 << 20, reps=1, pool=pool) > 0.1
    assert cpu.stream_bandwidth([torch.ones(8 << 20), torch.ones(3 << 20, dtype=torch.uint8)], reps=1, pool=pool) > 0.1
    assert cpu.stream_bandwidth([torch.ones(300, dtype=torch.uint8)], reps=1, pool=pool) > 0


_QUANT_PROBE = r'''
import sys
import numpy as np
import torch
from ktrans.kernels import cpu
from ktrans.weights import quants as Q
rng = np.random.default_rng(0)
outs = []
for qt, k in [("Q8_0", 96), ("Q4_K", 512), ("Q6_K", 256)]:
    w = torch.from_numpy(Q.quantize(rng.standard_normal((40, k)).astype(np.float32), qt))
    x = torch.from_numpy(rng.standard_normal((33, k)).astype(np.float32) * np.float32(rng.uniform(1e-3, 1e3)))
    x[3] = 0          # an all-zero row
    x[7] *= 1e-30     # tiny values
    x[9, 5] = 1e30    # one huge value
    outs.append(cpu.CPULinear(w, 40, k, qtype=qt)(x))
torch.save(outs, sys.argv[1])
'''


def test_vector_and_scalar_activation_quantizers_agree_bitwise(tmp_path):
    """The AVX2 activation quantizer must give the bytes of the scalar one (KTRANS_QUANT_SCALAR=1 forces that)."""
    results = []
    for env in ({}, {"KTRANS_QUANT_SCALAR": "1"}):
        path = tmp_path / f"out{len(results)}.pt"
        subprocess.run([sys.executable, "-c", _QUANT_PROBE, str(path)], env={**os.environ, **env}, check=True)
        results.append(torch.load(path))
    for a, b in zip(*results):
        assert torch.equal(a, b)

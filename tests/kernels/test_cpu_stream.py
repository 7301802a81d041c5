"""The CPU experts' stream path (ktrans.kernels.cpu_stream, csrc/cpu/stream.cpp) without a GPU.

Its host functions are called directly here (`run_submit` / `run_wait` are what the stream runs): they must give
bitwise the result of CPUMoE.submit on the same rows, compute only the live rows the host cell names, and report
failures instead of throwing into the driver. Enqueueing on a real stream and graph replay are gpu tests
(tests/engine/test_graphs.py, tests/engine/test_no_host_sync.py).
"""
import pytest
import torch

from ktrans import _cpu
from ktrans.kernels import cpu_stream

from tests.kernels.test_cpu_moe import make_moe, routing

TYPES = ("Q4_K", "Q4_K", "Q6_K")
K = 3


def _staged(moe, max_rows: int):
    staging = cpu_stream.Staging(max_rows, moe.hidden, K, pinned=False)
    return staging, cpu_stream.StreamMoE(moe, staging, "layer")


def _fill(staging, x, ids, w):
    t = x.shape[0]
    staging.x[:t], staging.ids[:t], staging.weights[:t] = x, ids, w


@pytest.mark.parametrize("t, live", [(1, 1), (7, 7), (13, 5), (6, 0)])
def test_host_functions_equal_submit_on_the_live_rows(pool, t, live):
    moe = make_moe(TYPES, pool)
    staging, call = _staged(moe, 16)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, moe.hidden, generator=gen)
    ids, w = routing(t, K, gen)
    _fill(staging, x, ids, w)
    staging.out.fill_(7.0)  # rows the call must not touch keep this
    staging.set_rows(live)
    busy0 = pool.busy()[1]
    call.call.run_submit()
    call.call.run_wait()
    call.check()
    assert call.call.calls == 1
    # the job's span on the pool (nothing else ran): what split prefill reads as its CPU share's time
    assert call.call.last_busy_ns == (pool.busy()[1] - busy0 if live else 0)
    if live:
        want = moe.submit(x[:live].contiguous(), ids[:live].contiguous(), w[:live].contiguous()).wait()
        assert torch.equal(staging.out[:live], want)
    assert (staging.out[live:] == 7.0).all()


def test_one_host_function_equals_submit_then_wait(pool):
    """run_submit_wait (KTRANS_STREAM_ONE_HOST_FN's single host function) gives bitwise what the submit and wait
    host functions give on the same rows, and counts one completed call."""
    moe = make_moe(TYPES, pool)
    staging, call = _staged(moe, 8)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, moe.hidden, generator=gen)
    ids, w = routing(5, K, gen)
    _fill(staging, x, ids, w)
    staging.set_rows(5)
    call.call.run_submit()
    call.call.run_wait()
    want = staging.out[:5].clone()
    staging.out.zero_()
    call.call.run_submit_wait()
    call.check()
    assert call.call.calls == 2 and torch.equal(staging.out[:5], want)


def test_failures_are_reported_not_thrown(pool):
    moe = make_moe(TYPES, pool)
    staging, call = _staged(moe, 4)
    staging.rows[0] = 5  # past max_rows: what a bad replay would leave
    call.call.run_submit()
    call.call.run_wait()
    with pytest.raises(RuntimeError, match="layer: the CPU experts failed on the CUDA stream: live rows 5"):
        call.check()
    call.check()  # reported once
    # A submit that runs again before its wait (two forwards sharing the buffers) is refused, not raced.
    staging.set_rows(1)
    call.call.run_submit()
    call.call.run_submit()
    call.call.run_wait()
    with pytest.raises(RuntimeError, match="submitted again before its wait"):
        call.check()


def test_staging_checks_and_shares(pool):
    moe = make_moe(TYPES, pool)
    with pytest.raises(ValueError, match="live rows 9"):
        cpu_stream.Staging(8, moe.hidden, K, pinned=False).set_rows(9)
    with pytest.raises(ValueError, match="max_rows must be positive"):
        cpu_stream.Staging(0, moe.hidden, K, pinned=False)
    with pytest.raises(ValueError, match="staging hidden"):
        cpu_stream.StreamMoE(moe, cpu_stream.Staging(2, moe.hidden + 1, K, pinned=False))
    if torch.cuda.is_available():
        a = cpu_stream.Staging.shared(moe.hidden, K, 8)
        assert cpu_stream.Staging.shared(moe.hidden, K, 4) is a
        b = cpu_stream.Staging.shared(moe.hidden, K, 9)
        assert b is not a and b.max_rows >= 16  # grown; `a` stays valid for whoever holds it
        cpu_stream.set_live_rows(3)
        assert int(a.rows[0]) == int(b.rows[0]) == 3


def test_without_cuda_the_stream_path_says_why():
    ok, why = cpu_stream.available()
    if not torch.cuda.is_available():
        assert not ok and why
    hooks, hooks_why = _cpu.stream_hooks_available()
    assert hooks or "libcuda" in hooks_why or "cuLaunchHostFunc" in hooks_why


def test_stream_path_widens_the_polling_window(monkeypatch):
    """Driven from a GPU stream, a job comes per layer with the GPU's work between: the workers poll through it
    (cpu.STREAM_SPIN_US) instead of sleeping; a pool whose threads share cores keeps 0 (polling would steal them)."""
    from ktrans.kernels import cpu

    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores for a pool whose threads have cores of their own")
    monkeypatch.delenv("KTRANS_CPU_SPIN_US", raising=False)
    own = cpu.make_pool(2, pin=False, spin_us=200)  # the dev box and CI have 2 cores: 1 worker + the caller
    assert own.spin_us == 200
    _staged(make_moe(TYPES, own), 4)
    assert own.spin_us == cpu.STREAM_SPIN_US
    monkeypatch.setenv("KTRANS_CPU_SPIN_US", "1500")
    assert cpu.stream_spin_us() == 1500 and cpu.spin_us() == 1500
    shared = cpu.make_pool(64, pin=False, spin_us=200)  # more threads than this machine's cores
    _staged(make_moe(TYPES, shared), 4)
    assert shared.spin_us == 0

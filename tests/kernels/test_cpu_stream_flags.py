"""The CPU experts' flag path (KTRANS_STREAM_FLAGS): no host functions; the GPU stores a sequence number into a
pinned `go` cell, the relay thread of ktrans._cpu runs the layer and stores it into `done`, a one-program kernel
polls `done` (csrc/cpu/stream.cpp, ktrans.kernels.triton.stage, ktrans.kernels.cpu_stream).

Without a GPU, the test plays the GPU's part in Python (the relay's side is the real thread), and the Triton kernels
run interpreted on CPU tensors, the relay serving them from its own thread while the interpreter polls. On a GPU the
same kernels run on pinned staging, eagerly and inside a CUDA graph. Every output is compared bitwise with
CPUMoE.submit on the same rows (the same C++ job either way)."""
from __future__ import annotations

import time

import pytest
import torch

from ktrans import _cpu
from ktrans.kernels import cpu_stream

from tests.kernels.test_cpu_moe import make_moe, routing

TYPES = ("Q4_K", "Q4_K", "Q6_K")
K = 3


def _until(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(1e-4)
    return True


def _inputs(moe, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, moe.hidden, generator=gen)
    ids, w = routing(t, K, gen)
    return x, ids, w


def test_relay_serves_each_new_go_once(pool):
    moe = make_moe(TYPES, pool)
    staging = cpu_stream.Staging(8, moe.hidden, K, pinned=False)
    call = cpu_stream.StreamMoE(moe, staging, "layer")
    flags = torch.zeros(3, dtype=torch.int64)
    call.call.use_flags(flags.data_ptr())
    try:
        for seq, (t, live) in enumerate([(5, 5), (7, 3), (2, 0)], start=1):
            x, ids, w = _inputs(moe, t, seq)
            staging.x[:t], staging.ids[:t], staging.weights[:t] = x, ids, w
            staging.out.fill_(7.0)
            staging.set_rows(live)
            _cpu.relay_kick(20000)
            flags[0] = seq  # what the stage-in kernel's last program stores
            assert _until(lambda: int(flags[1]) == seq), f"the relay never stored done = {seq}"
            call.check()
            if live:
                want = moe.submit(x[:live].contiguous(), ids[:live].contiguous(), w[:live].contiguous()).wait()
                assert torch.equal(staging.out[:live], want)
            assert (staging.out[live:] == 7.0).all()  # pad rows cost nothing and are not written
        assert call.call.flag_calls == 3 and call.call.calls == 3
        # a failing layer still stores done (the GPU never waits forever) and reports at the next check
        staging.rows[0] = 99
        flags[0] = 4
        assert _until(lambda: int(flags[1]) == 4)
        with pytest.raises(RuntimeError, match="layer: the CPU experts failed on the CUDA stream: live rows 99"):
            call.check()
        served, registered = _cpu.relay_stats()
        assert served >= 4 and registered >= 1
    finally:
        call.call.drop_flags()
    flags[0] = 5  # off the flag path: nobody serves it
    time.sleep(0.05)
    assert int(flags[1]) == 4 and call.call.flag_calls == 4


def test_gpu_timeout_is_reported(pool):
    moe = make_moe(TYPES, pool)
    call = cpu_stream.StreamMoE(moe, cpu_stream.Staging(2, moe.hidden, K, pinned=False), "layer")
    call.flagged, call.flags = True, torch.tensor([0, 0, 6])  # what the wait kernel stores when it gives up
    with pytest.raises(RuntimeError, match="layer: the GPU stopped waiting for the CPU experts' call 6"):
        call.check()
    call.check()  # reported once


@pytest.mark.triton
@pytest.mark.parametrize("t, live", [(1, 1), (6, 4), (3, 0)])
def test_flag_kernels_with_the_relay(pool, t, live, triton_device):
    """stage_in rings go after its stores, the relay serves it, cpu_wait returns once done holds the number and
    stage_out reads the rows the CPU wrote: twice in a row (the sequence numbers advance on both sides)."""
    from ktrans.kernels.triton import stage

    moe = make_moe(TYPES, pool)
    pinned = triton_device.type == "cuda"
    staging = cpu_stream.Staging(8, moe.hidden, K, pinned=pinned)
    flags = torch.zeros(3, dtype=torch.int64, pin_memory=pinned)
    ring = torch.zeros(2, dtype=torch.int64, device=triton_device)
    call = cpu_stream.StreamMoE(moe, staging, "layer")
    call.call.use_flags(flags.data_ptr())
    try:
        for rep in range(2):
            x, ids, w = _inputs(moe, t, 10 * t + rep)
            staging.set_rows(live)
            _cpu.relay_kick(20000)
            xd, idsd, wd = (v.to(triton_device) for v in (x, ids, w))
            stage.stage_in(xd.to(torch.bfloat16), idsd, wd, staging.x, staging.ids, staging.weights, ring, flags)
            stage.cpu_wait(ring, flags)
            got = stage.stage_out(staging.out, live, triton_device, torch.float32, flagged=True)
            if pinned:
                torch.cuda.synchronize()
            assert int(flags[0]) == int(flags[1]) == rep + 1 and int(flags[2]) == 0 and int(ring[0]) == 0
            call.check()
            if live:
                xb = x.to(torch.bfloat16).float()  # the staging holds the bf16 activations in fp32
                want = moe.submit(xb[:live].contiguous(), ids[:live].contiguous(), w[:live].contiguous()).wait()
                assert torch.equal(got.cpu(), want)
            else:
                assert got.shape == (0, moe.hidden)
    finally:
        call.call.drop_flags()


@pytest.mark.gpu
def test_flag_path_in_a_cuda_graph(pool, monkeypatch):
    """StreamMoE on the flag path, captured once and replayed with new inputs and live rows: each replay's rows
    equal CPUMoE.submit's, and no host function is in the graph (the relay served every layer call)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(cpu_stream, "FLAGS", True)
    moe = make_moe(TYPES, pool)
    staging = cpu_stream.Staging(8, moe.hidden, K)
    call = cpu_stream.StreamMoE(moe, staging, "layer")
    assert call.flagged
    dev = torch.device("cuda")
    x = torch.zeros(8, moe.hidden, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(8, K, device=dev, dtype=torch.int64)
    w = torch.zeros(8, K, device=dev)
    call.submit(x, ids, w)  # eager first: the ring counter is made outside the graph
    call.sync(dev, torch.bfloat16)
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            out = (call.submit(x, ids, w), call.sync(dev, torch.bfloat16))[1]
    calls0 = call.call.flag_calls
    for rep, live in enumerate((8, 3, 5)):
        xs, idss, ws = _inputs(moe, 8, 100 + rep)
        x.copy_(xs), ids.copy_(idss), w.copy_(ws)
        cpu_stream.set_live_rows(live)
        graph.replay()
        torch.cuda.synchronize()
        call.check()
        xb = xs.to(torch.bfloat16).float()
        want = moe.submit(xb[:live].contiguous(), idss[:live].contiguous(), ws[:live].contiguous()).wait()
        assert torch.equal(out[:live].float().cpu(), want.to(torch.bfloat16).float())
    assert call.call.flag_calls == calls0 + 3


@pytest.mark.triton
@pytest.mark.parametrize("t, renorm, dtype", [(1, True, torch.float32), (5, False, torch.bfloat16),
                                              (0, True, torch.float32)])
def test_route_stage_in_writes_what_route_then_stage_in_write(pool, t, renorm, dtype, triton_device):
    """KTRANS_ROUTE_STAGE: the router's top-k inside the stage-in launch writes bitwise the x, ids and weights that
    route() then stage_in() write (bf16 logits: the weights rounded to bf16 first, as route() returns them), rings
    go once (T = 0 too), and the relay serves the call: its output rows are CPUMoE.submit's on those rows."""
    from ktrans.kernels.triton import router, stage

    moe = make_moe(TYPES, pool)
    pinned = triton_device.type == "cuda"
    got, want = (cpu_stream.Staging(8, moe.hidden, K, pinned=pinned) for _ in range(2))
    flags = torch.zeros(3, dtype=torch.int64, pin_memory=pinned)
    ring = torch.zeros(2, dtype=torch.int64, device=triton_device)
    gen = torch.Generator().manual_seed(t)
    n_experts = 7  # not a power of two, within the layer's 8; distinct logits, exact in bf16 (no ties to break)
    logits = torch.stack([torch.randperm(n_experts, generator=gen).float() / 8 for _ in range(t)]) if t \
        else torch.zeros(0, n_experts)
    x = torch.randn(t, moe.hidden, generator=gen).to(dtype)
    xd, ld = x.to(triton_device), logits.to(dtype).to(triton_device)
    call = cpu_stream.StreamMoE(moe, got, "layer")
    call.call.use_flags(flags.data_ptr())
    try:
        got.set_rows(t)
        _cpu.relay_kick(20000)
        stage.route_stage_in(xd, ld, K, renorm, got.x, got.ids, got.weights, ring, flags)
        ids, w = router.route(ld, K, renorm)
        stage.stage_in(xd, ids, w, want.x, want.ids, want.weights)
        stage.cpu_wait(ring, flags)
        if pinned:
            torch.cuda.synchronize()
        assert int(flags[0]) == int(flags[1]) == 1 and int(ring[1]) == 1 and int(ring[0]) == 0
        call.check()
    finally:
        call.call.drop_flags()
    for a, b in ((got.x, want.x), (got.ids, want.ids), (got.weights, want.weights)):
        assert torch.equal(a, b)
    if t:
        expect = moe.submit(want.x[:t].clone(), want.ids[:t].clone(), want.weights[:t].clone()).wait()
        assert torch.equal(got.out[:t], expect)
    with pytest.raises(ValueError, match="do not fit the staging"):
        stage.route_stage_in(xd, ld, K + 1, renorm, got.x, got.ids, got.weights, ring, flags)


def test_a_new_device_continues_the_numbering(pool, monkeypatch):
    """The ring counter made for a call's device starts from the last go number, so the relay serves the next call
    (a counter back at 0 would ring a number the relay has seen, and the wait would pass on the old output)."""
    moe = make_moe(TYPES, pool)
    call = cpu_stream.StreamMoE(moe, cpu_stream.Staging(2, moe.hidden, K, pinned=False), "layer")
    call.flagged, call.flags = True, torch.tensor([7, 7, 0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no CUDA here)
    call._begin(torch.zeros(1, moe.hidden), None)
    assert call.ring.tolist() == [0, 7]

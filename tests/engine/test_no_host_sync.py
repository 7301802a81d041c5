"""A GPU decode step never waits for the device (needs CUDA; skipped without it).

Under Qwen3Next-gpu.yaml (the `small` model, reference ops) a decode-only step, once planned, makes no device-to-host
copy, no .item() / .tolist() / int() / bool() of a CUDA tensor and no stream, event or device synchronisation from the
embedding to the logits. Two witnesses: patched Python entry points (what ran) and torch.profiler (what the CUDA
runtime saw: no DtoH memcpy, no cuda*Synchronize). Under the serve placement (experts on the CPU) the only device-
to-host transfers are the stage kernel's stores into the CPU experts' pinned staging (or, with the torch copies,
asynchronous copies into it), and the host never waits: the experts' submit and wait are host functions on the
stream (ktrans.kernels.cpu_stream).
"""
from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from ktrans.config import RULES_DIR, ModelConfig
from ktrans.engine.runner import ModelRunner
from ktrans.inject import build_injected_model, pool_devices
from ktrans.model.tiny import preset_config, random_state_dict
from ktrans.runtime.batch import SeqChunk
from ktrans.runtime.pools import KVPool, StatePool
from ktrans.weights.source import StateDictSource

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _caller() -> str:
    """The innermost project or Triton frames of the current stack (what made the host read or sync)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/ktrans/" in f.filename or "/triton/" in f.filename]
    return " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames[-3:])) or "?"


@contextlib.contextmanager
def host_reads():
    """Record every Python-level read of a CUDA tensor's value on the host, and every explicit synchronisation."""
    seen: list[str] = []
    patched = []

    def wrap(owner, name, on_cuda_only=True):
        real = getattr(owner, name)

        def spy(*args, **kwargs):
            t = args[0] if args else None
            if not on_cuda_only or (isinstance(t, torch.Tensor) and t.is_cuda):
                seen.append(f"{name} from {_caller()}")
            return real(*args, **kwargs)

        setattr(owner, name, spy)
        patched.append((owner, name, real))

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"):
        wrap(torch.Tensor, name)
    wrap(torch.cuda, "synchronize", on_cuda_only=False)
    wrap(torch.cuda.Event, "synchronize", on_cuda_only=False)
    wrap(torch.cuda.Stream, "synchronize", on_cuda_only=False)
    try:
        yield seen
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def _model(rules: str):
    config = ModelConfig.from_hf_dict(preset_config("small"), source="small")
    model, _ = build_injected_model(config, RULES_DIR / rules, StateDictSource(random_state_dict(config, 3)),
                                    torch.bfloat16)
    kv_dev, state_dev = pool_devices(model)
    kv = KVPool(config, 32, 16, torch.bfloat16, kv_dev)
    states = StatePool(config, 4, torch.bfloat16, state_dev)
    return model, ModelRunner(model, kv, states, max_num_seqs=4, max_num_tokens=64, max_pages_per_seq=8)


def _decode_step(runner: ModelRunner):
    """Prefill two sequences (any syncs allowed), then prepare and plan one decode step of both."""
    prompts = [list(range(3, 14)), list(range(40, 47))]
    pages = [[0, 1], [2, 3]]
    for slot, (p, pg) in enumerate(zip(prompts, pages)):
        runner.step([SeqChunk(p, 0, slot, pg)])
    batch = runner.prepare([SeqChunk([5], len(prompts[0]), 0, pages[0]), SeqChunk([6], len(prompts[1]), 1, pages[1])])
    assert batch.is_decode
    runner.plan(batch)
    torch.cuda.synchronize()
    return batch


def _profile(runner: ModelRunner, batch):
    """(logits, Python-level host reads, device operation names, CUDA runtime calls made inside the forward)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    # One forward first, as the engine's warm-up does: a Triton autotuner's first call times its configs (syncs).
    runner.model(batch)
    torch.cuda.synchronize()
    # The profiler synchronises as it starts and stops: only the forward runs under the spies, and only runtime
    # calls made within its span count.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with host_reads() as seen, record_function("decode_forward"):
            logits = runner.model(batch)
        torch.cuda.synchronize()
    events = prof.events()
    span = next(e for e in events if e.name == "decode_forward").time_range
    device = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    calls = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU
             and span.start <= e.time_range.start <= span.end]
    return logits, seen, device, calls


def test_gpu_decode_step_never_syncs():
    model, runner = _model("Qwen3Next-gpu.yaml")
    batch = _decode_step(runner)
    logits, seen, device, calls = _profile(runner, batch)
    assert logits.is_cuda and logits.shape == (2, model.config.vocab_size)
    assert seen == [], f"host reads or syncs inside the decode forward: {sorted(set(seen))}"
    dtoh = [e for e in device if "DtoH" in e]
    syncs = [e for e in calls if e in _SYNC_RUNTIME]
    assert not dtoh and not syncs, (dtoh[:5], syncs[:5])


@pytest.mark.parametrize("stage_kernels", [True, False])
def test_serve_decode_step_copies_only_into_pinned_buffers(stage_kernels, monkeypatch):
    """The experts' inputs reach the pinned staging through the stage kernel (the default; no copy at all) or
    through asynchronous copies into pinned memory (KTRANS_STAGE_KERNELS=0)."""
    from ktrans.kernels import cpu_stream

    monkeypatch.setattr(cpu_stream, "STAGE_KERNELS", stage_kernels)
    model, runner = _model("Qwen3Next-serve-cpuexperts.yaml")
    batch = _decode_step(runner)
    logits, seen, device, calls = _profile(runner, batch)
    assert logits.is_cuda
    dtoh = [e for e in device if "DtoH" in e]
    staged = [e for e in device if "_stage_in_kernel" in e or "_stage_out_kernel" in e]
    if stage_kernels:
        assert staged and not dtoh, sorted(set(dtoh))
    else:
        assert dtoh and not staged, "the experts' inputs must reach the CPU"
    assert all("Pinned" in e for e in dtoh), sorted(set(dtoh))
    assert "cudaMemcpy" not in calls  # only cudaMemcpyAsync
    assert seen == [], f"host reads or syncs inside the decode forward: {sorted(set(seen))}"
    assert not [e for e in calls if e in _SYNC_RUNTIME]


@pytest.mark.parametrize("form", ["one host function", "flags", "route stage"])
def test_hand_off_forms_give_the_same_logits(form, monkeypatch):
    """The CPU experts' hand-off without host functions (KTRANS_STREAM_FLAGS, the default: the relay thread and a
    polling kernel), with the router's top-k inside its stage-in launch (KTRANS_ROUTE_STAGE, on the flag path) and
    with one host function a layer (KTRANS_STREAM_ONE_HOST_FN) give bitwise the logits of the two-function form
    (same kernels, same rows), and the forward still neither reads nor syncs; the flag path's device operations
    include its polls, one a layer, and with the route stage no top-k launch of its own."""
    from ktrans.kernels import cpu_stream
    from ktrans.operators import moe

    got = {}
    for variant in ("two host functions", form):
        monkeypatch.setattr(cpu_stream, "FLAGS", variant in ("flags", "route stage"))
        monkeypatch.setattr(moe, "ROUTE_STAGE", variant == "route stage")
        monkeypatch.setattr(cpu_stream, "ONE_HOST_FN", variant == "one host function")
        model, runner = _model("Qwen3Next-serve-cpuexperts.yaml")
        logits, seen, device, calls = _profile(runner, _decode_step(runner))
        assert seen == [] and not [e for e in calls if e in _SYNC_RUNTIME], variant
        polls = [e for e in device if "_cpu_wait_kernel" in e]
        layers = sum(type(m).__name__ == "KExpertsCPU" for m in model.modules())
        assert layers and len(polls) == (layers if variant in ("flags", "route stage") else 0), variant
        fused = [e for e in device if "_route_stage_kernel" in e]
        topk = [e for e in device if "_topk_softmax_kernel" in e]
        assert len(fused) == (layers if variant == "route stage" else 0), variant
        assert variant != "route stage" or not topk, variant
        got[variant] = logits.float().cpu()
    assert torch.equal(got["two host functions"], got[form])

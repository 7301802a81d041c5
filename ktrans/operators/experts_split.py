"""KExpertsSplit: prefill of the routed experts of one MoE layer split between the CPU cores and the GPU, the GPU's
experts streamed from the one host copy the CPU experts hold.

A prefill chunk of a few hundred tokens touches nearly every expert of every layer. The CPU cores alone are bound by
their arithmetic (at ~0.9 TFLOPS a 512-token chunk of the 80B takes ~37 ms a layer); the GPU alone by PCIe (one
layer's 0.9 GB of Q4_K_M experts at ~55 GB/s is ~16.5 ms). Split, each layer's experts [0, n_cpu) run on the CPU and
[n_cpu, E) on the GPU, with n_cpu chosen so that both finish together:

    n_cpu * c = (E - n_cpu) * g     c: CPU seconds per expert at this chunk size; g: GPU seconds per streamed expert

Both rates are measured as the op runs (c per token-count bucket, g from CUDA events around the copy), starting from
an even split; a side that the split leaves idle gets one expert every 16th layer call, so a rate measured once under
other conditions (a first call's one-off costs, a share of one expert) is measured again. A rule's `cpu_share` fixes
the CPU's share instead. A step with fewer than the rule's `gpu_prefill_min_tokens` tokens runs wholly on the CPU
(the generate op), as kt-kernel's gpu_prefill_token_threshold does: there the copy would cost more than the CPU's
work. The op asks the engine for steps of STEP_TOKENS (`step_tokens`, engine.default_chunk_size), since each step
pays one pass over the experts whatever its length.

The streamed experts come from the CPU op's own buffers (the experts live in host RAM once): those are registered
with the CUDA driver as pinned memory (cudaHostRegister), so the copy is a DMA at full PCIe rate and needs no second
host copy. The copied blocks, ggml rows or the 16-row layout the CPU op keeps Q4_K and Q5_K in (Q4_K_X16), are
repacked on the GPU in one Triton launch per matrix (ktrans.kernels.triton.repack, reading either layout in place)
into the planes of the quantized GPU MoE (ktrans.kernels.triton.quant_layout), which ktrans.kernels.triton.moe_quant
runs.

Overlap, double buffered: layer L's submit starts layer L+1's copy and repack on a copy stream, while the CPU runs
layer L's share and the GPU layer L's. The copy stream waits on nothing of the compute stream; the compute stream
waits on the copy's event before it reads the planes, and the planes are recorded as used by the compute stream, so
the allocator hands their memory to a later copy only once the kernels that read them have finished.

The CPU's share runs on the pool as KExpertsCPU's blocking path does: its inputs copied (a sync) into the model's
fixed host buffers (pinned; converted to float32 on the device), the pool's wait on the host, its output copied back
from the same buffers and converted on the device, its time the pool's own busy span. With the rule kwarg
`cpu_on_stream: true` it runs as decode's does instead, on the compute stream (ktrans.kernels.cpu_stream): inputs
copied to pinned staging, the pool's submit and wait as host functions around the GPU's share, the result copied
back, its time the pool's busy span between the two (StreamCall.last_busy_ns), read after the step (`check`); the
host never waits within a forward, and before it allocates layer L+1's planes it waits for layer L-1's GPU MoE, so
at most two layers' planes are alive. That path passes the op's tests on the H200 but has not yet finished a
full-size run (2026-12-02: the bench did not end within its call; not diagnosed), so it is not the default. Rules
place the op on CUDA; the tests also build it on the CPU, where the share runs on the pool directly, the copies are
plain and Triton's interpreter runs the MoE.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from dataclasses import dataclass, field

import torch

from ktrans.kernels.host_memory import register_for_dma
from ktrans.kernels.triton.moe_quant import moe_quant
from ktrans.kernels.triton.quant_layout import BLOCK_BYTES, PackedWeight, concat_rows
from ktrans.kernels.triton.repack import repack_blocks
from ktrans.operators.experts import EXPERT_OPS, ExpertsOp, layer_index
from ktrans.runtime.batch import GENERATE
from ktrans.weights import quants as Q

log = logging.getLogger(__name__)

_X16 = {"Q4_K_X16": "Q4_K", "Q5_K_X16": "Q5_K"}  # CPUMoE.layouts names of its repacked matrices -> ggml type
# Steps of fewer tokens run on the CPU experts alone. At full size on the H200 machine (doc/benchmarks.md, session
# 13) a 512-token prompt prefilled at 706 tok/s split at this threshold against 459 on the CPU alone (threshold 1024,
# same session); session 12: 762.
DEFAULT_MIN_TOKENS = 512
# The step size split prefill asks the engine for (engine.default_chunk_size): a step pays one pass over a layer's
# experts (PCIe copy or CPU read) whatever its length, so long steps amortise it. Measured at full size on the H200
# (doc/benchmarks.md, 2026-12-02): 3,499 tok/s at 4096-token steps, 345 at 512.
STEP_TOKENS = 4096
_EMA = 0.5  # weight of a new measurement
_PROBE_EVERY = 16  # of the layer calls the auto split gives one side nothing, one gives it one expert instead


def _bucket(tokens: int) -> int:
    """The CPU rate's token-count bucket: powers of two."""
    return 1 << max(0, math.ceil(math.log2(max(tokens, 1))))


@dataclass
class Rates:
    """Measured seconds per expert: on the CPU per token bucket (its work grows with the tokens), on the GPU per
    streamed expert (the copy and repack; the MoE kernels themselves are a small part)."""

    cpu: dict[int, float] = field(default_factory=dict)
    gpu: float | None = None

    def cpu_at(self, tokens: int) -> float | None:
        b = _bucket(tokens)
        if b in self.cpu:
            return self.cpu[b]
        if not self.cpu:
            return None
        near = min(self.cpu, key=lambda k: abs(math.log2(k / b)))  # the nearest bucket, scaled by the tokens
        return self.cpu[near] * b / near

    def add_cpu(self, tokens: int, seconds: float) -> None:
        b = _bucket(tokens)
        old = self.cpu.get(b)
        self.cpu[b] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def add_gpu(self, seconds: float) -> None:
        self.gpu = seconds if self.gpu is None else (1 - _EMA) * self.gpu + _EMA * seconds


@dataclass
class _Copy:
    """One layer's GPU share in flight or ready: experts [first, E) as planes, and the copy's events."""

    op: "weakref.ref[KExpertsSplit]"
    tokens: int
    first: int
    gate_up: PackedWeight
    down: PackedWeight
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    host_s: float


class _Stager:
    """Per device and weight source (one model): the copy stream, the rates and the layers' split ops, so that layer
    L can start layer L+1's copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.rates = Rates()
        self.calls = 0  # auto splits decided (the probe's clock)
        self.layers: "weakref.WeakValueDictionary[int, KExpertsSplit]" = weakref.WeakValueDictionary()
        self.pending: dict[int, _Copy] = {}
        self.moe_done: dict[int, torch.cuda.Event] = {}  # per layer: its last GPU MoE's end, on the compute stream
        self._timed: list[tuple] = []  # (start, copied, end events, experts) of copies not yet folded in
        self.copy_s = self.repack_s = 0.0  # the GPU's time in copies and in repacks, summed over folded copies
        self.copied_experts = 0
        self.delay_cycles = 0  # tests: a spin on the copy stream before each copy (torch.cuda._sleep)
        self._host: tuple = ()  # the CPU share's host buffers (x, ids, weights, out), grown to the longest step

    def host_buffers(self, t: int, hidden: int, k: int, pinned: bool) -> tuple[torch.Tensor, ...]:
        """Views of t rows of the model's host buffers for the CPU share waited for on the host: x and out float32
        [t, hidden], ids int64 and weights float32 [t, k]. One set for all layers (one layer's share runs at a time),
        kept and grown, never freed per call; pinned where the GPU copies into and out of them."""
        h = self._host
        if not h or h[0].shape[0] < t or h[0].shape[1] != hidden or h[1].shape[1] != k:
            n = max(t, h[0].shape[0] if h else 0)
            pin = pinned and torch.cuda.is_available()
            h = self._host = (torch.empty(n, hidden, pin_memory=pin),
                              torch.empty(n, k, dtype=torch.int64, pin_memory=pin),
                              torch.empty(n, k, pin_memory=pin), torch.empty(n, hidden, pin_memory=pin))
        return tuple(b[:t] for b in h)

    def next_layer(self, layer: int) -> "KExpertsSplit | None":
        later = [k for k in self.layers.keys() if k > layer]
        return self.layers.get(min(later)) if later else None

    def prev_layer(self, layer: int) -> int | None:
        earlier = [k for k in self.layers.keys() if k < layer]
        return max(earlier) if earlier else None

    def collect(self) -> None:
        """Fold the copies that have finished into the GPU rate (never waits)."""
        keep = []
        for start, copied, end, n in self._timed:
            if end.query():
                if n:
                    self.rates.add_gpu(start.elapsed_time(end) / 1e3 / n)
                    self.copy_s += start.elapsed_time(copied) / 1e3
                    self.repack_s += copied.elapsed_time(end) / 1e3
                    self.copied_experts += n
            else:
                keep.append((start, copied, end, n))
        self._timed = keep


_STAGERS: "dict[tuple, _Stager]" = {}


def _stager(device: torch.device, source) -> _Stager:
    key = (str(device), id(source))
    if key not in _STAGERS:
        _STAGERS[key] = _Stager(device)
    return _STAGERS[key]


@EXPERT_OPS.register("KExpertsSplit", devices=("cuda",))
class KExpertsSplit(ExpertsOp):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.layer = layer_index(operator.key, "KExpertsSplit")
        opts = getattr(operator, "options", {})
        self.min_tokens = int(opts.get("gpu_prefill_min_tokens", DEFAULT_MIN_TOKENS))
        if self.min_tokens < 1:
            raise ValueError(f"{self.key}: gpu_prefill_min_tokens must be at least 1, got {self.min_tokens}")
        share = opts.get("cpu_share", "auto")
        if share != "auto" and not (isinstance(share, (int, float)) and 0 <= share <= 1):
            raise ValueError(f"{self.key}: cpu_share must be 'auto' or a number in [0, 1], got {share!r}")
        self.cpu_share = None if share == "auto" else float(share)
        self.cpu_on_stream = bool(opts.get("cpu_on_stream", False))
        self.source = None
        self.dtype = torch.float32
        self._cpu: tuple = ()         # (the generate op,) once attached: a tuple, so no submodule cycle
        self._layout: tuple | None = None  # per matrix (host tensor, ggml type, X16?), or () if not streamable
        self._pending: tuple | None = None
        self._prefetched = False
        self.pinned: bool | None = None  # whether the CPU experts' buffers are registered for DMA (CUDA only)
        self._busy0 = 0
        self._on_stream: tuple | None = None  # (StreamCall, its wait count once done, tokens, n_cpu) not yet folded
        self._blocking = None  # the CPU share's Pending between submit and sync (the share waited for on the host)
        self.last: dict = {}          # the last call: tokens, n_cpu, times (for bench e2e and the tests)

    # ---- wiring -----------------------------------------------------------------------------------------------------
    def attach(self, impl: dict) -> None:
        """Take the generate op (the CPU experts) from the operator's phase ops; KTransformersExperts calls this
        after build_ops."""
        cpu_op = impl[GENERATE]
        if cpu_op is self or cpu_op.device.type != "cpu" or not hasattr(cpu_op, "moe"):
            raise ValueError(f"{self.key}: KExpertsSplit prefills with the generate op's CPU experts: set "
                             f"generate_device: cpu and generate_op: KExpertsCPU (got {type(cpu_op).__name__} on "
                             f"{cpu_op.device})")
        self._cpu = (cpu_op,)
        self._stager = _stager(self.device, self.source)
        self._stager.layers[self.layer] = self  # so that the layer before this one starts its copy

    @property
    def cpu_op(self):
        if not self._cpu:
            raise RuntimeError(f"{self.key}: KExpertsSplit is not attached to its CPU op (build the model with "
                               f"ktrans.inject.build_injected_model)")
        return self._cpu[0]

    def _streamable(self) -> tuple:
        """The CPU op's three matrices as (host tensor, ggml type, X16?), or () when one has no GPU layout."""
        if self._layout is None:
            moe = self.cpu_op.moe
            if moe is None:
                raise RuntimeError(f"{self.key}: the CPU experts are not loaded")
            out = []
            for w, name in zip(moe.weights, moe.layouts):
                qtype = _X16.get(name, name)
                if qtype not in BLOCK_BYTES:
                    log.warning("%s: the CPU experts hold %s, which the GPU MoE does not read: prefill runs on the "
                                "CPU", self.key, name)
                    out = []
                    break
                out.append((w, qtype, name in _X16))
            if out and self.device.type == "cuda":
                self.pinned = all([register_for_dma(w) for w, _, _ in out])
            self._layout = tuple(out)
        return self._layout

    # ---- the split ----------------------------------------------------------------------------------------------
    def n_cpu(self, tokens: int, k: int) -> int:
        """Experts [0, n_cpu) run on the CPU at this chunk size."""
        e = self.num_experts
        if self.cpu_share is not None:
            return round(e * self.cpu_share)
        st = self._stager
        c, g = st.rates.cpu_at(tokens), st.rates.gpu
        if c is None or g is None:
            return e // 2
        n = max(0, min(e, round(e * g / (c + g))))
        st.calls += 1
        if n in (0, e) and st.calls % _PROBE_EVERY == 0:  # a side given no work is never measured again: one
            n = 1 if n == 0 else e - 1                   # expert for it now and then keeps its rate current
        return n

    def _copy(self, tokens: int, first: int) -> _Copy:
        """Start the copy of experts [first, E) to the GPU and their repack there (on the copy stream)."""
        st = self._stager
        t0 = time.perf_counter()
        n = self.num_experts - first
        h, i = self.hidden_size, self.intermediate_size
        stream = st.stream
        start = end = None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                if st.delay_cycles:
                    torch.cuda._sleep(st.delay_cycles)
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            packed, datas = [], []
            mats = [(w, qtype, x16, rows, cols, Q.row_bytes(qtype, cols))
                    for (w, qtype, x16), (rows, cols) in zip(self._streamable(), ((i, h), (i, h), (h, i)))]
            for w, _, _, rows, _, rb in mats:  # every copy first, then the repacks: one timed span each
                part = w.view(-1)[first * rows * rb:]
                datas.append(part.to(self.device, non_blocking=True) if self.device.type == "cuda" else part)
            copied = None
            if stream is not None:
                copied = torch.cuda.Event(enable_timing=True)
                copied.record(stream)
            for data, (_, qtype, x16, rows, cols, _) in zip(datas, mats):
                packed.append(repack_blocks(data, qtype, (n, rows, cols), x16=x16))  # X16 read in place
            del datas
            gate_up, down = concat_rows(packed[:2]), packed[2]
            if stream is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                st._timed.append((start, copied, end, n))
        return _Copy(weakref.ref(self), tokens, first, gate_up, down, start, end, time.perf_counter() - t0)

    def _take(self, tokens: int, k: int) -> _Copy | None:
        """This layer's copy for a step of `tokens`: the one the previous layer started (its split decided then),
        else one started now; None when every expert runs on the CPU."""
        c = self._stager.pending.pop(self.layer, None)
        self._prefetched = c is not None and c.op() is self and c.tokens == tokens
        if not self._prefetched:
            first = self.n_cpu(tokens, k)
            if first >= self.num_experts:
                return None
            c = self._copy(tokens, first)
        return c

    def _wait(self, c: _Copy) -> None:
        """Order the compute stream after the copy (after the host copies of the CPU's inputs: those sync the
        stream, and must not wait for the copy)."""
        if c.end is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(c.end)
            for w in (c.gate_up, c.down):  # read on this stream: not reused before these kernels finish
                for t in w.planes().values():
                    if t.numel():
                        t.record_stream(cur)

    # ---- running ------------------------------------------------------------------------------------------------
    def reserve(self, max_tokens: int) -> None:
        """The runner's largest step (ModelRunner calls this once). Steps that large split: the CPU experts'
        buffers are registered for DMA now rather than at the first long prompt; steps that never reach the
        threshold pin nothing (registering the 80B's ~40 GiB locks that RAM)."""
        self.cpu_op.reserve(max_tokens)
        if max_tokens >= self.min_tokens:
            self._streamable()

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{self.key}: submit() called twice without sync()")
        t, k = topk_ids.shape
        if t < self.min_tokens or not self._streamable():
            self.cpu_op.submit(x, topk_ids, topk_weights)  # on the GPU's stream, as decode runs it
            self._pending = ("cpu", None, None, None)
            self.last = {"tokens": t, "n_cpu": self.num_experts}
            return
        st = self._stager
        st.collect()
        self._fold_stream_rate()
        copy = self._take(t, k)
        first = copy.first if copy is not None else self.num_experts
        on_stream = x.is_cuda and self.cpu_on_stream
        # The next layer's share streams while this one computes. On the stream nothing here waits for the GPU, so
        # the host runs ahead of it; before it allocates the next layer's planes it waits for the layer before this
        # one to have finished its GPU MoE, so at most two layers' planes are in flight. Otherwise the copy is
        # enqueued before the host copies this layer's inputs, which syncs.
        nxt = st.next_layer(self.layer)
        if nxt is not None and nxt._streamable():
            nfirst = nxt.n_cpu(t, k)
            if nfirst < nxt.num_experts:
                done = st.moe_done.get(st.prev_layer(self.layer))
                if done is not None:
                    done.synchronize()
                st.pending[nxt.layer] = nxt._copy(t, nfirst)
        ids64 = topk_ids.to(torch.int64)
        t0 = time.perf_counter()
        # the CPU's share: its experts' slots (others -1, skipped)
        cpu_running = first > 0
        if cpu_running:
            cpu_ids = torch.where(ids64 < first, ids64, -1)
            if on_stream:
                # On the stream, as decode runs it: inputs copied to pinned staging and the pool's submit and wait
                # as host functions, so neither the host nor a torch CPU op is in the way (a host sync per layer,
                # and torch's threads beside the pool's, made the share ~3x slower in situ than alone).
                self.cpu_op.submit(x, cpu_ids, topk_weights)
                call = self.cpu_op.stream_call(k).call
                self._on_stream = (call, call.calls + 1, t, first)
            else:
                # Into the model's fixed host buffers (pinned on CUDA): fresh tensors of a long step's size cost a
                # new mapping and its page faults on every call (a 4096-token output is 32 MiB). Converted on the
                # device first (a copy that also changes dtype converts on the host, through a fresh buffer, on
                # torch's threads beside the pool's). These copies must stay blocking: the last layer's output copy
                # out of `hout`, on this stream, has then finished before the pool writes it again.
                hx, hids, hw, hout = st.host_buffers(t, x.shape[1], k, pinned=x.is_cuda)
                hx.copy_(x.float())
                hids.copy_(cpu_ids)
                hw.copy_(topk_weights.float())
                self._busy0 = self.cpu_op.moe.pool.busy()[1]
                self._blocking = self.cpu_op.moe.submit(hx, hids, hw, out=hout)
        gpu_out = None
        if copy is not None:
            self._wait(copy)
            gpu_ids = torch.where(ids64 >= first, ids64 - first, -1)
            gpu_out = moe_quant(x, gpu_ids, topk_weights, copy.gate_up, copy.down)
            if on_stream:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                st.moe_done[self.layer] = done
        self._pending = ("split", cpu_running, gpu_out, (t, first, t0, copy, on_stream, x.dtype))

    def check(self) -> None:
        """After a step whose results were read (ModelRunner.check): the stream has run this layer's share, so its
        time is folded in now, before a decode step's call on the same StreamCall replaces it."""
        self._fold_stream_rate()

    def _fold_stream_rate(self) -> None:
        """Fold the CPU share's time of this layer's last call on the stream into the CPU rate, once its wait has
        run (after the step: `check`; else at this layer's next call or summary()). Its time is the pool's busy span
        between the host functions (StreamCall.last_busy_ns), the share's own compute."""
        if self._on_stream is None:
            return
        call, calls, t, first = self._on_stream
        if call.calls < calls:
            return  # not run yet: fold it at a later call
        self._on_stream = None
        busy = call.last_busy_ns
        if call.calls == calls and busy > 0:  # else another call ran since (the span is not this one's) or it failed
            cpu_s = busy / 1e9
            self._stager.rates.add_cpu(t, cpu_s / first)
            if self.last.get("tokens") == t:
                self.last["cpu_s"] = cpu_s

    def sync(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError(f"{self.key}: sync() without submit()")
        (how, cpu_running, gpu_out, info), self._pending = self._pending, None
        if how == "cpu":
            return self.cpu_op.sync()
        t, first, t0, copy, on_stream, dtype = info
        out = gpu_out
        cpu_s = 0.0
        if cpu_running:
            if on_stream:
                cpu_out = self.cpu_op.sync()  # enqueued, returned at once, in x's dtype on the device
                cpu_s = None  # known once the stream has run the wait (_fold_stream_rate)
            else:
                pending, self._blocking = self._blocking, None
                host = pending.wait()  # the model's host buffer: copied out before the next layer refills it
                # the pool's own busy span (posted to completed): not the host's lateness in coming to wait for it
                cpu_s = (self.cpu_op.moe.pool.busy()[1] - self._busy0) / 1e9
                self._stager.rates.add_cpu(t, cpu_s / first)
                if self.device.type == "cpu":
                    cpu_out = host.to(dtype, copy=True)
                else:  # from pinned memory, in order on the stream; converted on the device
                    cpu_out = host.to(self.device, non_blocking=True).to(dtype)
            out = cpu_out if out is None else out + cpu_out  # both in x's dtype
        # wall_s: the host's time in this layer's submit and sync (on CUDA the GPU and the CPU run on after it)
        self.last = {"tokens": t, "n_cpu": first, "prefetched": self._prefetched, "cpu_s": cpu_s,
                     "wall_s": time.perf_counter() - t0, "copy_host_s": copy.host_s if copy is not None else 0.0}
        return out

    @property
    def step_tokens(self) -> int:
        """The prefill step this op wants: at least STEP_TOKENS, and never below its own threshold."""
        return max(STEP_TOKENS, self.min_tokens)

    def extra_repr(self) -> str:
        share = "auto" if self.cpu_share is None else f"{self.cpu_share:g}"
        return (f"gpu_prefill_min_tokens={self.min_tokens}, cpu_share={share}"
                + (", cpu_on_stream" if self.cpu_on_stream else ""))


def summary(model) -> dict | None:
    """The model's split-prefill experts: their measured rates and each layer's last split (bench e2e reports it)."""
    ops = [m for m in model.modules() if isinstance(m, KExpertsSplit)]
    if not ops:
        return None
    stagers = {id(op._stager): op._stager for op in ops if hasattr(op, "_stager")}
    for st in stagers.values():
        if st.device.type == "cuda":
            torch.cuda.synchronize(st.device)  # every enqueued share has run: its time can be read
        st.collect()
    for op in ops:
        op._fold_stream_rate()
    rates = [{"cpu_us_per_expert": {str(b): 1e6 * s for b, s in sorted(st.rates.cpu.items())},
              "gpu_us_per_expert": None if st.rates.gpu is None else 1e6 * st.rates.gpu,
              "gpu_copy_s": st.copy_s, "gpu_repack_s": st.repack_s, "copied_experts": st.copied_experts}
             for st in stagers.values()]
    last = [op.last for op in ops if op.last]
    return {"layers": len(ops), "gpu_prefill_min_tokens": ops[0].min_tokens,
            "cpu_share": ops[0].cpu_share, "rates": rates,
            "last_n_cpu": [x["n_cpu"] for x in last], "last_tokens": last[0]["tokens"] if last else None,
            "prefetched": sum(bool(x.get("prefetched")) for x in last),
            "pinned": [op.pinned for op in ops].count(True), "not_pinned": [op.pinned for op in ops].count(False),
            "last_cpu_ms": [None if x.get("cpu_s") is None else round(1e3 * x["cpu_s"], 2) for x in last],
            "last_wall_ms": [round(1e3 * x.get("wall_s", 0.0), 2) for x in last],
            "last_copy_host_ms": [round(1e3 * x.get("copy_host_s", 0.0), 2) for x in last]}

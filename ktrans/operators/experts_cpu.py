"""KExpertsCPU: the routed experts of one MoE layer on the CPU cores, through the C++ kernels (ktrans._cpu).

Importing this module registers the op under EXPERT_OPS (ktrans.operators.experts declares it), so a rule's
`generate_op: "KExpertsCPU"` (or prefill_op) picks it. What it holds per matrix kind (gate, up, down):

- a GGUF checkpoint: the stacked raw blocks, read in place from the mapped file (no copy) when the kernels read
  their type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16, F32); other ggml types (Q2_K, Q3_K,
  IQ*, MXFP4) are dequantized once at load, with a
  warning, to float32 (or bfloat16 when the model dtype is bfloat16);
- float weights (a safetensors checkpoint): kept in the model's dtype (F32 or BF16), so the CPU rules reproduce
  the plain model; a rule's `quant: Q8_0` (or Q4_K, Q5_K, Q6_K) quantizes them at load instead, trading exactness
  for a 2-4x smaller working set. A matrix whose rows do not fill whole blocks of that type stays float.

submit() queues the layer on the CPU thread pool and returns at once, so the MoE block runs the shared expert
meanwhile; sync() waits and returns [T, hidden] in x's dtype. The pool is ktrans.kernels.cpu.get_pool(): size it
with --cpu_infer (KTRANS_CPU_INFER) before building the model. A rule's `cpu_config` (a mapping of
ktrans.kernels.cpu.CPUMoEConfig fields, e.g. {gate_up_tasks: 8, tile_min_tokens: 4}) tunes the layer's kernels;
the fields it leaves out take their defaults from the KTRANS_* environment variables.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ktrans.kernels import cpu, cpu_stream
from ktrans.operators.experts import EXPERT_OPS, ExpertsOp, layer_index
from ktrans.operators.routing_stats import hot_experts
from ktrans.runtime.batch import current_batch
from ktrans.weights import quants as Q
from ktrans.weights.source import WeightSource

log = logging.getLogger(__name__)

NATIVE_TYPES = cpu.KERNEL_TYPES
QUANTS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F32")
_TORCH_FLOAT = cpu.TORCH_FLOAT


@EXPERT_OPS.register("KExpertsCPU", devices=("cpu",))
class KExpertsCPU(ExpertsOp):
    def __init__(self, operator, device, streaming: bool = False, quant: str | None = None):
        super().__init__(operator, device, streaming)
        self.layer = layer_index(operator.key, "KExpertsCPU")
        quant = (quant or getattr(operator, "options", {}).get("quant") or "").upper() or None
        if quant is not None and quant not in QUANTS:
            raise ValueError(f"{self.key}: KExpertsCPU quant must be one of {QUANTS}, got {quant!r}")
        self.quant = quant
        self.hugepages = bool(getattr(operator, "options", {}).get("hugepages", True))
        self.repack = bool(getattr(operator, "options", {}).get("repack", True))
        try:
            self.cpu_config = cpu.CPUMoEConfig.from_dict(getattr(operator, "options", {}).get("cpu_config") or {})
        except ValueError as e:
            raise ValueError(f"{self.key}: KExpertsCPU cpu_config: {e}") from None
        # gpu_experts: N: experts 0..N-1 of the layer also resident on a GPU (`gpu_device`, default cuda), where the
        # step's pairs routed to them run (the Triton MoE, launched beside the CPU's share), the CPU taking the rest:
        # SGLang + kt-kernel's --kt-num-gpu-experts; with uniform routing the CPU's work shrinks by N / E
        opts = getattr(operator, "options", {})
        self.gpu_experts = int(opts.get("gpu_experts") or 0)
        if not 0 <= self.gpu_experts <= self.num_experts:
            raise ValueError(f"{self.key}: KExpertsCPU gpu_experts must be 0..{self.num_experts}, got "
                             f"{self.gpu_experts}")
        self.gpu_device = torch.device(str(opts.get("gpu_device") or "cuda"))
        # gpu_experts_from: PATH (routing statistics, ktrans.operators.routing_stats): the layer's N most-routed
        # experts resident instead of 0..N-1
        self.gpu_experts_from = opts.get("gpu_experts_from") or None
        if self.gpu_experts_from and not self.gpu_experts:
            raise ValueError(f"{self.key}: KExpertsCPU gpu_experts_from needs gpu_experts: N > 0 (--num_gpu_experts)")
        self.resident: tuple | None = None  # (gate_up, down) PackedWeights of the resident experts on gpu_device
        self.resident_ids: list[int] = []   # the experts they hold, in their order
        self._slot_of: torch.Tensor | None = None  # [E] on gpu_device: an expert's resident slot, or -1
        self._resident_out: torch.Tensor | None = None
        self.moe: cpu.CPUMoE | None = None
        self.source: WeightSource | None = None  # set by the injector for a streaming op
        self.dtype = torch.float32
        self.load_report: dict = {}
        self._pending: cpu.Pending | None = None
        self._out_dtype = torch.float32
        self._stream: cpu_stream.StreamMoE | None = None  # the layer on a CUDA stream (inputs on a GPU)
        self._on_stream: torch.device | None = None       # set between a stream submit and its sync
        self._reserved = 1

    # ---- loading --------------------------------------------------------------------------------------------------
    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        self.moe = self._build(source, dtype)
        if self.gpu_experts and not self.streaming:
            self._load_resident(source)

    def _load_resident(self, source: WeightSource) -> None:
        """The resident experts (0..gpu_experts-1, or the layer's hottest from gpu_experts_from) packed on
        gpu_device as the GPU MoE reads them (a second copy of those only)."""
        from ktrans.operators.experts_marlin import pack_stacks, raw_stacks
        from ktrans.operators.linear_marlin import keep_buffers

        if self.gpu_device.type == "cuda" and not torch.cuda.is_available():
            log.warning("%s: gpu_experts: %d asked for, but there is no CUDA device; all experts stay on the CPU",
                        self.key, self.gpu_experts)
            return
        raws = raw_stacks(source, self.layer, self.key, self.num_experts, self.hidden_size, self.intermediate_size)
        if raws is None:
            log.warning("%s: gpu_experts: the GPU MoE does not read these experts' types; all stay on the CPU",
                        self.key)
            return
        ids = hot_experts(self.gpu_experts_from, self.layer, self.gpu_experts, self.num_experts) \
            if self.gpu_experts_from else list(range(self.gpu_experts))
        self.resident = pack_stacks(raws, self.gpu_device, torch.tensor(ids))
        self.resident_ids = ids
        slot_of = torch.full((self.num_experts,), -1, dtype=torch.int64)
        slot_of[ids] = torch.arange(len(ids))
        self._slot_of = slot_of.to(self.gpu_device)
        self.register_buffer("resident_slot_of", self._slot_of, persistent=False)
        for name, w in zip(("resident_gate_up", "resident_down"), self.resident):
            keep_buffers(self, name, w)
        self.load_report["gpu_experts"] = self.gpu_experts
        self.load_report["gpu_bytes"] = sum(w.nbytes for w in self.resident)

    def _uses_resident(self, x: torch.Tensor) -> bool:
        return self.resident is not None and x.device == self.resident[0].device

    def _build(self, source: WeightSource, dtype: torch.dtype) -> cpu.CPUMoE:
        t0 = time.perf_counter()
        h, i = self.hidden_size, self.intermediate_size
        mats, types = [], []
        for kind, (rows, cols) in zip(("gate", "up", "down"), ((i, h), (i, h), (h, i))):
            w, qtype = self._matrix(source, kind, rows, cols, dtype)
            mats.append(w)
            types.append(qtype)
        # A streaming op builds its layer at every call: it reads the blocks where they are (a copy into huge pages
        # or a repack would cost more per call than it saves)
        keep = not self.streaming
        moe = cpu.CPUMoE(*mats, n_experts=self.num_experts, hidden=h, intermediate=i, types=tuple(types),
                         hugepages=self.hugepages and keep, repack=self.repack and keep, config=self.cpu_config)
        self.load_report = {"types": tuple(types), "bytes": moe.nbytes, "load_s": time.perf_counter() - t0,
                            "path": moe.path, "hugepages": moe.hugepages, "layouts": moe.layouts,
                            "repack_s": moe.repack_s}
        return moe

    def _matrix(self, source: WeightSource, kind: str, rows: int, cols: int, dtype: torch.dtype):
        """(weights, ggml type name) of one stacked matrix kind, as the kernels will read them."""
        raw = source.get_raw_experts(self.layer, kind)
        if tuple(raw.shape) != (self.num_experts, rows, cols):
            raise ValueError(f"{self.key}: {raw.name} has shape {tuple(raw.shape)}, expected "
                             f"{(self.num_experts, rows, cols)}")
        name = Q.quant_type(raw.ggml_type).name
        if name in _TORCH_FLOAT:  # float experts: quantize to self.quant (or keep a float type)
            floats = raw.data.contiguous().view(_TORCH_FLOAT[name]).reshape(self.num_experts, rows, cols)
            return self._from_float(floats, kind, dtype)
        if name in NATIVE_TYPES:
            return raw.data, name
        keep = "BF16" if dtype == torch.bfloat16 else "F32"
        log.warning("%s: %s is %s, which the CPU expert kernels do not read; dequantizing it to %s", self.key,
                    raw.name, name, keep)
        out = torch.empty(self.num_experts, rows, cols, dtype=_TORCH_FLOAT[keep])
        for e in range(self.num_experts):
            out[e] = torch.from_numpy(Q.dequantize(raw.data[e].contiguous().numpy(), name, (rows, cols)))
        return out, keep

    def _from_float(self, floats: torch.Tensor, kind: str, dtype: torch.dtype):
        quant = self.quant or ("BF16" if dtype == torch.bfloat16 else "F32")
        cols = floats.shape[-1]
        if quant not in _TORCH_FLOAT and cols % Q.quant_type(quant).block_size:
            log.info("%s: %s rows of %d values do not fill %s blocks; keeping them as F32", self.key, kind, cols,
                     quant)
            quant = "F32"
        if quant in _TORCH_FLOAT:
            return floats.to(_TORCH_FLOAT[quant]).contiguous(), quant
        e, rows, _ = floats.shape
        out = np.empty((e, rows, Q.row_bytes(quant, cols)), np.uint8)
        for j in range(e):  # one expert at a time bounds the float32 temporaries
            out[j] = Q.quantize(floats[j].float().numpy(), quant)
        return torch.from_numpy(out), quant

    # ---- running --------------------------------------------------------------------------------------------------
    # Inputs on a GPU stay there: the layer runs on the GPU's stream (ktrans.kernels.cpu_stream), its submit and
    # wait enqueued as host functions between copies into and out of pinned buffers, so neither the Python thread
    # nor the stream's other work waits on a blocking copy (and a CUDA graph can capture the layer).
    def input_device(self, device: torch.device) -> torch.device:
        if device.type == "cuda" and not self.streaming and cpu_stream.available()[0]:
            return device
        return self.device

    def reserve(self, max_tokens: int) -> None:
        """Size the stream path's pinned buffers for steps of up to max_tokens tokens before any graph is captured
        (ModelRunner calls this once): they never move afterwards."""
        self._reserved = max(self._reserved, max_tokens)
        if self._stream is not None and self._stream.staging.max_rows < max_tokens:
            self._stream = None  # rebuilt on the next submit, at the new size

    def stream_call(self, k: int) -> cpu_stream.StreamMoE:
        if self._stream is None or self._stream.staging.k != k:
            if self.moe is None:
                raise RuntimeError(f"{self.key}: KExpertsCPU has no weights; load() it first")
            staging = cpu_stream.Staging.shared(self.hidden_size, k, self._reserved)
            self._stream = cpu_stream.StreamMoE(self.moe, staging, self.key)
        return self._stream

    def _begin(self, x: torch.Tensor) -> None:
        if self._pending is not None or self._on_stream is not None:
            raise RuntimeError(f"{self.key}: submit() called twice without sync()")
        self._out_dtype = x.dtype

    def _on_stream_call(self, x: torch.Tensor, k: int) -> tuple[cpu_stream.StreamMoE, int | None]:
        """The stream call for a step of x's rows (grown first for a step larger than reserved: a direct call) and
        the step's live rows (a padded batch's live sequences; None: all)."""
        call = self.stream_call(k)
        if x.shape[0] > call.staging.max_rows:
            self.reserve(x.shape[0])
            call = self.stream_call(k)
        batch = current_batch()
        return call, batch.num_live if batch is not None else None

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self._begin(x)
        slots = None
        if self._uses_resident(x):
            from ktrans.kernels.triton.moe_quant import moe_quant, split_resident

            # one launch: the resident experts' pairs under their slots, the rest (their ids) for the CPU, each side
            # with the other's pairs masked to -1 (the C++ and the Triton MoE skip negative ids; the shapes stay the
            # step's, so a CUDA graph captures both halves)
            slots, topk_ids = split_resident(topk_ids, self._slot_of)
        if x.is_cuda:
            call, live = self._on_stream_call(x, topk_ids.shape[1])
            call.submit(x, topk_ids, topk_weights, live=live)
            self._on_stream = x.device
        else:
            moe = self.moe
            if moe is None:
                if not self.streaming or self.source is None:
                    raise RuntimeError(f"{self.key}: KExpertsCPU has no weights; load() it first")
                moe = self._build(self.source, self.dtype)  # streaming: GGUF blocks are views of the map, no copy
            self._pending = moe.submit(x, topk_ids, topk_weights)
        if slots is not None:
            # after the CPU's share is handed off, so that the GPU computes the resident pairs while the CPU works
            # (launched before it, the CPU started only once they were done: session 20, doc/benchmarks.md)
            try:
                self._resident_out = moe_quant(x, slots, topk_weights, *self.resident)
            except BaseException:
                # the CPU's share is in flight: drain it, so the next step starts clean, and report the GPU's error
                self._resident_out = None
                try:
                    self.sync()
                except Exception:  # noqa: BLE001 - the GPU's error is the one to report
                    pass
                raise

    def takes_logits(self, x: torch.Tensor, k: int) -> bool:
        """Whether submit_logits can run for x: on a GPU, on the stream's flag path."""
        if not (x.is_cuda and not self.streaming and self.moe is not None and cpu_stream.available()[0]) or \
                self._uses_resident(x):  # the resident experts need the ids before the stage-in
            return False
        return self.stream_call(k).flagged

    def submit_logits(self, x: torch.Tensor, logits: torch.Tensor, k: int, renorm: bool) -> None:
        """submit() with the routing (top k of the router's logits) done inside the stage-in launch."""
        self._begin(x)
        call, live = self._on_stream_call(x, k)
        call.submit_logits(x, logits, renorm, live=live)
        self._on_stream = x.device

    def sync_staged(self) -> tuple[torch.Tensor, torch.dtype] | None:
        """After submit_logits: (the output rows in the pinned staging, fp32, the dtype sync() would have given),
        for a kernel that reads them in place; None where the call is not on the flag path (then sync())."""
        if self._on_stream is None or not self._stream.flagged or self._out_dtype not in (torch.float32,
                                                                                            torch.bfloat16):
            return None
        self._on_stream = None
        return self._stream.sync_staged(), self._out_dtype

    def sync(self) -> torch.Tensor:
        extra, self._resident_out = self._resident_out, None
        if self._on_stream is not None:
            device, self._on_stream = self._on_stream, None
            out = self._stream.sync(device, self._out_dtype)
        else:
            if self._pending is None:
                raise RuntimeError(f"{self.key}: sync() without submit()")
            pending, self._pending = self._pending, None
            out = pending.wait().to(self._out_dtype)
        return out if extra is None else out + extra

    def check(self) -> None:
        """Raise a failure the stream path reported since the last check (the engine calls this after a step)."""
        if self._stream is not None:
            self._stream.check()

    def extra_repr(self) -> str:
        if not self.load_report:
            return f"quant={self.quant or 'model dtype'}"
        r = self.load_report
        pages = "huge pages" if r.get("hugepages") else "4 KiB pages"
        layouts = "/".join(r.get("layouts", r["types"]))
        return f"{layouts}, {r['bytes'] / 2**20:.1f} MiB, {r['path']}, {pages}"

"""KExpertsMarlin: the routed experts of one MoE layer on the GPU, quantized as the GGUF stores them, through the
Triton MoE (ktrans.kernels.triton.moe_quant).

Importing this module registers the op under EXPERT_OPS (ktrans.operators.experts declares it). At load the layer's
stacked ffn_{gate,up,down}_exps blocks go to the GPU as stored and are repacked there (ktrans.kernels.triton.
quant_layout; gate and up as one [E, 2I, H] stack), so all experts stay at ~4.6 bits per weight (Q4_K): the 80B
model's 48 layers take ~45 GB instead of ~160 GB in bf16. It reads Q4_K, Q5_K, Q6_K and Q8_0 with rows of whole
256-weight super-blocks (every expert tensor of the 80B file), gate and up of one type (llama.cpp's mixes give them
one). A layer it cannot read that way (a float checkpoint; another type, with a warning) runs as KExpertsTorch does,
on floats in the model dtype, so the GPU rules still serve any checkpoint.

submit() launches the kernels and sync() returns their output: no host sync and buffers sized by the token count, so
a decode step can be captured in a CUDA graph. A streaming op (prefill placed apart from decode) keeps nothing
resident: each call copies and repacks only the experts the batch routes to (it reads the routing on the host,
which prefill may), and `last_stream` records what that cost.

The name is KTransformers'; there is no Marlin kernel here. Rules place it on CUDA; the tests also build it on the
CPU, where Triton's interpreter runs it.
"""
from __future__ import annotations

import logging
import time

import torch

from ktrans.kernels.triton.moe_quant import moe_quant
from ktrans.kernels.triton.quant import plane_args
from ktrans.kernels.triton.quant_layout import PackedWeight, concat_rows, packable, repack
from ktrans.operators.experts import EXPERT_OPS, KExpertsTorch, layer_index
from ktrans.operators.linear_marlin import check_device, keep_buffers
from ktrans.weights.source import RawExperts, WeightSource

log = logging.getLogger(__name__)
_FLOATS = ("F32", "F16", "BF16")


@EXPERT_OPS.register("KExpertsMarlin", devices=("cuda",))
class KExpertsMarlin(KExpertsTorch):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        check_device(self.key, "KExpertsMarlin", device)
        self.layer = layer_index(operator.key, "KExpertsMarlin")
        self.gate_up: PackedWeight | None = None
        self.down: PackedWeight | None = None
        self.load_report: dict = {}
        self.last_stream: dict = {}

    # ---- loading --------------------------------------------------------------------------------------------------
    def _raw(self, source: WeightSource) -> list[RawExperts] | None:
        return raw_stacks(source, self.layer, self.key, self.num_experts, self.hidden_size, self.intermediate_size)

    def _pack(self, raws: list[RawExperts], experts: torch.Tensor | None = None
              ) -> tuple[PackedWeight, PackedWeight]:
        """(gate_up, down) of all experts, or of `experts` (host indices) only."""
        return pack_stacks(raws, self.device, experts)

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        t0 = time.perf_counter()
        raws = self._raw(source)
        if raws is None:  # floats (or a type the kernels do not read): KExpertsTorch's weights
            super().load(source, dtype)
            self.load_report = {"types": (str(dtype).removeprefix("torch."),), "load_s": time.perf_counter() - t0,
                                "bytes": sum(w.numel() * w.element_size() for w in self.w.values())}
            return
        self.gate_up, self.down = self._pack(raws)
        plane_args(self.down)  # makes the stand-in planes now, not inside a CUDA graph capture
        keep_buffers(self, "gate_up", self.gate_up)
        keep_buffers(self, "down", self.down)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_report = {"types": tuple(r.type_name for r in raws), "load_s": time.perf_counter() - t0,
                            "bytes": self.nbytes}

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.gate_up, self.down) if w is not None)

    # ---- running --------------------------------------------------------------------------------------------------
    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if self._result is not None:
            raise RuntimeError(f"{self.key}: submit() called twice without sync()")
        if not self.streaming:
            if self.gate_up is None:
                if not len(self.w):
                    raise RuntimeError(f"{self.key}: KExpertsMarlin has no weights; load() it first")
                return super().submit(x, topk_ids, topk_weights)
            self._result = moe_quant(x, topk_ids, topk_weights, self.gate_up, self.down)
            return
        if self.source is None:
            raise RuntimeError(f"{self.key}: a streaming KExpertsMarlin needs its source (set by the injector)")
        raws = self._raw(self.source)
        if raws is None:
            return super().submit(x, topk_ids, topk_weights)
        t0 = time.perf_counter()
        used = torch.unique(topk_ids[topk_ids >= 0]).cpu()  # prefill: reading the routing back is allowed
        remap = torch.full((self.num_experts,), -1, dtype=topk_ids.dtype, device=topk_ids.device)
        remap[used.to(topk_ids.device)] = torch.arange(used.numel(), dtype=topk_ids.dtype, device=topk_ids.device)
        gate_up, down = self._pack(raws, used)
        ids = torch.where(topk_ids >= 0, remap[topk_ids.clamp(min=0)], -1)
        # host time to copy and repack (the device work is queued, not waited for)
        self.last_stream = {"experts": used.numel(), "bytes": gate_up.nbytes + down.nbytes,
                            "host_s": time.perf_counter() - t0}
        self._result = moe_quant(x, ids, topk_weights, gate_up, down)

    def extra_repr(self) -> str:
        if not self.load_report:
            return "streaming" if self.streaming else "not loaded"
        r = self.load_report
        return f"{'/'.join(r['types'])}, {r['bytes'] / 2**20:.1f} MiB, loaded in {r['load_s']:.2f} s"


def raw_stacks(source: WeightSource, layer: int, key: str, num_experts: int, hidden: int, inter: int
               ) -> list[RawExperts] | None:
    """A layer's gate, up and down expert stacks as stored, or None when the packed GPU kernels cannot read them
    (why: logged)."""
    h, i = hidden, inter
    raws = []
    for kind, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        raw = source.get_raw_experts(layer, kind)
        if tuple(raw.shape) != (num_experts, *shape):
            raise ValueError(f"{key}: {raw.name} has shape {tuple(raw.shape)}, expected {(num_experts, *shape)}")
        raws.append(raw)
    bad = [r for r, cols in zip(raws, (h, h, i)) if not packable(r.type_name, cols)]
    if bad or raws[0].type_name != raws[1].type_name:
        if any(r.type_name not in _FLOATS for r in raws):
            why = (f"{bad[0].name} is {bad[0].type_name} with rows of {bad[0].shape[-1]}" if bad else
                   f"gate ({raws[0].type_name}) and up ({raws[1].type_name}) differ in type")
            log.warning("%s: %s, which the quantized GPU experts do not read; dequantizing the layer to the model "
                        "dtype", key, why)
        return None
    return raws


def pack_stacks(raws: list[RawExperts], device: torch.device, experts: torch.Tensor | None = None
                ) -> tuple[PackedWeight, PackedWeight]:
    """(gate_up, down) packed on `device`, of all experts or of `experts` (host indices) only."""
    packed = []
    for raw in raws:
        data = raw.data if experts is None else raw.data[experts]
        packed.append(repack(data, raw.type_name, (data.shape[0], *raw.shape[1:]), device))
    return concat_rows(packed[:2]), packed[2]

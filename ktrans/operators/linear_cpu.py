"""KLinearCPUInfer: a dense projection (or lm_head) on the CPU cores through the C++ quantized linear (ktrans._cpu).

Importing this module registers the op under LINEAR_OPS (ktrans.operators.linear declares it), so a rule's
`generate_op: "KLinearCPUInfer"` picks it. What it keeps of the weight:

- a GGUF checkpoint: the tensor's blocks as the file stores them, read in place from the mapped file (no copy, no
  dequantized float copy in RAM) when the kernels read the type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
  BF16, F16, F32); other types (Q2_K, Q3_K, IQ*) are dequantized once at load to the model dtype, with a warning;
- float weights: as stored under a float32 model (the kernels multiply in float32, so the products are
  KLinearTorch's), rounded to the model dtype under a narrower one; with the rule kwarg `quant` (Q8_0, Q4_K, Q5_K,
  Q6_K), quantized at load.

Q4_K and Q5_K weights are repacked 16 rows at a time at load (rule kwarg `repack`, default true), the layout the
expert kernels read: one extra buffer of the matrix's size, the file's pages left cold.

A projection the GGUF stores as two tensors of different types (the split in_proj_qkvz: attn_qkv and attn_gate, Q4_K
and Q6_K in llama-quantize's Q4_K_M mix for some layers) is kept as its two quantized matrices: both jobs are
submitted before either is waited for, and their outputs are concatenated and put in HF's row order. Read as one
float matrix instead, such a layer read 100 MB a token at the 80B shapes where its blocks are ~17 MB.

The kernels take float32 activations and sum in float32; the output comes back in x's dtype. A bias, where the
module has one, is added in float32 before that.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ktrans.kernels import cpu
from ktrans.operators.base import Op
from ktrans.operators.linear import LINEAR_OPS
from ktrans.weights import quants as Q
from ktrans.weights.source import WeightSource

log = logging.getLogger(__name__)

NATIVE_TYPES = cpu.KERNEL_TYPES
QUANTS = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
_TORCH_FLOAT = cpu.TORCH_FLOAT


@LINEAR_OPS.register("KLinearCPUInfer", devices=("cpu",))
class KLinearCPUInfer(Op):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.specs = operator.param_specs()
        self.n_out, self.n_in = operator.out_features, operator.in_features
        quant = (getattr(operator, "options", {}).get("quant") or "").upper() or None
        if quant is not None and quant not in QUANTS:
            raise ValueError(f"{self.key}: KLinearCPUInfer quant must be one of {QUANTS}, got {quant!r}")
        self.quant = quant
        self.repack = bool(getattr(operator, "options", {}).get("repack", True))
        self.lin: cpu.CPULinear | None = None
        self.parts: list[cpu.CPULinear] = []  # the stored tensors' matrices, where a projection is two of them
        self.order: torch.Tensor | None = None  # HF column j of the output is column order[j] of the parts' outputs
        self.bias: torch.Tensor | None = None
        self.qtype = ""
        self.raw = None  # the stored blocks it reads (a RawTensor), where it reads one matrix as stored

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        name = self.specs[0].name
        raws, order = source.get_raw_parts(name)
        # quantized parts of two types: each as stored (float parts go through _weight: the quant kwarg, rounding)
        if len(raws) > 1 and len({r.type_name for r in raws}) > 1 and \
                all(r.type_name in NATIVE_TYPES and r.type_name not in _TORCH_FLOAT for r in raws):
            if sum(r.shape[0] for r in raws) != self.n_out or any(r.shape[-1] != self.n_in for r in raws):
                raise ValueError(f"{self.key}: {', '.join(r.name for r in raws)} have shapes "
                                 f"{[tuple(r.shape) for r in raws]}, expected {(self.n_out, self.n_in)} in all")
            self.parts = [cpu.CPULinear(r.data, r.shape[0], self.n_in, qtype=r.type_name, repack=self.repack)
                          for r in raws]
            self.lin = self.parts[0]
            self.order = order
            self.qtype = "+".join(r.type_name for r in raws)
        else:  # one stored tensor, or parts of one type (the source regroups their rows itself)
            raw = source.get_raw(name)
            if tuple(raw.shape) != (self.n_out, self.n_in):
                raise ValueError(f"{self.key}: {raw.name} has shape {tuple(raw.shape)}, expected "
                                 f"{(self.n_out, self.n_in)}")
            weight, self.qtype = self._weight(raw, dtype)
            self.lin = cpu.CPULinear(weight, self.n_out, self.n_in, qtype=self.qtype, repack=self.repack)
            self.raw = raw if weight is raw.data else None
        if len(self.specs) > 1:
            self.bias = source.require(self.specs[1].name, self.specs[1].shape, torch.float32, "cpu")

    def _weight(self, raw, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
        name = raw.type_name
        if name in _TORCH_FLOAT:  # float bytes: keep the model dtype (exact), or quantize when the rule asks
            floats = raw.data.contiguous().view(_TORCH_FLOAT[name]).reshape(self.n_out, self.n_in)
            if self.quant is not None and self.n_in % Q.quant_type(self.quant).block_size == 0:
                return torch.from_numpy(Q.quantize(floats.float().numpy(), self.quant)), self.quant
            # A float32 model computes with the stored values exactly (the kernels multiply in float32), so the
            # stored type is kept; a narrower model dtype rounds the weights as KLinearTorch would.
            keep = name if dtype == torch.float32 else {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
            return floats.to(_TORCH_FLOAT[keep]).contiguous(), keep
        if name in NATIVE_TYPES:
            return raw.data, name
        keep = "BF16" if dtype == torch.bfloat16 else "F32"
        log.warning("%s: %s is %s, which the CPU linear kernels do not read; dequantizing it to %s", self.key,
                    raw.name, name, keep)
        deq = Q.dequantize(raw.data.contiguous().numpy(), name, (self.n_out, self.n_in))
        return torch.from_numpy(np.ascontiguousarray(deq)).to(_TORCH_FLOAT[keep]), keep

    def begin(self, x: torch.Tensor):
        """Queue this projection's job(s) on the pool and return at once a function that waits for them and gives
        forward(x)'s result: projections of one input (ktrans.operators.linear.project) queue theirs together."""
        if self.lin is None:
            raise RuntimeError(f"{self.key}: KLinearCPUInfer has no weights; load() it first")
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.n_in)
        pending = [p.submit(x2) for p in (self.parts or (self.lin,))]  # queued back to back on the pool

        def finish() -> torch.Tensor:
            if self.parts:
                y = torch.cat([p.wait() for p in pending], dim=-1).index_select(-1, self.order)
            else:
                y = pending[0].wait()
            if self.bias is not None:
                y += self.bias
            return y.to(dtype).reshape(*shape[:-1], self.n_out)

        return finish

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.begin(x)()

    def extra_repr(self) -> str:
        if self.parts:
            return f"{' + '.join(p.layout for p in self.parts)}, {self.lin.path}"
        return f"{self.lin.layout}, {self.lin.path}" if self.lin else "not loaded"

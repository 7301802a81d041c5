"""KLinearMarlin (KTransformers' VLinearMarlin): a dense projection on the GPU through the Triton quantized kernels
(ktrans.kernels.triton.quant) on the GGUF's own blocks, repacked at load (ktrans.kernels.triton.quant_layout).

Importing this module registers the op under LINEAR_OPS (ktrans.operators.linear declares it). What it keeps:

- Q4_K, Q5_K, Q6_K, Q8_0 with whole 256-weight super-blocks per row: the packed planes (the stored bytes go to the
  GPU and are repacked there), ~4.6 bits per weight for Q4_K; nothing is dequantized in memory;
- F32 / F16 / BF16: the floats in the model dtype, multiplied with F.linear (KLinearTorch's math), or for 1-4 rows
  (decode) by ktrans.kernels.triton.dense_gemv (the router's gate: one launch for what cuBLAS took 5.4 us over);
- any other type (Q5_0, Q4_0, ...; rows that are not whole super-blocks): dequantized once at load to the model
  dtype, with a warning.

A projection the GGUF stores as two tensors of different types (in_proj_qkvz as attn_qkv + attn_gate) keeps two
matrices and puts their output columns into HF's order; of one type, the source regroups the stored rows and it is
one matrix. The name is KTransformers': there is no Marlin kernel here (Marlin's integer zero points cannot hold
Q4_K's float mins), the rule files only keep their op names.

Rules place it on CUDA only; the tests also build it on the CPU, where it runs under Triton's interpreter
(TRITON_INTERPRET=1).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from ktrans.kernels.triton import interpreting, unavailable_reason
from ktrans.kernels.triton.dense_gemv import MAX_ROWS as DENSE_MAX_ROWS
from ktrans.kernels.triton.dense_gemv import dense_gemv
from ktrans.kernels.triton.quant import plane_args, qlinear, qlinear_pair
from ktrans.kernels.triton.quant_layout import PackedWeight, packable, repack
from ktrans.operators.base import Op
from ktrans.operators.linear import LINEAR_OPS, pair_of
from ktrans.weights import quants as Q
from ktrans.weights.source import RawTensor, WeightSource

log = logging.getLogger(__name__)

_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_device(key: str, op: str, device: torch.device) -> None:
    """The Triton ops run on CUDA, and on the CPU only under the interpreter."""
    if device.type == "cpu" and not interpreting():
        raise ValueError(f"{key}: {op} runs on CUDA; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1,"
                         f" for tests)")
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"{key}: {op} needs Triton: {why}")


class Matrix:
    """One stored part of the weight: packed blocks or floats."""

    def __init__(self, packed: PackedWeight | None, dense: torch.Tensor | None, qtype: str):
        self.packed, self.dense, self.qtype = packed, dense, qtype

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else self.dense.numel() * self.dense.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return qlinear(x, self.packed)
        x = x.to(self.dense.dtype)
        if 0 < x.shape[0] <= DENSE_MAX_ROWS and x.dim() == 2 and (x.is_cuda or interpreting()):
            return dense_gemv(x, self.dense)  # decode rows: one Triton launch, not a cuBLAS GEMM
        return F.linear(x, self.dense)


def keep_buffers(module: torch.nn.Module, tag: str, packed: PackedWeight | None, dense: torch.Tensor | None = None
                 ) -> None:
    """Register the tensors an op holds as (non-persistent) buffers, so what counts a model's memory sees them."""
    tensors = packed.planes() if packed is not None else {"w": dense}
    for name, t in tensors.items():
        module.register_buffer(f"{tag}_{name}", t, persistent=False)


def load_matrix(key: str, raw: RawTensor, dtype: torch.dtype, device: torch.device) -> Matrix:
    """A stored tensor as the GPU op keeps it (see the module docstring)."""
    name, (n, k) = raw.type_name, raw.shape
    if packable(name, k):
        packed = repack(raw.data, name, (n, k), device)
        plane_args(packed)  # makes the stand-in planes now, not inside a CUDA graph capture
        return Matrix(packed, None, name)
    if name in _FLOATS:
        floats = raw.data.contiguous().view(_FLOATS[name]).reshape(n, k)
        return Matrix(None, floats.to(device=device, dtype=dtype), name)
    log.warning("%s: %s is %s with rows of %d, which the GPU quantized kernels do not read; dequantizing it to %s",
                key, raw.name, name, k, str(dtype).removeprefix("torch."))
    deq = Q.dequantize(raw.data.contiguous().numpy(), name, (n, k))
    return Matrix(None, torch.from_numpy(np.ascontiguousarray(deq)).to(device=device, dtype=dtype), name)


@LINEAR_OPS.register("KLinearMarlin", devices=("cuda",), aliases=("VLinearMarlin",))
class KLinearMarlin(Op):
    def __init__(self, operator, device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        check_device(self.key, "KLinearMarlin", device)
        self.specs = operator.param_specs()
        self.n_out, self.n_in = operator.out_features, operator.in_features
        self.parts: list[Matrix] = []
        self.place: torch.Tensor | None = None  # column c of the parts' concatenation is output column place[c]
        self.stored_rows: list[int] | None = None  # the stored tensors' row counts, where the rows are regrouped
        self.bias: torch.Tensor | None = None

    def load(self, source: WeightSource, dtype: torch.dtype) -> None:
        name = self.specs[0].name
        raws, order = source.get_raw_parts(name)
        if sum(r.shape[0] for r in raws) != self.n_out or any(r.shape[-1] != self.n_in for r in raws):
            raise ValueError(f"{self.key}: {', '.join(r.name for r in raws)} have shapes "
                             f"{[tuple(r.shape) for r in raws]}, expected {(self.n_out, self.n_in)} in all")
        # A projection stored as two tensors keeps their rows in stored order (forward_stored hands out each part's
        # columns, which is what the DeltaNet wants); of one type, as one matrix of their rows one after the other
        self.stored_rows = [r.shape[0] for r in raws] if order is not None else None
        if len({r.type_name for r in raws}) == 1 and len(raws) > 1:
            raws = [RawTensor(raws[0].name, raws[0].ggml_type, (self.n_out, self.n_in),
                              torch.cat([r.data.reshape(r.shape[0], -1) for r in raws]))]
        self.parts = [load_matrix(self.key, r, dtype, self.device) for r in raws]
        for i, part in enumerate(self.parts):
            keep_buffers(self, f"part{i}", part.packed, part.dense)
        # HF row j is row order[j] of the concatenated parts: their outputs are scattered by the inverse
        self.place = None if order is None else torch.argsort(order).to(self.device)
        if len(self.specs) > 1:
            self.bias = source.require(self.specs[1].name, self.specs[1].shape, dtype, self.device)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def packed_weight(self) -> PackedWeight | None:
        """The one packed matrix this op multiplies by, in HF's row order (None: floats, two parts or a bias), for
        an operator that runs it inside a fused kernel (KQwen3NextMLP's one-expert MoE)."""
        if len(self.parts) == 1 and self.place is None and self.bias is None:
            return self.parts[0].packed
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parts:
            raise RuntimeError(f"{self.key}: KLinearMarlin has no weights; load() it first")
        shape = x.shape
        x2 = x.reshape(-1, self.n_in)
        if len(self.parts) == 1 and self.place is None:
            y = self.parts[0](x2)
        else:
            y = torch.empty(x2.shape[0], self.n_out, dtype=x.dtype, device=x.device)
            start = 0
            for part in self.parts:
                yp = part(x2)
                y.index_copy_(1, self.place[start:start + yp.shape[1]], yp.to(y.dtype))
                start += yp.shape[1]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.n_out)

    def forward_stored(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """x times each stored tensor of a regrouped projection, in stored row order, one output per stored tensor
        (in_proj_qkvz from a split GGUF: [q | k | v] of all heads and z, the DeltaNet's conv input and gate as they
        are, where HF's per-key-head order would be undone again); None for a projection stored as HF has it. The
        same products as forward's, only not scattered."""
        if self.stored_rows is None or not self.parts or self.bias is not None:
            return None
        x2 = x.reshape(-1, self.n_in)
        if len(self.parts) == 1:
            outs = list(self.parts[0](x2).split(self.stored_rows, dim=1))
        else:
            outs = [part(x2) for part in self.parts]
        return [y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1]) for y in outs]

    def extra_repr(self) -> str:
        if not self.parts:
            return "not loaded"
        kinds = "+".join(p.qtype + ("" if p.packed is not None else " (float)") for p in self.parts)
        return f"{kinds}, {self.nbytes / 2**20:.1f} MiB"


def pair_plan(lins, phase: str, dev: torch.device) -> tuple[list[PackedWeight], tuple[int, int]] | None:
    """For projections of one input (KTransformersLinears) on `dev` in `phase`: their packed matrices and the first
    two of one type and width, which qlinear_pair runs in one launch; None where one is not a single KLinearMarlin
    matrix in HF's row order (floats, two parts, a bias) or no two match."""
    from ktrans.operators.base import BaseOperator

    ws = []
    for lin in lins:
        op = lin.impl.get(phase) if isinstance(lin, BaseOperator) else None
        if op is None or lin.devices[phase] != dev or lin.out_devices[phase] != dev or \
                not isinstance(op, KLinearMarlin):
            return None
        w = op.packed_weight()
        if w is None:
            return None
        ws.append(w)
    pair = pair_of(ws)
    return (ws, pair) if pair is not None else None


def run_pair_plan(x: torch.Tensor, plan: tuple[list[PackedWeight], tuple[int, int]]) -> list[torch.Tensor]:
    """One row through a pair_plan: the paired two in one launch, the others one launch each; outputs in order."""
    ws, (i, j) = plan
    outs: list[torch.Tensor | None] = [None] * len(ws)
    outs[i], outs[j] = qlinear_pair(x, ws[i], ws[j])
    for n, w in enumerate(ws):
        if outs[n] is None:
            outs[n] = qlinear(x, w)
    return outs

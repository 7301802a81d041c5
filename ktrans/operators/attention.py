"""KQwen3NextAttention: gated full attention over the paged KV cache, with a choice of attention kernels.

The operator holds the layer's math: q_proj yields the query and a per-head output gate, q/k RMSNorm, partial NeoX
RoPE, then its op, then the sigmoid gate and o_proj. The projections and q/k norms are the replaced module's
children, placed by their own rules. The op is the part that touches the KV pool: write this step's keys and
values, then attend. KAttentionTorch runs the reference kernels; KAttentionTriton (`ktrans/operators/layers_triton.py`)
the Triton ones (varlen prefill over a cached prefix, split-K decode that CUDA graphs capture); KAttentionFlashInfer
(`ktrans/operators/attention_flashinfer.py`, where flashinfer-python imports) FlashInfer's paged kernels, planned from
page lists (`page_lists`). The KV pool pins the operator to one device for both phases.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ktrans.kernels.torch.attention import paged_attention, paged_attention_decode, write_kv
from ktrans.model.qwen3_next import Qwen3NextAttention
from ktrans.operators import linear as linear_ops
from ktrans.operators.base import BaseOperator, Op, OpRegistry, move, register_operator
from ktrans.operators.linear import project
from ktrans.operators.norm import KQwen3NextRMSNorm
from ktrans.operators.rope import RopeTables
from ktrans.runtime.batch import ForwardBatch

ATTENTION_OPS = OpRegistry("attention")
ATTENTION_OPS.declare("KAttentionTriton", devices=("cuda", "cpu"), module="ktrans.operators.layers_triton",
                      provided_by="triton (the cpu device only under TRITON_INTERPRET=1)")
ATTENTION_OPS.declare("KAttentionFlashInfer", devices=("cuda",), module="ktrans.operators.attention_flashinfer",
                      provided_by="flashinfer-python (`pip install flashinfer-python`; its kernels compile for the GPU "
                                  "on first use) and a CUDA GPU")
# The C++ paged decode attention (ktrans._cpu) for the CPU placement; prefill takes the torch op's path.
ATTENTION_OPS.declare("KAttentionCPU", devices=("cpu",), module="ktrans.operators.layers_cpu",
                      provided_by="the C++ extension ktrans._cpu (built by `pip install -e .`)")


@dataclass
class AttentionPlan:
    """One step's attention metadata, from the batch's host lists."""

    decode: bool          # one new token per sequence: the batched decode kernel
    max_kv_len: int       # the longest sequence's KV length (what the decode kernel gathers up to)
    cu_seqlens: list[int]  # varlen path: token offsets of each sequence
    kv_lens: list[int]     # varlen path: KV length of each sequence


@ATTENTION_OPS.register("KAttentionTorch", devices=("cpu", "cuda"))
class KAttentionTorch(Op):
    def __init__(self, operator: "KQwen3NextAttention", device: torch.device, streaming: bool = False):
        super().__init__(operator, device, streaming)
        self.layer_idx = operator.layer_idx
        self.scaling = operator.scaling
        self.step: AttentionPlan | None = None

    def plan(self, batch: ForwardBatch) -> None:
        self.mark_planned(batch)
        self.step = AttentionPlan(decode=all(n == 1 for n in batch.seq_lens), max_kv_len=batch.max_kv_len,
                                  cu_seqlens=batch.cu_seqlens_host, kv_lens=batch.kv_lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> o [T, Hq, D]. Reads nothing back from the device once planned."""
        if not self.planned_for(batch):
            self.plan(batch)
        k_cache, v_cache = batch.kv.layer(self.layer_idx)
        check_pool_device(self.key, "KV cache", k_cache, self.device)
        write_kv(k_cache, v_cache, batch.slot_mapping, k.to(k_cache.dtype), v.to(v_cache.dtype))
        step, page = self.step, batch.kv.page_size
        if step.decode:
            # A runner's batch carries the lengths on the device; else the one new token sits at kv_len - 1.
            lens = batch.kv_lens_t if batch.kv_lens_t is not None else batch.positions + 1
            return paged_attention_decode(q, k_cache, v_cache, lens, batch.block_tables, page, self.scaling,
                                          max_len=step.max_kv_len)
        return paged_attention(q, k_cache, v_cache, step.cu_seqlens, step.kv_lens, batch.block_tables, page,
                               self.scaling)


def page_lists(tables: np.ndarray, kv_lens: list[int], page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The paged-KV description FlashInfer plans from, for B sequences given their block tables (rows of page ids,
    -1 past the end) and KV lengths: (indptr [B + 1], page ids [indptr[-1]], last page's fill [B]), int32, each
    sequence's first ceil(len / page) pages in order."""
    if len(kv_lens) > tables.shape[0]:
        raise ValueError(f"{len(kv_lens)} sequences but block tables of {tables.shape[0]}")
    counts = [-(-int(n) // page) for n in kv_lens]
    for i, (n, c) in enumerate(zip(kv_lens, counts)):
        if n < 1 or c > tables.shape[1] or (c and tables[i, c - 1] < 0):
            raise ValueError(f"sequence {i}: a KV length of {n} needs {c} pages of {page}, its block table row holds "
                             f"{int((tables[i] >= 0).sum())}")
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(counts)
    ids = np.concatenate([tables[i, :c] for i, c in enumerate(counts)]).astype(np.int32) if counts \
        else np.zeros(0, dtype=np.int32)
    last = np.array([int(n) - (c - 1) * page for n, c in zip(kv_lens, counts)], dtype=np.int32)
    return indptr, ids, last


def check_pool_device(key: str, what: str, pool: torch.Tensor, device: torch.device) -> None:
    if pool.device != device:
        raise RuntimeError(f"{key} runs on {device} but its {what} is on {pool.device}: create the pools on the "
                           f"devices ktrans.inject.layer_devices(model) reports (ktrans.engine.engine.make_pools does)")


@register_operator()
class KQwen3NextAttention(BaseOperator):
    REPLACES = (Qwen3NextAttention,)
    OPS = ATTENTION_OPS
    DEFAULT_OP = "KAttentionTorch"
    ADOPT = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    ONE_DEVICE = "its KV cache pages live on one device"

    def __init__(self, key, orig: Qwen3NextAttention, config, **kwargs):
        super().__init__(key, orig, config, **kwargs)
        self.layer_idx = orig.layer_idx
        self.num_heads = orig.num_heads
        self.num_kv_heads = orig.num_kv_heads
        self.head_dim = orig.head_dim
        self.scaling = orig.scaling
        self._pair_plans: dict[str, tuple | None] = {}  # per phase: q/k/v's packed matrices, two in one launch

    def _pair_plan(self, phase: str, dev: torch.device):
        """linear_marlin.pair_plan of q_proj, k_proj and v_proj in this phase (built once; None where none pairs)."""
        if phase not in self._pair_plans:
            from ktrans.operators.linear_marlin import pair_plan

            self._pair_plans[phase] = pair_plan((self.q_proj, self.k_proj, self.v_proj), phase, dev)
        return self._pair_plans[phase]

    def _prep(self, phase: str, dev: torch.device, op, rope: RopeTables) -> tuple | None:
        """((q norm weight, eps), (k norm weight, eps), rope) for an op that takes q and k as projected and norms,
        rotates and writes them itself (`takes_prep`), where both norms are this model's zero-centred RMSNorm with
        their weights on `dev`, and the norms' ops and the tables are the Triton ones whose rounding the fused kernel
        repeats (`PREP_EXACT`: KRMSNormTriton, TritonRopeTables; KRoPETorch's rotation differs by 1-2 bf16 ulps);
        None otherwise (the norms and RoPE then run as their own operators)."""
        takes = getattr(op, "takes_prep", None)
        if takes is None or not takes() or not getattr(rope, "PREP_EXACT", False):
            return None
        norms = []
        for norm in (self.q_norm, self.k_norm):
            o = norm.impl.get(phase) if isinstance(norm, KQwen3NextRMSNorm) else None
            w = getattr(o, "weight", None)
            if w is None or not getattr(o, "PREP_EXACT", False) or w.device != dev or norm.devices[phase] != dev:
                return None
            norms.append((w, float(norm.eps)))
        return (*norms, rope)

    def forward(self, x: torch.Tensor, rope: RopeTables, batch: ForwardBatch) -> torch.Tensor:
        phase, dev = self.phase_device()
        x, rope, batch = move(x, dev), move(rope, dev), batch.on(dev)
        t, d = x.shape[0], self.head_dim
        # Children may sit elsewhere, so their outputs come back here.
        plan = self._pair_plan(phase, dev) if linear_ops.GEMV_PAIR and t == 1 and x.dim() == 2 else None
        if plan is not None:  # two of the three in one GEMV launch (KLinearMarlin matrices of one type and width)
            from ktrans.operators.linear_marlin import run_pair_plan

            qg, k, v = run_pair_plan(x, plan)
        else:
            qg, k, v = (move(y, dev) for y in project(x, self.q_proj, self.k_proj, self.v_proj))
        q, gate = qg.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        k, v = k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)
        op = self.op_for(phase)
        gated = getattr(op, "attend_gated", None)  # the gate in one launch, or in the attention's (KAttentionTriton)
        prep = self._prep(phase, dev, op, rope) if gated is not None and qg.stride(-1) == 1 else None
        if prep is not None:  # the q/k norms, RoPE and KV write in the op's launch (KTRANS_ATTN_PREP)
            return self.leave(move(self.o_proj(gated(q, k, v, batch, qg.reshape(t, -1), d, prep=prep)), dev), phase)
        q = move(self.q_norm(q), dev)
        k = move(self.k_norm(k), dev)
        q, k = rope.apply(q, k)
        if gated is not None and qg.stride(-1) == 1:
            out = gated(q, k, v, batch, qg.reshape(t, -1), d)
        else:
            out = op(q, k, v, batch).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.leave(move(self.o_proj(out), dev), phase)

"""KAttentionFlashInfer: the attention op on FlashInfer's paged kernels, an optional backend that a rule selects
(`generate_op: KAttentionFlashInfer` / `prefill_op: ...` on KQwen3NextAttention) where `flashinfer-python` imports
and the layer sits on a CUDA GPU. Importing this module registers it; without FlashInfer the import fails and the
registry names the package in its error.

It reads the pool the other attention ops use: a layer's keys and values [(pages + 1) * page, Hkv, D] are FlashInfer's
"NHD" pages [pages + 1, page, Hkv, D] as they are. A step writes its keys and values first (the Triton write_kv, as
KAttentionTriton: `layers_triton.write_step_kv`),
then runs FlashInfer's batch prefill (causal, each sequence's queries aligned to the end of its keys: chunked prefill
over a cached prefix, one-token rows mixed in) or, when every sequence brings one token, its batch decode (tensor
cores: a KV head serves 8 query heads in Qwen3-Next).

Planning. FlashInfer schedules a step on the host from page lists (indptr, page ids, the last page's fill:
`attention.page_lists`). They come from the host copy of the step that the runner prepared the batch from (its block
tables and lengths), so planning reads nothing back from the GPU. One planner per KV pool and device serves all the
pool's attention layers: the first layer of a step plans, the others find the step planned.

CUDA graphs. A decode step of b rows runs on a decode wrapper of b rows built for graphs (fixed buffers for indptr,
page ids and fills, sized for b rows of the block tables' full width), eager or captured alike. A replay runs no
Python, so the runner calls `replan(batch)` on every op that has one before each replay (ktrans.engine.graphs): the
planner plans the replayed step's lengths into the same buffers, which the captured kernels read. The capture itself
plans nothing: it follows the bucket's eager first step on the same batch, which planned.
"""
from __future__ import annotations

import weakref

import flashinfer
import torch

from ktrans.operators.attention import ATTENTION_OPS, page_lists
from ktrans.operators.base import Op
from ktrans.operators.layers_triton import write_step_kv
from ktrans.runtime.batch import ForwardBatch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partials); its documentation's size
DTYPES = (torch.bfloat16, torch.float16)  # what its kernels read
DEVICE_TYPES = ("cuda",)


class _Planner:
    """FlashInfer's wrappers for one KV pool on one device, and the step they were last planned for."""

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.device, self.heads, self.kv_heads, self.head_dim, self.scale = (device, num_heads, num_kv_heads,
                                                                              head_dim, scale)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decodes: dict[int, tuple[int, object]] = {}  # rows -> (page ids it holds, graph-ready wrapper)
        # the step planned last, weakly: the batch holds the pool, which keys this planner in _PLANNERS weakly
        self.step: weakref.ref | None = None
        self.decoding = False

    def _decode_wrapper(self, rows: int, width: int):
        held, wrapper = self.decodes.get(rows, (0, None))
        if wrapper is None or held < rows * width:  # a wider table than its buffers (outside the runner): a new one
            i32 = dict(dtype=torch.int32, device=self.device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(rows * width, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(rows, **i32))
            self.decodes[rows] = (rows * width, wrapper)
        return wrapper

    def plan(self, batch: ForwardBatch, dtype: torch.dtype) -> None:
        """Plan `batch`'s step, once for all the pool's layers (a replayed step is a new batch: planned again)."""
        if self.step is not None and self.step() is batch:
            return
        host = batch.on("cpu")  # a runner's batch: the host buffers it was prepared from (no device read)
        tables = host.block_tables.numpy()
        page = batch.kv.page_size
        indptr, ids, last = (torch.from_numpy(a) for a in page_lists(tables, batch.kv_lens, page))
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale, non_blocking=True)
        self.decoding = all(n == 1 for n in batch.seq_lens)
        if self.decoding:
            self._decode_wrapper(batch.num_seqs, tables.shape[1]).plan(
                indptr, ids, last, self.heads, self.kv_heads, self.head_dim, page, **common)
        else:
            qo = torch.tensor(batch.cu_seqlens_host, dtype=torch.int32)
            self.prefill.plan(qo, indptr, ids, last, self.heads, self.kv_heads, self.head_dim, page, causal=True,
                              **common)
        self.step = weakref.ref(batch)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page: int,
            out: torch.Tensor | None) -> torch.Tensor:
        paged = (k_cache.view(-1, page, *k_cache.shape[1:]), v_cache.view(-1, page, *v_cache.shape[1:]))
        if self.decoding:
            return self.decodes[q.shape[0]][1].run(q, paged, out=out)
        return self.prefill.run(q, paged)


# one planner per KV pool (weakly: a pool dropped with its engine takes its planners along) and device
_PLANNERS: "weakref.WeakKeyDictionary[object, dict[torch.device, _Planner]]" = weakref.WeakKeyDictionary()


@ATTENTION_OPS.register("KAttentionFlashInfer", devices=("cuda",))
class KAttentionFlashInfer(Op):
    """write_kv, then FlashInfer's paged batch prefill or decode over the layer's pages of the KV pool."""

    def __init__(self, operator, device: torch.device, streaming: bool = False):
        if device.type not in DEVICE_TYPES:
            raise ValueError(f"{operator.key}: KAttentionFlashInfer runs on a CUDA GPU, the rule places it on {device}")
        super().__init__(operator, device, streaming)
        self.layer_idx = operator.layer_idx
        self.scaling = operator.scaling
        self.num_kv_heads, self.num_heads, self.head_dim = operator.num_kv_heads, operator.num_heads, operator.head_dim
        self._out: dict[tuple, torch.Tensor] = {}  # decode outputs by shape: no allocation in a captured step

    def _planner(self, batch: ForwardBatch) -> _Planner:
        per_device = _PLANNERS.setdefault(batch.kv, {})
        if self.device not in per_device:
            per_device[self.device] = _Planner(self.device, self.num_heads, self.num_kv_heads, self.head_dim,
                                               self.scaling)
        return per_device[self.device]

    def plan(self, batch: ForwardBatch) -> None:
        b = self.mark_planned(batch)
        k_cache, _ = b.kv.layer(self.layer_idx)
        if k_cache.dtype not in DTYPES:
            raise ValueError(f"{self.key}: KAttentionFlashInfer reads bf16 or fp16 KV pools, this one is "
                             f"{k_cache.dtype} (load the model in bfloat16, or choose KAttentionTriton)")
        self._planner(b).plan(b, k_cache.dtype)

    def replan(self, batch: ForwardBatch) -> None:
        """Before a CUDA graph's replay: plan the replayed step's lengths into the buffers the graph reads."""
        self.plan(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] -> o [T, Hq, D]. Reads nothing back from the device once planned."""
        k_cache, v_cache = write_step_kv(self, k, v, batch)
        q = (q if q.is_contiguous() else q.contiguous()).to(k_cache.dtype)
        planner = self._planner(batch)
        out = None
        if planner.decoding:
            key = (tuple(q.shape), q.dtype)
            if key not in self._out:
                self._out[key] = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            out = self._out[key]
        return planner.run(q, k_cache, v_cache, batch.kv.page_size, out)

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

CUDA graphs. A decode step of a graph bucket (`batch.kv_len_bucket > 0`: DecodeGraphs pads it to b rows) runs on
a decode wrapper of b rows built for graphs (fixed buffers for indptr, page ids and fills, sized for b rows of the
block tables' full width), eager or captured alike; other decode steps (a runner without graphs) share one plain
decode wrapper, which sizes itself each plan. A replay runs no Python, so the runner calls `replan(batch)` on every
generate-phase op that has one before each replay (ktrans.engine.graphs): the planner plans the replayed step's
lengths into the same buffers, which the captured kernels read. The capture itself plans nothing: it follows the
bucket's eager first step on the same batch, which planned.

No host sync. The page lists go through one pinned host buffer, the page ids on to the device by an asynchronous
copy, so FlashInfer's own copies into its buffers are device to device or from pinned memory: none waits for the
stream (a pageable or blocking copy would wait for the previous step's kernels at every plan). The pinned buffer is
rewritten only once the last plan's copies have left it (an event; by then they always have).

Workspace. FlashInfer's split-KV partials for a graph-mode decode wrapper of b rows take
heads x max(2 x SMs / kv heads, ceil(b x group / 16) + b - 1) x 16 x (head_dim + 1) fp32 values (its scheduler's
padded batch in graph mode); the workspace is sized for the runner's largest bucket (`reserve_seqs`, at least
FlashInfer's documented 128 MiB), and a bucket past it is refused with the flag that sets it.
"""
from __future__ import annotations

import weakref

import flashinfer
import torch

from ktrans.operators.attention import ATTENTION_OPS, page_lists
from ktrans.operators.base import Op
from ktrans.operators.layers_triton import write_step_kv
from ktrans.runtime.batch import ForwardBatch

MIN_WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partials): its documentation's size
DEFAULT_ROWS = 256  # decode rows a planner is sized for where no runner said (reserve_seqs)
DTYPES = (torch.bfloat16, torch.float16)  # what its kernels read
DEVICE_TYPES = ("cuda",)
HEAD_DIMS = (64, 128, 256)  # what FlashInfer 0.5's paged kernels are built for (its sm90 prefill asserts them)


def workspace_bytes(rows: int, heads: int, kv_heads: int, head_dim: int, sms: int) -> int:
    """The float workspace a graph-mode decode wrapper of `rows` rows needs (FlashInfer 0.5's PrefillPlan with CUDA
    graphs: tmp_v and tmp_s over its padded batch of query tiles), with 16 MiB to spare, at least 128 MiB."""
    group = heads // kv_heads
    tile = 16 if group <= 16 else 64  # FA2DetermineCtaTileQ for a packed query of `group` rows
    tiles = max(2 * sms // kv_heads, -(-rows * group // tile) + rows - 1)
    return max(MIN_WORKSPACE_BYTES, heads * tiles * tile * (head_dim + 1) * 4 + (16 << 20))


class _Planner:
    """FlashInfer's wrappers for one KV pool on one device, and the step they were last planned for."""

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 max_rows: int):
        self.device, self.heads, self.kv_heads, self.head_dim, self.scale = (device, num_heads, num_kv_heads,
                                                                              head_dim, scale)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.max_rows = max_rows
        self.workspace = torch.zeros(workspace_bytes(max_rows, num_heads, num_kv_heads, head_dim, sms),
                                     dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self.graph_decodes: dict[int, tuple[int, object]] = {}  # bucket rows -> (table width, graph-mode wrapper)
        self.wrapper = None  # what the last plan planned: run() runs it
        # the step planned last, weakly: the batch holds the pool, which keys this planner in _PLANNERS weakly
        self.step: weakref.ref | None = None
        self.decoding = False
        self._pinned = device.type == "cuda"
        self._host = torch.zeros(0, dtype=torch.int32)
        self._ids = torch.zeros(0, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    def _graph_decode(self, rows: int, width: int):
        if rows > self.max_rows:
            raise ValueError(f"KAttentionFlashInfer: a decode graph of {rows} rows, its workspace is sized for "
                             f"{self.max_rows} (--max_batch_size sets it)")
        held, wrapper = self.graph_decodes.get(rows, (0, None))
        if wrapper is not None and width > held:
            # a new wrapper would leave the graphs captured over this one's buffers reading stale plans
            raise ValueError(f"KAttentionFlashInfer: a {rows}-row decode step with block tables {width} pages wide, "
                             f"its CUDA graphs' buffers hold {held} (one runner's tables have one width)")
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(rows + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(rows * width, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(rows, **i32))
            self.graph_decodes[rows] = (width, wrapper)
        return wrapper

    def _stage(self, *arrays) -> tuple[torch.Tensor, ...]:
        """The arrays (the page ids last) as int32 views of the pinned host buffer; the page ids also copied to the
        device asynchronously. Returns the host views, the ids' device copy last."""
        n = sum(len(a) for a in arrays)
        if self._copied is not None:
            self._copied.synchronize()  # the last plan's copies have left the buffer (they always have by now)
        if self._host.numel() < n:
            self._host = torch.zeros(2 * n, dtype=torch.int32, pin_memory=self._pinned)
        views, at = [], 0
        for a in arrays:
            v = self._host[at: at + len(a)]
            v.numpy()[:] = a
            views.append(v)
            at += len(a)
        if self.device.type == "cpu":
            return (*views[:-1], views[-1])
        ids = views[-1]
        if self._ids.numel() < len(ids):
            self._ids = torch.zeros(self._host.numel(), dtype=torch.int32, device=self.device)
        dev = self._ids[: len(ids)]
        dev.copy_(ids, non_blocking=True)
        return (*views[:-1], dev)

    def plan(self, batch: ForwardBatch, dtype: torch.dtype) -> None:
        """Plan `batch`'s step, once for all the pool's layers (a replayed step is a new batch: planned again)."""
        if self.step is not None and self.step() is batch:
            return
        host = batch.on("cpu")  # a runner's batch: the host buffers it was prepared from (no device read)
        tables = host.block_tables.numpy()
        page = batch.kv.page_size
        indptr, ids, last = page_lists(tables, batch.kv_lens, page)
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale, non_blocking=True)
        self.decoding = all(n == 1 for n in batch.seq_lens)
        if self.decoding:
            indptr, last, ids = self._stage(indptr, last, ids)
            graphed = batch.kv_len_bucket > 0  # a DecodeGraphs bucket, replayed or its eager first step
            self.wrapper = self._graph_decode(batch.num_seqs, tables.shape[1]) if graphed else self.decode
            self.wrapper.plan(indptr, ids, last, self.heads, self.kv_heads, self.head_dim, page, **common)
        else:
            qo, indptr, last, ids = self._stage(batch.cu_seqlens_host, indptr, last, ids)
            self.wrapper = self.prefill
            self.prefill.plan(qo, indptr, ids, last, self.heads, self.kv_heads, self.head_dim, page, causal=True,
                              **common)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        self.step = weakref.ref(batch)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page: int,
            out: torch.Tensor | None) -> torch.Tensor:
        paged = (k_cache.view(-1, page, *k_cache.shape[1:]), v_cache.view(-1, page, *v_cache.shape[1:]))
        if self.decoding:
            return self.wrapper.run(q, paged, out=out)
        return self.wrapper.run(q, paged)


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
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"{operator.key}: KAttentionFlashInfer takes head_dim {', '.join(map(str, HEAD_DIMS))} "
                             f"(FlashInfer's paged kernels), this model's is {self.head_dim}: choose KAttentionTriton")
        self._out: dict[tuple, torch.Tensor] = {}  # decode outputs by shape: no allocation in a captured step
        self.max_rows = DEFAULT_ROWS

    def reserve_seqs(self, max_num_seqs: int) -> None:
        """The runner's largest decode step (its largest graph bucket): the planner's workspace is sized for it."""
        self.max_rows = max_num_seqs

    def _planner(self, batch: ForwardBatch) -> _Planner:
        per_device = _PLANNERS.setdefault(batch.kv, {})
        if self.device not in per_device:
            per_device[self.device] = _Planner(self.device, self.num_heads, self.num_kv_heads, self.head_dim,
                                               self.scaling, self.max_rows)
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

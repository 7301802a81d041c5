"""A CPU-only model's decode step without the module tree: the same ops and kernels, called in a flat loop.

A decode step of the CPU placement spent ~1.1 ms a layer in Python at the 80B's 48 layers (H200 machine, 54.7 of
91.8 ms a token; doc/benchmarks.md), about 650 Python calls a layer: module calls, device moves and phase lookups
around ~25 calls that do the work. `CPUDecodeStep` makes the same calls into the same ops and C++ kernels for a
pure decode batch, in the model's order, with the operator tree resolved once at build time:

- the projections as raw C++ jobs on the pool (KLinearCPUInfer's matrices: every projection of one input queued
  before any is waited for, as `project` does), the split parts put in HF's order by one gather;
- the DeltaNet's q|k|v and z taken from in_proj_qkvz's per-key-head groups by one gather each (the module's
  split, reshape and cat move the same values);
- the norms, the router, the DeltaNet and attention cores through their ops (KRMSNormCPU, KRouterCPU,
  KGatedDeltaNetCPU, KAttentionCPU), whose own checks choose their paths as in the module forward, and the experts
  and the shared expert as raw jobs of their CPUMoE (KExpertsCPU's, the shared expert's one-expert one).

Every value is computed by the same kernel from the same inputs as the module forward, so the logits are equal
(tests/engine/test_cpu_decode.py). `build` returns None, with the reason, for any model it does not cover: another
op anywhere (the module forward then runs), a GPU, a bias, streamed experts, a dtype other than float32.

On by default (`KTRANS_CPU_DECODE=0`, read by ktrans.engine.runner, selects the module forward): 1.30x the module
forward's decode on a 2-core VM, and at full size on the 16-core Xeon, alternating with it in one process
(scripts/cpu_decode_ab.py, doc/benchmarks.md session 15), 52.1 against 63.3 ms a token with torch on one thread
during the step (the runner's default) and its OpenMP threads passive (`ktrans`'s default). With torch's 15 OpenMP
threads spinning beside the pool's pinned workers it had been 2.15x slower than the module forward (sessions 12-13).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ktrans import _cpu
from ktrans.kernels import cpu, cpu_layers
from ktrans.operators import layers_cpu
from ktrans.operators.routing_stats import ROUTING
from ktrans.runtime.batch import GENERATE, ForwardBatch

_NEEDS = {"norm": "KRMSNormCPU", "gdn": "KGatedDeltaNetCPU", "attn": "KAttentionCPU", "router": "KRouterCPU",
          "experts": "KExpertsCPU", "linear": "KLinearCPUInfer", "embedding": "KEmbeddingTorch", "rope": "KRoPETorch"}


class Unsupported(Exception):
    pass


def _op(module, kind: str):
    """The module's generate op, which must be `_NEEDS[kind]` on the CPU."""
    impl = getattr(module, "impl", None)
    op = impl.get(GENERATE) if impl else None
    if op is None or type(op).__name__ != _NEEDS[kind] or op.device.type != "cpu" \
            or any(d.type != "cpu" for d in getattr(module, "out_devices", {}).values()):
        raise Unsupported(f"{getattr(module, 'key', type(module).__name__)}: not {_NEEDS[kind]} on the CPU "
                          f"({type(op).__name__ if op is not None else 'no op'})")
    return op


_POSTED: dict = {}  # pool -> the last ticket a flat step posted there (waited for when the step fails midway)


class _Linear:
    """One KLinearCPUInfer as its C++ matrices: submit() queues them, done() waits and returns the output."""

    def __init__(self, module):
        op = _op(module, "linear")
        if op.bias is not None or op.lin is None:
            raise Unsupported(f"{op.key}: a bias or no weights")
        self.mats = [(p._lin, p.n_out) for p in (op.parts or [op.lin])]
        self.pool = op.lin.pool
        self.n_in = op.n_in
        self.n_out = sum(n for _, n in self.mats)  # the parts' columns side by side (stored order)
        self.order = op.order if op.parts else None
        self._plans: dict[int, tuple] = {}  # id(index) -> (index, a (start, end) of the stored columns or a gather)

    def submit(self, x: torch.Tensor) -> tuple:
        """Queue every part; each writes its columns of one [T, n_out] output in place (the output's row stride),
        so a split matrix needs no concatenation afterwards."""
        t = x.shape[0]
        y = torch.empty(t, self.n_out)
        tickets, col = [], 0
        for lin, n in self.mats:
            tickets.append(lin.submit(x.data_ptr(), t, self.n_in, y.data_ptr() + 4 * col, self.n_out))
            col += n
        _POSTED[self.pool] = tickets[-1]
        return x, tickets, y  # x kept alive until the jobs are waited for

    def done(self, pending: tuple, *index: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """The output; with `index` tensors (HF's column order), those columns of it instead: a view where they lie
        side by side in the stored order (a split GGUF's attn_qkv and attn_gate give [q | k | v] and z so), else one
        gather each."""
        _, tickets, y = pending
        for ticket in tickets:
            self.pool.wait(ticket)
        if not index:
            return y if self.order is None else y.index_select(1, self.order)
        return [self._columns(y, i) for i in index]

    def _columns(self, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        plan = self._plans.get(id(index))
        if plan is None:  # once per index tensor (the layer's own, kept for its lifetime)
            cols = index if self.order is None else self.order[index]
            lo = int(cols[0]) if len(cols) else 0
            side_by_side = torch.equal(cols, torch.arange(lo, lo + len(cols)))
            plan = self._plans[id(index)] = (index, (lo, lo + len(cols)) if side_by_side else cols)
        span = plan[1]
        if isinstance(span, tuple):
            view = y[:, span[0]:span[1]]
            return view if y.shape[0] == 1 else view.contiguous()
        return y.index_select(1, span)


class _Norm:
    """A KRMSNormCPU as its one C++ call for the step's float32 rows [T, n] (its residual add too), without the op's
    per-call reshapes, conversions and checks; anything else, or rows past the size rule, goes to the op."""

    def __init__(self, module):
        self.op = _op(module, "norm")
        self.w, self.eps = self.op.w32, float(self.op.eps)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        n = self.w.numel()
        if x.dim() != 2 or x.shape[1] != n or x.dtype != torch.float32 or not x.is_contiguous() \
                or x.numel() > layers_cpu.SMALL_ELEMENTS or residual is not None and (
                    residual.shape != x.shape or residual.dtype != torch.float32 or not residual.is_contiguous()):
            return self.op(x, residual)
        t = x.shape[0]
        out = torch.empty(t, n)
        if residual is None:
            _cpu.rms_norm_rows(t, n, x.data_ptr(), n, 0, 0, 0, 0, self.w.data_ptr(), 1.0, self.eps, out.data_ptr(), n)
            return out
        total = torch.empty(t, n)
        _cpu.rms_norm_rows(t, n, x.data_ptr(), n, residual.data_ptr(), n, total.data_ptr(), n, self.w.data_ptr(), 1.0,
                           self.eps, out.data_ptr(), n)
        return out, total


class _GDN:
    """A KGatedDeltaNetCPU's decode step as its one C++ call: what the op runs (cpu_layers.gdn_decode on its float32
    weights), without the per-call conversions and checks (the pools are checked when they change, the rows are the
    step's own float32 ones); a step the op runs otherwise (prefill, a mixed step) or other inputs go to the op."""

    def __init__(self, module):
        op = self.op = _op(module, "gdn")
        self.conv_w, self.A_log, self.dt_bias, self.norm_w = op.f32
        self.shape = op.num_k_heads, op.num_v_heads, op.head_k_dim, op.head_v_dim, self.conv_w.shape[1]
        self.pools: tuple | None = None
        self.calls = 0  # steps run here, not by the op

    def __call__(self, mixed, z, b, a, batch: ForwardBatch) -> torch.Tensor:
        op = self.op
        if not op.planned_for(batch):
            op.plan(batch)
        step = op.step
        hk, hv, dk, dv, kernel = self.shape
        t = mixed.shape[0]
        if step.prefill or step.decode_rows is None or any(x.dtype != torch.float32 or not x.is_contiguous()
                                                           for x in (mixed, z, b, a)) \
                or mixed.shape[1] != 2 * hk * dk + hv * dv or z.numel() != t * hv * dv or b.numel() != t * hv \
                or a.numel() != t * hv:
            return op(mixed, z, b, a, batch)
        pools = batch.states.layer(op.layer_idx)
        if self.pools is None or self.pools[0] is not pools[0] or self.pools[1] is not pools[1]:
            layers_cpu.check_pool_device(op.key, "DeltaNet state", pools[0], op.device)
            cpu_layers._pool_tensor(pools[0], "conv_pool")
            cpu_layers._pool_tensor(pools[1], "ssm_pool", (torch.float32,))
            slots_n = pools[1].shape[0]
            if pools[1].shape != (slots_n, hv, dk, dv) or pools[0].shape != (slots_n, mixed.shape[1], kernel - 1):
                raise ValueError(f"{op.key}: DeltaNet pools {tuple(pools[0].shape)} and {tuple(pools[1].shape)} do "
                                 f"not fit the layer")
            self.pools = pools
        conv_pool, ssm_pool = pools
        slots = cpu_layers._i64(step.decode_slots)
        if slots.numel() > t:
            return op(mixed, z, b, a, batch)
        self.calls += 1
        return cpu_layers.gdn_decode_checked(mixed, z, b, a, self.A_log, self.dt_bias, self.conv_w, self.norm_w,
                                             op.eps, conv_pool, ssm_pool, slots, hk, pool=cpu.get_pool())


def _submit_all(x: torch.Tensor, *linears: _Linear) -> list[tuple]:
    return [lin.submit(x) for lin in linears]


class _MoE:
    """A CPUMoE called with raw pointers (what CPUMoE.submit does once its inputs are checked)."""

    def __init__(self, moe):
        self.moe, self.hidden = moe, moe.hidden

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        out = torch.empty(x.shape[0], self.hidden)
        ticket = self.moe._moe.submit(x.data_ptr(), x.shape[0], self.hidden, ids.data_ptr(), weights.data_ptr(),
                                      ids.shape[1], out.data_ptr(), self.hidden)
        _POSTED[self.moe.pool] = ticket
        return ticket, out, (x, ids, weights)

    def done(self, pending: tuple) -> torch.Tensor:
        ticket, out, _ = pending
        self.moe.pool.wait(ticket)
        return out


class _Mlp:
    """A SwiGLU MLP (a dense layer or the shared expert): its one-expert CPUMoE, or its three projections."""

    def __init__(self, mlp):
        devices = getattr(mlp, "devices", {})
        if not hasattr(mlp, "_fuse") or GENERATE not in devices or devices[GENERATE].type != "cpu":
            raise Unsupported(f"{getattr(mlp, 'key', type(mlp).__name__)}: not KQwen3NextMLP on the CPU")
        fused = mlp._fused.get(GENERATE, False)
        if fused is False:
            fused = mlp._fused[GENERATE] = mlp._fuse(GENERATE, torch.device("cpu"))
        self.fused = _MoE(fused) if fused is not None else None
        if self.fused is None:
            self.gate, self.up, self.down = (_Linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self._ones: dict[int, tuple] = {}

    def submit(self, x: torch.Tensor):
        if self.fused is None:
            return "linears", x
        t = x.shape[0]
        if t not in self._ones:
            self._ones[t] = (torch.zeros(t, 1, dtype=torch.int64), torch.ones(t, 1))
        return "fused", self.fused.submit(x, *self._ones[t])

    def done(self, pending) -> torch.Tensor:
        kind, p = pending
        if kind == "fused":
            return self.fused.done(p)
        g, u = (lin.done(q) for lin, q in zip((self.gate, self.up), _submit_all(p, self.gate, self.up)))
        h = F.silu(g) * u
        return self.down.done(self.down.submit(h))


class _Layer:
    def __init__(self, layer):
        self.norm_in = _Norm(layer.input_layernorm)
        self.norm_post = _Norm(layer.post_attention_layernorm)
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            self.gdn = _GDN(m)
            self.qkvz, self.ba, self.out = _Linear(m.in_proj_qkvz), _Linear(m.in_proj_ba), _Linear(m.out_proj)
            hk, dk, dv, r = m.num_k_heads, m.head_k_dim, m.head_v_dim, m.num_v_heads // m.num_k_heads
            w = 2 * dk + 2 * r * dv  # one key head's group: q | k | v (r heads) | z (r heads)
            col = lambda lo, n: torch.cat([torch.arange(h * w + lo, h * w + lo + n) for h in range(hk)])  # noqa
            self.mixed_idx = torch.cat((col(0, dk), col(dk, dk), col(2 * dk, r * dv)))
            self.z_idx = col(2 * dk + r * dv, r * dv)
            ba = lambda lo: torch.cat([torch.arange(h * 2 * r + lo, h * 2 * r + lo + r) for h in range(hk)])  # noqa
            self.b_idx, self.a_idx = ba(0), ba(r)
            self.attn = None
        else:
            m = layer.self_attn
            self.attn = _op(m, "attn")
            self.q, self.k, self.v, self.o = (_Linear(x) for x in (m.q_proj, m.k_proj, m.v_proj, m.o_proj))
            self.q_norm, self.k_norm = _op(m.q_norm, "norm"), _op(m.k_norm, "norm")
            self.heads, self.kv_heads, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
            self.gdn = None
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            self.router = _op(mlp, "router")
            self.route_gate = _Linear(mlp.gate)
            experts = _op(mlp.experts, "experts")
            if experts.moe is None:
                raise Unsupported(f"{experts.key}: streamed experts (no CPUMoE at build time)")
            self.experts = _MoE(experts.moe)
            self.layer, self.num_experts = mlp.layer, experts.num_experts  # the routing statistics' key
            self.shared = _Mlp(mlp.shared_expert)
            g = mlp.shared_expert_gate
            if isinstance(g, torch.nn.Linear) and g.weight.device.type == "cpu" and g.weight.dtype == torch.float32:
                self.shared_gate = (g.weight, g.bias)
            else:
                self.shared_gate = _Linear(g)
            self.dense = None
        else:
            self.dense, self.router = _Mlp(mlp), None

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope, batch: ForwardBatch):
        if residual is None:
            h, residual = self.norm_in(h), h
        else:
            h, residual = self.norm_in(h, residual)
        h = self._gdn(h, batch) if self.gdn is not None else self._attention(h, rope, batch)
        h, residual = self.norm_post(h, residual)
        return (self._moe(h) if self.router is not None else self.dense.done(self.dense.submit(h))), residual

    def _gdn(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pq, pb = _submit_all(x, self.qkvz, self.ba)
        mixed, z = self.qkvz.done(pq, self.mixed_idx, self.z_idx)
        b, a = self.ba.done(pb, self.b_idx, self.a_idx)
        core = self.gdn(mixed, z, b, a, batch)
        return self.out.done(self.out.submit(core))

    def _attention(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = (lin.done(p) for lin, p in zip((self.q, self.k, self.v), _submit_all(x, self.q, self.k, self.v)))
        q, gate = qg.view(t, self.heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.kv_heads, d))
        q, k = rope.apply(q, k)
        out = self.attn(q, k, v.view(t, self.kv_heads, d), batch)
        out = out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o.done(self.o.submit(out))

    def _moe(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router.route(self.route_gate.done(self.route_gate.submit(x)))
        if ROUTING.on:
            ROUTING.record(self.layer, ids, self.num_experts)
        routed = self.experts.submit(x, ids, weights)
        shared = self.shared.submit(x)
        if isinstance(self.shared_gate, _Linear):
            gate = self.shared_gate.done(self.shared_gate.submit(x))
        else:
            gate = F.linear(x, *self.shared_gate)
        shared = self.shared.done(shared)
        return self.router.combine(self.experts.done(routed), shared, gate)


class CPUDecodeStep:
    """The decode step of a model whose every operator runs the CPU ops above; see the module docstring."""

    def __init__(self, model):
        inner = model.model
        self.embed = _op(inner.embed_tokens, "embedding")
        if self.embed.weight is None or self.embed.weight.dtype != torch.float32:
            raise Unsupported("the model's dtype is not float32 (the C++ jobs here are given float32 buffers)")
        self.rope = _op(inner.rotary_emb, "rope")
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm = _Norm(inner.norm)
        self.lm_head = _Linear(model.lm_head)
        if any(getattr(layer, "_ktrans_device", None) not in (None, torch.device("cpu")) for layer in inner.layers):
            raise Unsupported("layers placed on another device")

    @classmethod
    def build(cls, model) -> tuple["CPUDecodeStep | None", str]:
        """(the step, "") for a model it covers, else (None, why)."""
        if not hasattr(model, "model") or not hasattr(model, "lm_head"):
            return None, "not a Qwen3NextForCausalLM"
        try:
            return cls(model), ""
        except Unsupported as e:
            return None, str(e)

    @staticmethod
    def takes(batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.device.type == "cpu"

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [N, vocab] for batch.logits_indices, as the model's forward gives them."""
        try:
            with batch.active():
                x = self.embed(batch.input_ids)
                rope = self.rope(batch.positions, x.dtype)
                h, residual = x, None
                for layer in self.layers:
                    h, residual = layer.forward(h, residual, rope, batch)
                idx = batch.logits_indices
                h = self.norm(h[idx], residual[idx])[0]
                return self.lm_head.done(self.lm_head.submit(h.contiguous())).float()
        except BaseException:
            # Jobs posted and not waited for may still read and write this step's tensors, which the raise frees:
            # let them end first (a ticket stands for its job and every earlier one; their errors are this one's).
            for pool, ticket in list(_POSTED.items()):
                try:
                    pool.wait(ticket)
                except Exception:
                    pass
            raise
        finally:
            _POSTED.clear()

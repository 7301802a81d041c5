"""Chunked gated delta rule in Triton: the prefill of a Gated DeltaNet layer, varlen over a batch's sequences.

The oracle is `ktrans/kernels/torch/gated_delta.py` (`chunk_gated_delta_rule`, one sequence); the design is FLA's
chunked WY form (fla-org/flash-linear-attention, fla/ops/gated_delta_rule/chunk.py and wy_fast.py): within a chunk
of 64 tokens the deltas solve a unit lower-triangular system whose inverse does not depend on the carried state, so
every chunk does its solve in parallel and only a small matmul per chunk remains in the sequential scan.

Two launches (FLA uses about eight for the same work):

1. the prep (`gated_delta_prep`), parallel over chunks: L2-normalises q and k, computes the gates
   g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) and their in-chunk cumulative log-decay, then per
   value head (HV = R * HK) builds A = strict_lower(beta_i k_i.k_j exp(cum_i - cum_j)), solves
   (I + A) X = [beta k exp(cum) | beta v] by block forward substitution on 16-row blocks (each diagonal 16x16 block
   inverted by substitution, the rest matmuls), and stores w, u, cum and the chunk's causal q.k decay matrix.
2. `_scan_kernel`, one program per (sequence, value head, block of value columns): carries the fp32 state
   [Dk, BV] in registers over the sequence's chunks: v_new = u - w S, o = (q exp(cum)) S + attn v_new,
   S <- exp(cum_last) S + (k exp(cum_last - cum))^T v_new. It reads the initial state from the state pool by slot
   (zeros for a fresh sequence), writes the final state back by slot, and on request writes the state after a
   chunk into that chunk's emit slot (the prefix cache's snapshots at 64-token boundaries).

Chunks are cut at absolute positions that are multiples of 64 (a sequence that starts at cached length 100 has a
first chunk of 28 tokens), so emitted states sit on the same boundaries however a prompt was split into prefill
calls. The chunk table is planned on the host (`plan_chunks`), once per step, and copied to the device in one go.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton import interpreting
from ktrans.kernels.triton.gated_delta_prep import launch_prep
from ktrans.kernels.triton.gated_delta_rows import _l2norm_rows, _load_rows

CHUNK = 64
# Launch shapes, from scripts/gdn_sweep.py on the H200 (doc/benchmarks.md, T=8192: the prep 454 us at 4 warps, session
# 20, and 4 warps also won with the prep's earlier forms, session 19; block_v 32 against 64: 490 against 777 us):
# warps of the prep and the scan, and the value columns one scan program carries (32: 128 programs for one sequence
# at HV=32, Dv=128).
PREP_WARPS, SCAN_WARPS, SCAN_BLOCK_V = 4, 4, 32
# The software pipeliner's stages of the scan's loop over chunks (Triton's default on CUDA; gdn_sweep --scan_stages).
SCAN_STAGES = 3
# KTRANS_GDN_SPLIT=1: the scan's outputs by a separate launch parallel over chunks (_scan_kernel SPLIT, _output_kernel),
# as FLA splits its chunk_fwd_h and chunk_fwd_o; off: slower on the H200 (1,242 against 1,151 us at T=8192)
SPLIT = os.environ.get("KTRANS_GDN_SPLIT", "0") == "1"
# The split form's output launch's value columns a program (0: the scan's); wider reads each chunk's q and q.k matrix
# fewer times (FLA's chunk_fwd_o takes 64 or 128), untimed (gdn_sweep --split 1 --out_block_v 32,64,128).
OUT_BLOCK_V = 0
# KTRANS_GDN_NORMED (default 1): the prep stores the normalised q and k once (qn, kn [T, HK, Dk] in the dots' dtype)
# and the scan reads them as the dots' operands (_scan_kernel NORMED); at sm_90 the unsplit scan's spill stack goes
# from 1,208 to 504 bytes. Timed on an H100 (doc/benchmarks.md, session 29, one 80B layer with the prep's FULL=2): the
# scan 331.6 against 501.7 us at T=8192, the layer 694.4 against 846.9; 0 keeps the plain scan for the sweep.
NORMED = os.environ.get("KTRANS_GDN_NORMED", "1") == "1"
_TORCH_DTYPES = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


@dataclass
class ChunkPlan:
    """The chunk table of one varlen call, on the device (one int64 tensor, sliced)."""

    num_seqs: int
    num_chunks: int
    chunk_start: torch.Tensor   # [NC] flat row of each chunk's first token
    chunk_len: torch.Tensor     # [NC] 1..64 tokens
    chunk_seq: torch.Tensor     # [NC] the sequence it belongs to
    first_chunk: torch.Tensor   # [NS + 1] chunks of sequence s are first_chunk[s] .. first_chunk[s + 1] - 1
    seq_start: torch.Tensor     # [NS] flat row of each sequence's first token
    seq_slot: torch.Tensor      # [NS] state slot
    seq_fresh: torch.Tensor     # [NS] 1: start from zero state (and zero conv history), 0: continue the slot's
    emit_slot: torch.Tensor     # [NC] slot that receives the state after the chunk, -1 for none
    min_first_len: int          # host: the shortest first chunk among sequences longer than it (the conv's
                                # kernel needs every read of a carried window inside the first chunk)


def plan_chunks(seqs: list[tuple[int, int, int, bool]], device: torch.device, start_pos: list[int] | None = None,
                emit: list[list[int]] | None = None) -> ChunkPlan:
    """The chunk table for sequences given as (start, end, slot, fresh) rows of the flat batch.

    start_pos[i] is sequence i's absolute position of its first new token (its cached length; 0 when omitted):
    chunks end at absolute multiples of 64. emit[i] lists one slot per 64-boundary that sequence i reaches in this
    call (absolute positions p with start_pos < p <= start_pos + length, p % 64 == 0), in order.
    """
    starts, lens, owner, first, emits = [], [], [], [0], []
    for i, (s, e, _slot, _fresh) in enumerate(seqs):
        if e <= s:
            raise ValueError(f"sequence {i} has no tokens ({s}..{e})")
        pos = start_pos[i] if start_pos else 0
        boundaries = []
        t = s
        while t < e:
            n = min(e - t, CHUNK - (pos + t - s) % CHUNK)
            starts.append(t)
            lens.append(n)
            owner.append(i)
            t += n
            boundaries.append((pos + t - s) % CHUNK == 0)
        first.append(len(starts))
        want = emit[i] if emit else []
        if emit and len(want) != sum(boundaries):
            raise ValueError(f"sequence {i} reaches {sum(boundaries)} chunk boundaries but has {len(want)} emit slots")
        it = iter(want)
        emits.extend(next(it) if b and emit else -1 for b in boundaries)
    seq_lens = [e - s for s, e, _, _ in seqs]
    min_first = min((lens[f] for f, n in zip(first, seq_lens) if lens[f] < n), default=CHUNK)
    parts = aligned_table([starts, lens, owner, first, [s for s, _, _, _ in seqs], [sl for _, _, sl, _ in seqs],
                           [int(f) for _, _, _, f in seqs], emits], device)
    return ChunkPlan(len(seqs), len(starts), *parts, min_first_len=min_first)


def aligned_table(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Integer lists as int64 views of one device tensor (one copy), each starting on a 16-byte boundary: Triton
    specializes a pointer argument on that alignment, so views at offsets that follow the batch's sizes would compile
    every kernel taking them once per parity of those sizes, in the middle of serving (doc/benchmarks.md, session
    13: compiles inside a step carrying a 4,092-token chunk beside four decodes)."""
    flat: list[int] = []
    offsets = []
    for part in parts:
        offsets.append(len(flat))
        flat += [*part, *([0] * (len(part) % 2))]
    table = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
    return [table[o:o + len(part)] for o, part in zip(offsets, parts)]


# ---- kernels ------------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_output(q_ptr, attn_ptr, o_ptr, c, h, kh, row0, n, rc, rv, cum, sd, v_new, stride_qt, stride_qh,
                  stride_ot, stride_oh, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                  DT: tl.constexpr, PREC: tl.constexpr, NORMED: tl.constexpr = False):
    """Chunk c's outputs of value head h, columns rv: o = (q exp(cum)) S + attn v_new, S the state entering the
    chunk (in DT); the scan's (unsplit) and _output_kernel's (split) one body. NORMED: q_ptr is the prep's qn
    (normalised, scaled, in DT), read as stored; the decay applied to the product's rows."""
    C: tl.constexpr = 64
    rows = (row0 + rc).to(tl.int64)
    attn = tl.load(attn_ptr + ((c * HV + h) * C + rc[:, None]).to(tl.int64) * C + rc[None, :])  # as stored
    q = _load_rows(q_ptr + kh * stride_qh, row0, n, stride_qt, 0, DK, 0, C, BK, not NORMED)
    if NORMED:
        qs = tl.dot(q, sd, input_precision=PREC) * tl.exp(cum)[:, None]
    else:
        qs = tl.dot((_l2norm_rows(q) * (DK ** -0.5) * tl.exp(cum)[:, None]).to(DT), sd, input_precision=PREC)
    o = qs + tl.dot(attn.to(DT), v_new.to(DT), input_precision=PREC)
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + rv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(rc < n)[:, None] & (rv[None, :] < DV))


@triton.jit
def _scan_kernel(q_ptr, k_ptr, w_ptr, u_ptr, cum_ptr, attn_ptr, o_ptr, state_ptr, vnew_ptr, hs_ptr,
                 chunk_start, chunk_len, first_chunk, seq_slot, seq_fresh, emit_slot,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_ss, stride_sh,
                 HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                 SPLIT: tl.constexpr = False, NORMED: tl.constexpr = False):
    """SPLIT (KTRANS_GDN_SPLIT): no outputs here; each chunk's entering state (as the dots read it, in DT) goes to
    hs [NC, HV, Dk, Dv] and its v_new to vnew [T, HV, Dv] for _output_kernel, parallel over chunks: two dots a chunk
    on the sequential path instead of four.
    NORMED (KTRANS_GDN_NORMED): q_ptr and k_ptr are the prep's qn and kn [T, HK, Dk] (normalised, in DT), read
    straight into the dots; the decays scale the products' rows (o) and v_new's rows
    (the state update: (e k)^T v = k^T (e v) for a diagonal e), not a [64, Dk] operand: no per-chunk norms or fp32
    copies of q and k on the sequential path."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // R
    C: tl.constexpr = 64
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    smask = (rk[:, None] < DK) & (rv[None, :] < DV)
    soff = h * stride_sh + rk[:, None] * DV + rv[None, :]
    slot = tl.load(seq_slot + s)
    fresh = tl.load(seq_fresh + s)
    # A fresh sequence's slot may hold a previous owner's state: it is not read at all.
    state = tl.load(state_ptr + slot * stride_ss + soff, mask=smask & (tl.zeros_like(soff) + fresh == 0), other=0.0)
    for c in range(tl.load(first_chunk + s), tl.load(first_chunk + s + 1)):
        row0 = tl.load(chunk_start + c)
        n = tl.load(chunk_len + c)
        valid = rc < n
        rows = (row0 + rc).to(tl.int64)
        k = _load_rows(k_ptr + kh * stride_kh, row0, n, stride_kt, 0, DK, 0, C, BK, not NORMED)
        if not NORMED:
            k = _l2norm_rows(k)
        w = _load_rows(w_ptr + h * DK, row0, n, HV * DK, 0, DK, 0, C, BK, False)
        u = _load_rows(u_ptr + h * DV, row0, n, HV * DV, vb * BV, DV - vb * BV, 0, C, BV)
        cum = tl.load(cum_ptr + rows * HV + h, mask=valid, other=0.0)
        cum_last = tl.load(cum_ptr + (row0 + n - 1).to(tl.int64) * HV + h)
        sd = state.to(DT)
        v_new = u - tl.dot(w.to(DT), sd, input_precision=PREC)
        if SPLIT:
            tl.store(hs_ptr + (c * HV + h).to(tl.int64) * DK * DV + rk[:, None] * DV + rv[None, :], sd, mask=smask)
            tl.store(vnew_ptr + rows[:, None] * (HV * DV) + h * DV + rv[None, :], v_new.to(DT),
                     mask=valid[:, None] & (rv[None, :] < DV))
        else:
            _chunk_output(q_ptr, attn_ptr, o_ptr, c, h, kh, row0, n, rc, rv, cum, sd, v_new, stride_qt, stride_qh,
                          stride_ot, stride_oh, HV, DK, DV, BK, DT, PREC, NORMED)
        decay = tl.where(valid, tl.exp(cum_last - cum), 0.0)
        if NORMED:
            update = tl.dot(tl.trans(k), (v_new * decay[:, None]).to(DT), input_precision=PREC)
        else:
            update = tl.dot(tl.trans((k * decay[:, None]).to(DT)), v_new.to(DT), input_precision=PREC)
        state = state * tl.exp(cum_last) + update
        e = tl.load(emit_slot + c)
        tl.store(state_ptr + tl.maximum(e, 0) * stride_ss + soff, state, mask=smask & (tl.zeros_like(soff) + e >= 0))
    tl.store(state_ptr + slot * stride_ss + soff, state, mask=smask)


@triton.jit
def _output_kernel(q_ptr, cum_ptr, attn_ptr, vnew_ptr, hs_ptr, o_ptr, chunk_start, chunk_len,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                   NORMED: tl.constexpr = False):
    """One chunk's outputs from its entering state and v_new (stored by _scan_kernel with SPLIT): o = (q exp(cum)) S
    + attn v_new, the same products as the unsplit scan's, one program per (chunk, value head, value columns)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // R
    C: tl.constexpr = 64
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    rc = tl.arange(0, C)
    row0 = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    valid = rc < n
    rows = (row0 + rc).to(tl.int64)
    cum = tl.load(cum_ptr + rows * HV + h, mask=valid, other=0.0)
    sd = tl.load(hs_ptr + (c * HV + h).to(tl.int64) * DK * DV + rk[:, None] * DV + rv[None, :],
                 mask=(rk[:, None] < DK) & (rv[None, :] < DV), other=0.0)
    v_new = tl.load(vnew_ptr + rows[:, None] * (HV * DV) + h * DV + rv[None, :],
                    mask=valid[:, None] & (rv[None, :] < DV), other=0.0)
    _chunk_output(q_ptr, attn_ptr, o_ptr, c, h, kh, row0, n, rc, rv, cum, sd, v_new, stride_qt, stride_qh,
                  stride_ot, stride_oh, HV, DK, DV, BK, DT, PREC, NORMED)


# ---- wrapper ------------------------------------------------------------------------------------------------------


def _dot_types(dtype: torch.dtype):
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]
    if interpreting():
        dt = tl.float32  # Triton 3.9's interpreter returns garbage from a bf16 x bf16 tl.dot
    # fp32 inputs get fp32 products (tests, the fp32 model); bf16 ones the tensor cores' bf16 x bf16 -> fp32.
    return dt, "ieee" if dtype == torch.float32 else "tf32"


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                                  b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                                  state_pool: torch.Tensor, plan: ChunkPlan, out: torch.Tensor | None = None,
                                  block_v: int | None = None, split: bool | None = None,
                                  normed: bool | None = None, full: int | None = None,
                                  prep_maxnreg: int | None = None, out_block_v: int | None = None) -> torch.Tensor:
    """The gated delta rule over the planned sequences of a flat batch, with the gates computed here.

    q, k [T, HK, Dk] and v [T, HV, Dv] (any token and head strides, last dim contiguous: views into the conv's
    output work); a, b [T, HV] the raw gate inputs (token stride free, heads contiguous); A_log, dt_bias [HV];
    state_pool [slots, HV, Dk, Dv] float32, read at the plan's slots (unless fresh) and written back there and
    at its emit slots. Returns o [T, HV, Dv] in v's dtype; rows outside the plan's sequences are left untouched
    (`out` given) or unset. `split` (default SPLIT, KTRANS_GDN_SPLIT): the outputs by a third launch, parallel over
    chunks, from the states and v_new the sequential one stores (the same values bitwise; one chunk's state a value
    head in the dots' dtype more memory, ~4 MiB a chunk at Qwen3-Next's shapes in bf16). `normed` (default NORMED,
    KTRANS_GDN_NORMED): the prep stores the normalised q and k for the scan (2 x T x HK x Dk more, in the dots' dtype).
    `full` (default gated_delta_prep.FULL, KTRANS_GDN_PREP_FULL, 0..5): the prep's A (from 2: and its inverse)
    through a scratch buffer (3, 4: the rest by later launches; 5: 2 with early loads; gated_delta_prep.launch_prep).
    `prep_maxnreg` (default gated_delta_prep.MAXNREG, KTRANS_GDN_PREP_MAXNREG): the prep's register cap.
    `out_block_v` (default OUT_BLOCK_V, 0: block_v's): the split form's output launch's value columns a program.
    """
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if hv % hk or q.shape != k.shape or a.shape != (t, hv) or b.shape != (t, hv):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}")
    if state_pool.dtype != torch.float32 or state_pool.shape[1:] != (hv, dk, dv) or not state_pool.is_contiguous():
        raise ValueError(f"state_pool must be contiguous float32 [slots, {hv}, {dk}, {dv}], got "
                         f"{state_pool.dtype} {tuple(state_pool.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    out = v.new_empty(t, hv, dv) if out is None else out
    if plan.num_chunks == 0:
        return out
    dt, prec = _dot_types(v.dtype)
    bk, bvf = max(16, triton.next_power_of_2(dk)), max(16, triton.next_power_of_2(dv))
    bv = block_v or min(bvf, SCAN_BLOCK_V)
    w = torch.empty(t, hv, dk, dtype=v.dtype, device=v.device)
    u = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    cum = torch.empty(t, hv, dtype=torch.float32, device=v.device)
    attn = torch.empty(plan.num_chunks, hv, CHUNK, CHUNK, dtype=v.dtype, device=v.device)
    r = hv // hk
    split = SPLIT if split is None else split
    normed = NORMED if normed is None else normed
    buf = _TORCH_DTYPES[dt]
    qn = kn = None
    if normed:
        qn, kn = (torch.empty(t, hk, dk, dtype=buf, device=v.device) for _ in range(2))
    launch_prep(q, k, v, a, b, A_log, dt_bias, w, u, cum, attn, plan, bk, bvf, dt, prec, PREP_WARPS, qn=qn, kn=kn,
                full=full, maxnreg=prep_maxnreg)
    qs, ks = (qn, kn) if normed else (q, k)  # what the scan and the output kernel read as q and k
    vnew = torch.empty(t, hv, dv, dtype=buf, device=v.device) if split else u  # (u: an unread stand-in)
    hs = torch.empty(plan.num_chunks, hv, dk, dv, dtype=buf, device=v.device) if split else u
    _scan_kernel[(plan.num_seqs, hv, triton.cdiv(dv, bv))](
        qs, ks, w, u, cum, attn, out, state_pool, vnew, hs, plan.chunk_start, plan.chunk_len, plan.first_chunk,
        plan.seq_slot, plan.seq_fresh, plan.emit_slot, qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1),
        out.stride(0), out.stride(1), state_pool.stride(0), state_pool.stride(1),
        HV=hv, R=r, DK=dk, DV=dv, BK=bk, BV=bv, DT=dt, PREC=prec, SPLIT=split, NORMED=normed, num_warps=SCAN_WARPS,
        num_stages=SCAN_STAGES)
    if not split:
        return out
    obv = min(bvf, (OUT_BLOCK_V if out_block_v is None else out_block_v) or bv)
    _output_kernel[(plan.num_chunks, hv, triton.cdiv(dv, obv))](
        qs, cum, attn, vnew, hs, out, plan.chunk_start, plan.chunk_len, qs.stride(0), qs.stride(1), out.stride(0),
        out.stride(1), HV=hv, R=r, DK=dk, DV=dv, BK=bk, BV=obv, DT=dt, PREC=prec, NORMED=normed,
        num_warps=SCAN_WARPS)
    return out

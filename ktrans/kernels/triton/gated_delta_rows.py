"""The chunked gated delta rule's row-level helpers, shared by its launches (gated_delta_prep, gated_delta_wu,
gated_delta): a chunk's rows loaded and stored with masks, L2 norms, the gates g and beta from a and b, and the
causal q.k decay matrix's store."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(ptr, row0, n, stride_t, col0, ncols, R0: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
               F32: tl.constexpr = True, WIDE: tl.constexpr = True):
    """Rows R0 .. R0+ROWS of a chunk (row0, n valid rows) and columns 0..COLS (ncols valid); zeros past them. In
    fp32, or as stored (F32=False: operands that go straight into a tl.dot). WIDE: every element's address in int64
    (the scan's form); else one int64 base for the chunk and int32 offsets inside it (the prep's: per-element int64
    arithmetic was most of the FULL prep's registers at sm_90, a 992-byte stack against 352 (gdn_resources), while
    the scan, whose loads the pipeliner makes asynchronous copies, spills more with it: 1,440 bytes against 864)."""
    r = R0 + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r[:, None] < n) & (c[None, :] < ncols)
    x = tl.load(_rows_ptrs(ptr, row0, r, stride_t, col0, c, WIDE), mask=mask, other=0.0)
    if F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _rows_ptrs(ptr, row0, r, stride_t, col0, c, WIDE: tl.constexpr):
    """The addresses of rows row0 + r, columns col0 + c: WIDE as _load_rows says."""
    if WIDE:
        return ptr + (row0 + r)[:, None].to(tl.int64) * stride_t + col0 + c[None, :]
    return ptr + row0.to(tl.int64) * stride_t + (r[:, None] * stride_t + col0 + c[None, :])


@triton.jit
def _rnorm(x):
    """1 / the L2 norm of each row (the eps inside the root, as the torch oracle)."""
    return tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)


@triton.jit
def _rnorm_diag(xx):
    """_rnorm of the rows of x from the diagonal of x.x^T ([n, n])."""
    r = tl.arange(0, xx.shape[0])
    return tl.rsqrt(tl.sum(tl.where(r[:, None] == r[None, :], xx, 0.0), axis=1) + 1e-6)


@triton.jit
def _l2norm_rows(x):
    return x * _rnorm(x)[:, None]


@triton.jit
def _gates(a_ptr, b_ptr, alog_ptr, dtb_ptr, row0, n, h, stride_at, stride_bt, R0: tl.constexpr, ROWS: tl.constexpr):
    """g and beta of value head h for rows R0 .. R0+ROWS of a chunk; 0 for rows past its end (they then write and
    decay nothing)."""
    r = R0 + tl.arange(0, ROWS)
    valid = r < n
    rows = (row0 + r).to(tl.int64)
    a = tl.load(a_ptr + rows * stride_at + h, mask=valid, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
    x = a + tl.load(dtb_ptr + h).to(tl.float32)
    # softplus as torch computes it (threshold 20: linear above), so the gates match F.softplus.
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
    beta = 1.0 / (1.0 + tl.exp(-b))
    return tl.where(valid, g, 0.0), tl.where(valid, beta, 0.0)


@triton.jit
def _store_rows(ptr, x, row0, n, stride_t, col0, ncols, R0: tl.constexpr):
    r = R0 + tl.arange(0, x.shape[0])
    c = tl.arange(0, x.shape[1])
    mask = (r[:, None] < n) & (c[None, :] < ncols)
    tl.store(_rows_ptrs(ptr, row0, r, stride_t, col0, c, False), x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_attn(attn_ptr, qk, cf, c, h, HV: tl.constexpr):
    """Chunk c's causal q.k decay matrix of value head h: qk exp(cf_i - cf_j) for j <= i, else 0."""
    C: tl.constexpr = 64
    rc = tl.arange(0, C)
    dec = tl.where(rc[:, None] >= rc[None, :], cf[:, None] - cf[None, :], float("-inf"))
    base = attn_ptr + (c * HV + h).to(tl.int64) * (C * C)
    tl.store(base + rc[:, None] * C + rc[None, :], (qk * tl.exp(dec)).to(attn_ptr.dtype.element_ty))

"""The K-quant quantizers (Q4_K, Q5_K, Q6_K): scale search and block packing.

Our own scale search, not llama.cpp's: per sub-block, five starting scales around range / levels, each
refined by alternating rounding with a least-squares fit, the best kept; then the sub-block scales (and
mins) are coded in 6 bits (Q4_K/Q5_K, trying both neighbouring codes) or 8 bits (Q6_K) under an fp16
super-scale. The blocks decode with any ggml dequantizer. quants.quantize() dispatches here through
K_QUANTIZERS; the error and speed figures are in quants.py's docstring.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ktrans.weights.quant_blocks import f16_bytes, inv, pack_nibbles, signed_absmax


def _pack_k_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of quants._k_scale_min for uint8 arrays (n, 8) with values < 64."""
    return np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
    ], axis=1)


_SCALE_CANDIDATES = np.linspace(-1, 1, 5, dtype=np.float32)  # start points: range / (levels + c)


def _keep_best(best, cand):
    """Per row, keep whichever (params..., err) tuple has the lower error (err is last)."""
    if best is None:
        return cand
    better = cand[-1] < best[-1]
    return tuple(np.where(better.reshape(better.shape + (1,) * (c.ndim - better.ndim)), c, b)
                 for c, b in zip(cand, best))


def _fit_affine(x: np.ndarray, nmax: int, iters: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x, scale >= 0 and offset <= 0 with x ~ scale * q + offset, q in [0, nmax].

    From a few starting scales around range / nmax, alternate nearest rounding with the
    least-squares (scale, offset) for those q (each step can only lower the squared error), and
    keep the best result per row. The offset stays <= 0 because k-quants store it as -dmin * m.
    """
    k = np.float32(x.shape[-1])
    lo0 = np.minimum(x.min(axis=-1, keepdims=True), 0)
    spread = x.max(axis=-1, keepdims=True) - lo0
    sx = x.sum(axis=-1, keepdims=True)
    best = None
    for c in _SCALE_CANDIDATES:
        scale, lo = spread / (nmax + c), lo0
        for _ in range(iters):
            q = np.clip(np.rint((x - lo) * inv(scale)), 0, nmax)
            sq, sqq = q.sum(axis=-1, keepdims=True), (q * q).sum(axis=-1, keepdims=True)
            sxq = (x * q).sum(axis=-1, keepdims=True)
            det = k * sqq - sq * sq
            ok = det > 0
            det = np.where(ok, det, 1)
            new_scale = (k * sxq - sq * sx) / det
            new_lo = (sqq * sx - sq * sxq) / det
            pinned = new_lo > 0  # the constrained optimum lies on offset == 0
            new_scale = np.where(pinned, sxq / np.where(sqq > 0, sqq, 1), new_scale)
            new_lo = np.where(pinned, 0, new_lo)
            ok &= new_scale > 0
            scale, lo = np.where(ok, new_scale, scale), np.where(ok, new_lo, lo)
        q = np.clip(np.rint((x - lo) * inv(scale)), 0, nmax)
        err = np.square(q * scale + lo - x).sum(axis=-1, keepdims=True)
        best = _keep_best(best, (scale, lo, err))
    return best[0], best[1]


def _fit_signed(x: np.ndarray, qmin: int, qmax: int, iters: int = 2) -> np.ndarray:
    """Per row of x, a signed scale with x ~ scale * q, q in [qmin, qmax] (qmin = -qmax - 1).

    The value of largest magnitude starts on qmin, the extra negative code; then as _fit_affine.
    """
    v = signed_absmax(x)
    best = None
    for c in _SCALE_CANDIDATES:
        s = v / (qmin + c)
        for _ in range(iters):
            q = np.clip(np.rint(x * inv(s)), qmin, qmax)
            sqq = (q * q).sum(axis=-1, keepdims=True)
            s = np.where(sqq > 0, (x * q).sum(axis=-1, keepdims=True) / np.where(sqq > 0, sqq, 1), s)
        q = np.clip(np.rint(x * inv(s)), qmin, qmax)
        best = _keep_best(best, (s, np.square(q * s - x).sum(axis=-1, keepdims=True)))
    return best[0]


def _super_scale(v: np.ndarray, code_max: int) -> np.ndarray:
    """Per row of v (n, k), the fp16-representable step (n, 1), as float32, mapping max |v| to code_max."""
    vmax = np.abs(v).max(axis=1, keepdims=True)
    d = (vmax / np.float32(code_max)).astype(np.float16).astype(np.float32)
    # very small blocks: keep the smallest fp16 step rather than let d flush to zero
    return np.where(vmax > 0, np.maximum(d, np.float32(2.0**-24)), d)


def _q_kquant_affine(x, nbits):
    """Q4_K / Q5_K body: returns the 16 header bytes (d, dmin, scales) and q (n, 8, 32)."""
    n, nmax = len(x), (1 << nbits) - 1
    xs = x.reshape(n, 8, 32)
    scale, lo = _fit_affine(xs, nmax)
    d, dmin = _super_scale(scale[..., 0], 63), _super_scale(lo[..., 0], 63)
    sc_f, mn_f = scale[..., 0] * inv(d), -lo[..., 0] * inv(dmin)
    # 6-bit codes: try both neighbours of each real-valued scale and min, keep the best per sub-block
    best = None
    for sc in (np.floor(sc_f), np.ceil(sc_f)):
        for mn in (np.floor(mn_f), np.ceil(mn_f)):
            sc, mn = np.clip(sc, 0, 63), np.clip(mn, 0, 63)
            eff_scale, eff_min = (d * sc)[..., None], (dmin * mn)[..., None]
            q = np.clip(np.rint((xs + eff_min) * inv(eff_scale)), 0, nmax)
            err = np.square(q * eff_scale - eff_min - xs).sum(axis=-1)
            best = _keep_best(best, (sc, mn, q, err))
    sc, mn, q = (a.astype(np.uint8) for a in best[:3])
    head = np.concatenate([f16_bytes(d), f16_bytes(dmin), _pack_k_scale_min(sc, mn)], axis=1)
    return head, q


def _q_q4_k(x):
    head, q = _q_kquant_affine(x, 4)
    return np.concatenate([head, pack_nibbles(q.reshape(-1, 4, 2, 32)).reshape(-1, 128)], axis=1)


def _q_q5_k(x):
    head, q = _q_kquant_affine(x, 5)
    qh = np.packbits((q >> 4).transpose(0, 2, 1), axis=-1, bitorder="little").reshape(-1, 32)
    qs = pack_nibbles((q & 15).reshape(-1, 4, 2, 32)).reshape(-1, 128)
    return np.concatenate([head, qh, qs], axis=1)


def _q_q6_k(x):
    n = len(x)
    xs = x.reshape(n, 16, 16)
    s = _fit_signed(xs, -32, 31)[..., 0]
    # signed super-scale: the largest sub-block scale gets code -128, the extra code of int8
    d = _super_scale(s, 128) * -np.sign(signed_absmax(s))
    sc = np.clip(np.rint(s * inv(d)), -128, 127).astype(np.int8)
    eff = (d * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(xs * inv(eff)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = pack_nibbles((q & 15).reshape(n, 2, 2, 2, 32).transpose(0, 1, 3, 2, 4)).reshape(n, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), f16_bytes(d)], axis=1)


K_QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Q4_K": _q_q4_k, "Q5_K": _q_q5_k, "Q6_K": _q_q6_k}

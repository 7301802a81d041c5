"""Small numpy helpers shared by the block quantizers (ktrans.weights.quants and quants_k): C rounding, safe
reciprocals, fp16 scale bytes and nibble packing, each written once."""
from __future__ import annotations

import numpy as np


def roundf(x: np.ndarray) -> np.ndarray:
    """C roundf (ties away from zero), exact for every float32."""
    t = np.trunc(x)
    return np.where(np.abs(x - t) == 0.5, t + np.sign(x), np.rint(x))


def inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).reshape(-1, 1).view(np.uint8)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(..., 2, k) uint8 values < 16 -> (..., k): first half in the low nibbles."""
    return q[..., 0, :] | (q[..., 1, :] << 4)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1, keepdims=True), axis=-1)

"""The repack of ggml's K-quant blocks into the packed GPU layout (ktrans.kernels.triton.quant_layout), as one Triton
launch per matrix: the blocks are read once, as stored, and each plane is written once.

What it is for: split prefill (ktrans.operators.experts_split) copies a layer's experts from the CPU experts' host
buffers to the GPU for every long prompt, so the repack runs once per layer per prefill chunk and must cost far less
than the copy. The torch repack builds int64 temporaries per weight (~40 ms for one 80B layer on an H200, more than
its PCIe copy); this kernel moves each byte once.

Sources: ggml's row-major blocks, or the CPU experts' 16-row layout of Q4_K and Q5_K (`x16`: per group of 16 rows and
super-block, the rows' 4-byte words interleaved: word w of row r at byte (w * 16 + r) * 4). The kernel reads either in
place, so the X16 bytes need no separate permute.

What the planes hold, per super-block of one row (the derivations in the kernel's comments):
- Q4_K / Q5_K `lo`: word i = qs[i] | qs[32 + i] << 8 | qs[64 + i] << 16 | qs[96 + i] << 24 (ggml stores sub-block
  2c in the low and 2c + 1 in the high nibbles of qs[32c .. 32c + 31], and the plane wants sub-block S in nibble S
  of word i): a byte transpose. Q5_K's `hi` is its qh as stored; `d` the two fp16 scales; `sc` the six-bit scales
  and mins unpacked.
- Q6_K `lo`: word h * 16 + i, nibble p = nibble p // 4 of ql[h * 64 + ((p // 2) % 2) * 32 + (p % 2) * 16 + i];
  `hi`: word i, bits 2S..2S+1 = bits 2 * ((S % 8) // 2) of qh[(S // 8) * 32 + (S % 2) * 16 + i]; `sc` and `d` as
  stored.
Q8_0 has no K-quant structure to undo (its planes are slices of the blocks): `repack_blocks` leaves it to the torch
repack. The oracle is ktrans.kernels.triton.quant_layout.repack: equal bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ktrans.kernels.triton.quant_layout import BLOCK_BYTES, QK, PackedWeight, repack

_CODE = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
_X16_ROWS = 16
_BR = 64  # rows per program


@triton.jit
def _src(rows, sb, j, NSB, SB: tl.constexpr, X16: tl.constexpr):
    """Byte offsets of byte j of super-block sb of the given rows (int64)."""
    if X16:
        return (rows // 16) * (NSB * SB * 16) + sb * (SB * 16) + (j // 4) * 64 + (rows % 16) * 4 + (j % 4)
    else:
        return rows * (NSB * SB) + sb * SB + j


@triton.jit
def _repack_kernel(src, lo_ptr, hi_ptr, d_ptr, sc_ptr, R, N, NSB, SB: tl.constexpr, QT: tl.constexpr,
                   X16: tl.constexpr, BR: tl.constexpr):
    """Program (row tile, super-block): rows of the flattened [E * N] rows; planes are [E, NSB, N, width]."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    sb = tl.program_id(1).to(tl.int64)
    rmask = rows < R
    r2 = rows[:, None]
    m2 = rmask[:, None]
    dst = ((rows // N) * NSB + sb) * N + rows % N  # the row's index in the [E, NSB, N] plane grid
    d2 = dst[:, None]
    j32 = tl.arange(0, 32)[None, :]
    j16 = tl.arange(0, 16)[None, :]
    j4 = tl.arange(0, 4)[None, :]
    if QT < 2:  # Q4_K / Q5_K: d, dmin | 12 scale bytes | (Q5_K: qh 32) | qs 128
        QOFF: tl.constexpr = 16 + 32 * QT
        word = tl.zeros([BR, 32], dtype=tl.int32)
        for c in tl.static_range(4):
            b = tl.load(src + _src(r2, sb, QOFF + 32 * c + j32, NSB, SB, X16), mask=m2, other=0)
            word = word | (b.to(tl.int32) << (8 * c))
        tl.store(lo_ptr + d2 * 32 + j32, word, mask=m2)
        if QT == 1:
            qh = tl.load(src + _src(r2, sb, 16 + j32, NSB, SB, X16), mask=m2, other=0)
            tl.store(hi_ptr + d2 * 32 + j32, qh, mask=m2)
        dd = tl.load(src + _src(r2, sb, j4, NSB, SB, X16), mask=m2, other=0)
        tl.store(d_ptr + d2 * 4 + j4, dd, mask=m2)
        s_lo = tl.load(src + _src(r2, sb, 4 + j4, NSB, SB, X16), mask=m2, other=0).to(tl.int32)
        s_mid = tl.load(src + _src(r2, sb, 8 + j4, NSB, SB, X16), mask=m2, other=0).to(tl.int32)
        s_hi = tl.load(src + _src(r2, sb, 12 + j4, NSB, SB, X16), mask=m2, other=0).to(tl.int32)
        # ggml's get_scale_min_k4: scales 0-3 and mins 0-3 are the low six bits of bytes 0-3 and 4-7; 4-7 take
        # their low four bits from bytes 8-11 and their top two from the top bits of bytes 0-3 (scales) / 4-7 (mins)
        base = sc_ptr + d2 * 16 + j4
        tl.store(base, (s_lo & 63).to(tl.uint8), mask=m2)
        tl.store(base + 4, ((s_hi & 15) | ((s_lo >> 6) << 4)).to(tl.uint8), mask=m2)
        tl.store(base + 8, (s_mid & 63).to(tl.uint8), mask=m2)
        tl.store(base + 12, ((s_hi >> 4) | ((s_mid >> 6) << 4)).to(tl.uint8), mask=m2)
    else:  # Q6_K: ql 128 | qh 64 | scales 16 (int8) | d (fp16)
        h = j32 // 16
        i = j32 % 16
        word = tl.zeros([BR, 32], dtype=tl.int32)
        for p in tl.static_range(8):
            b = tl.load(src + _src(r2, sb, h * 64 + ((p // 2) % 2) * 32 + (p % 2) * 16 + i, NSB, SB, X16),
                        mask=m2, other=0).to(tl.int32)
            word = word | (((b >> (4 * (p // 4))) & 15) << (4 * p))
        tl.store(lo_ptr + d2 * 32 + j32, word, mask=m2)
        bits = tl.zeros([BR, 16], dtype=tl.int32)
        for s in tl.static_range(16):
            b = tl.load(src + _src(r2, sb, 128 + (s // 8) * 32 + (s % 2) * 16 + j16, NSB, SB, X16),
                        mask=m2, other=0).to(tl.int32)
            bits = bits | (((b >> (2 * ((s % 8) // 2))) & 3) << (2 * s))
        tl.store(hi_ptr + d2 * 16 + j16, bits, mask=m2)
        scales = tl.load(src + _src(r2, sb, 192 + j16, NSB, SB, X16), mask=m2, other=0)
        tl.store(sc_ptr + d2 * 16 + j16, scales, mask=m2)
        j2 = tl.arange(0, 2)[None, :]
        dd = tl.load(src + _src(r2, sb, 208 + j2, NSB, SB, X16), mask=m2, other=0)
        tl.store(d_ptr + d2 * 2 + j2, dd, mask=m2)


def repack_blocks(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], x16: bool = False) -> PackedWeight:
    """ggml blocks (uint8, `shape` [N, K] or [E, N, K] logical; row-major, or the CPU's 16-row layout with `x16`)
    already on their device -> the packed planes there, in one launch. Q8_0 goes through the torch repack."""
    *lead, n, k = (int(s) for s in shape)
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"no packed layout for {qtype}")
    if k % QK:
        raise ValueError(f"{qtype}: rows of {k} weights do not fill whole super-blocks of {QK}")
    rows = n * (lead[0] if lead else 1)
    if x16 and (qtype not in ("Q4_K", "Q5_K") or rows % _X16_ROWS):
        raise ValueError(f"the 16-row layout holds Q4_K or Q5_K in whole groups of 16 rows, not {qtype} x {rows}")
    if qtype not in _CODE:
        return repack(raw, qtype, shape)
    nsb, sb_bytes = k // QK, BLOCK_BYTES[qtype]
    src = raw.reshape(-1)
    if src.dtype != torch.uint8 or src.numel() != rows * nsb * sb_bytes:
        raise ValueError(f"{qtype} {tuple(shape)}: expected {rows * nsb * sb_bytes} uint8 bytes, got "
                         f"{src.numel()} {src.dtype}")
    dev = src.device
    grid_shape = (*lead, nsb, n)
    lo = torch.empty(*grid_shape, 32, dtype=torch.int32, device=dev)
    hi_w, hi_t = {"Q4_K": (0, torch.uint8), "Q5_K": (32, torch.uint8), "Q6_K": (16, torch.int32)}[qtype]
    hi = torch.empty(*grid_shape, hi_w, dtype=hi_t, device=dev)
    d = torch.empty(*grid_shape, 1 if qtype == "Q6_K" else 2, dtype=torch.float16, device=dev)
    sc = torch.empty(*grid_shape, 16, dtype=torch.int8 if qtype == "Q6_K" else torch.uint8, device=dev)
    if rows:
        _repack_kernel[(triton.cdiv(rows, _BR), nsb)](
            src, lo, hi if hi.numel() else lo, d.view(torch.uint8), sc.view(torch.uint8), rows, n, nsb,
            SB=sb_bytes, QT=_CODE[qtype], X16=x16, BR=_BR)
    return PackedWeight(qtype, n, k, lo, hi, d, sc, lead[0] if lead else None)

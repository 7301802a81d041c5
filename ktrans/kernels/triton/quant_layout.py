"""The GPU layout of GGUF-quantized matrices (Q4_K, Q5_K, Q6_K, Q8_0) that the Triton quantized kernels read, and
the repack from ggml's blocks into it. Plain torch (no triton import), so it runs on any device: the raw blocks can
be copied to the GPU as stored and repacked there.

ggml interleaves scales, mins and bits inside each 144..210-byte block. Here a matrix [N, K] (K a multiple of 256:
one super-block of 256 weights) becomes planes ordered super-block-major ([NSB, N, ...], NSB = K / 256), so that one
super-block of a tile of rows is one contiguous run in each plane:

- `lo`: the low 4 bits as int32 words of 8 nibbles. A super-block is cut into sub-blocks S of SUB weights (32, or 16
  for Q6_K, whose scales are per 16); word (S // 8) * SUB + i holds, in nibble S % 8, weight i of sub-block S. A
  kernel gets a whole sub-block of a row tile as `(words >> 4 * (S % 8)) & 15` with no gather. Q8_0 keeps its
  int8 values in element order instead (`lo` is int8 [NSB, N, 256]).
- `hi`: the high bits. Q5_K: uint8 [NSB, N, 32], bit S of byte i is bit 4 of weight i of sub-block S (ggml's own
  qh); Q6_K: int32 [NSB, N, 16], bits 2S..2S+1 of word i are bits 4-5 of weight i of sub-block S.
- `d`: ggml's fp16 super-block scales as stored: Q4_K / Q5_K (d, dmin) [NSB, N, 2]; Q6_K d [NSB, N, 1]; Q8_0 the 8
  block scales of a super-block [NSB, N, 8].
- `sc`: the sub-block scales as integers: Q4_K / Q5_K uint8 [NSB, N, 16] (8 six-bit scales, then 8 six-bit mins);
  Q6_K int8 [NSB, N, 16]; Q8_0 none.

Nothing is re-quantized: a kernel computes ggml's products itself (`d * sc`, `dmin * m` in float32), so a weight
dequantizes to exactly what gguf-py gives, up to the one fp32 rounding a fused multiply-add may skip. The planes hold
4.625 bits per weight for Q4_K (GGUF: 4.5), 5.625 for Q5_K (5.5), 6.5625 for Q6_K (6.5625) and 8.5 for Q8_0 (8.5).

A stack of expert matrices keeps a leading expert dimension on every plane ([E, NSB, N, ...]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 256  # weights per super-block (a Q8_0 "super-block" is 8 of its 32-weight blocks)
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34}
BLOCK_WEIGHTS = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32}
SUB = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16, "Q8_0": 32}  # weights per sub-block (one scale)
TYPES = tuple(BLOCK_BYTES)
_ROWS_PER_CHUNK = 4096  # rows repacked at a time: bounds the int64 temporaries


@dataclass
class PackedWeight:
    """One matrix [N, K] (or a stack [E, N, K]) in the planes above."""

    qtype: str
    n: int
    k: int
    lo: torch.Tensor
    hi: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    experts: int | None = None

    @property
    def nsb(self) -> int:
        return self.k // QK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lo, self.hi, self.d, self.sc))

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def planes(self) -> dict[str, torch.Tensor]:
        return {"lo": self.lo, "hi": self.hi, "d": self.d, "sc": self.sc}

    def to(self, device: torch.device | str) -> "PackedWeight":
        mv = lambda t: t.to(device)  # noqa: E731
        return PackedWeight(self.qtype, self.n, self.k, mv(self.lo), mv(self.hi), mv(self.d), mv(self.sc),
                            self.experts)

    def expert(self, e: int) -> "PackedWeight":
        """Expert e of a stack, as one matrix (views)."""
        if self.experts is None:
            raise ValueError("not a stack of experts")
        return PackedWeight(self.qtype, self.n, self.k, self.lo[e], self.hi[e], self.d[e], self.sc[e])


def packable(qtype: str, k: int) -> bool:
    """Whether a matrix of this ggml type and row length has a packed layout (else it is kept as floats)."""
    return qtype in BLOCK_BYTES and k % QK == 0


def _wrap32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 with the same bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def _pack_bits(q: torch.Tensor, sub: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """q [..., 256] (element order, values < 2**bits) -> words [..., 256 * bits / width]: word (S // per) * sub + i
    holds field S % per (bits wide) = q[S * sub + i], per = fields per word."""
    width = 32 if dtype == torch.int32 else 8
    per = width // bits
    lead = q.shape[:-1]
    g = q.to(torch.int64).reshape(*lead, QK // sub // per, per, sub).transpose(-1, -2)  # [.., group, i, field]
    shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits
    words = (g << shifts).sum(-1).reshape(*lead, -1)
    return _wrap32(words) if dtype == torch.int32 else words.to(dtype)


def _f16(b: torch.Tensor, off: int, count: int = 1) -> torch.Tensor:
    return b[..., off:off + 2 * count].contiguous().view(torch.float16)


def _k_scales(s: torch.Tensor) -> torch.Tensor:
    """The 12-byte Q4_K / Q5_K scale field -> uint8 [..., 16]: 8 six-bit scales, then 8 six-bit mins."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1)
    return torch.cat([sc, mn], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 128-byte Q4_K / Q5_K qs -> the low 4 bits [..., 256] in element order (64 weights per 32 bytes: low
    nibbles first)."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([q & 15, q >> 4], -2).reshape(*qs.shape[:-1], QK)


def _planes(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 super-blocks [..., TS * (256 / block)] -> (lo, hi, d, sc), each [..., plane] (row-major still)."""
    dev = blocks.device
    empty8 = torch.empty(*blocks.shape[:-1], 0, dtype=torch.uint8, device=dev)
    if qtype == "Q8_0":
        b = blocks.reshape(*blocks.shape[:-1], 8, 34)
        d = b[..., 0:2].contiguous().view(torch.float16).reshape(*blocks.shape[:-1], 8)
        lo = b[..., 2:].contiguous().view(torch.int8).reshape(*blocks.shape[:-1], QK)
        return lo, empty8, d, empty8
    if qtype in ("Q4_K", "Q5_K"):
        d = _f16(blocks, 0, 2)
        sc = _k_scales(blocks[..., 4:16])
        low = _nibbles(blocks[..., 16:144] if qtype == "Q4_K" else blocks[..., 48:176])
        lo = _pack_bits(low, 32, 4, torch.int32)
        hi = blocks[..., 16:48].contiguous() if qtype == "Q5_K" else empty8
        return lo, hi, d, sc
    if qtype == "Q6_K":
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        lead = blocks.shape[:-1]
        # element h*128 + j*32 + l: nibble j // 2 of ql[h*64 + (j % 2)*32 + l]; bits 2j of qh[h*32 + l]
        low = ql.reshape(*lead, 2, 1, 2, 32)
        low = torch.cat([low & 15, low >> 4], -3).reshape(*lead, QK)
        high = qh.reshape(*lead, 2, 1, 32)
        high = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], -2).reshape(*lead, QK)
        lo = _pack_bits(low, 16, 4, torch.int32)
        hi = _pack_bits(high, 16, 2, torch.int32)
        sc = blocks[..., 192:208].contiguous().view(torch.int8)
        d = _f16(blocks, 208)
        return lo, hi, d, sc
    raise ValueError(f"no packed layout for {qtype}; packed types: {', '.join(TYPES)}")


def repack(raw: torch.Tensor, qtype: str, shape: tuple[int, ...], device: torch.device | str | None = None,
           rows_per_chunk: int | None = None) -> PackedWeight:
    """ggml blocks uint8 [N, row_bytes] (or [E, N, row_bytes]) of logical `shape` [N, K] (or [E, N, K]) -> the
    planes, on `device` (default: raw's). The bytes go to the device as stored and are repacked there,
    `rows_per_chunk` rows at a time (default 4096: more means fewer kernel launches and larger int64 temporaries)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"no packed layout for {qtype}; packed types: {', '.join(TYPES)}")
    *lead, n, k = (int(s) for s in shape)
    if k % QK:
        raise ValueError(f"{qtype}: rows of {k} weights do not fill whole super-blocks of {QK}")
    nsb = k // QK
    sb_bytes = BLOCK_BYTES[qtype] * QK // BLOCK_WEIGHTS[qtype]
    device = torch.device(device) if device is not None else raw.device
    src = raw.reshape(-1, nsb * sb_bytes)  # every row of every expert: chunks need not align to experts
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    step = rows_per_chunk or _ROWS_PER_CHUNK
    for r in range(0, src.shape[0], step):
        blocks = src[r:r + step].to(device).reshape(-1, nsb, sb_bytes)
        for i, plane in enumerate(_planes(blocks, qtype)):
            parts[i].append(plane)
    # [E * N, NSB, w] -> [E, NSB, N, w]
    lo, hi, d, sc = (torch.cat(p).reshape(src.shape[0] // n, n, nsb, p[0].shape[-1]).transpose(1, 2).contiguous()
                     .reshape(*lead, nsb, n, p[0].shape[-1]) for p in parts)
    return PackedWeight(qtype, n, k, lo, hi, d, sc, lead[0] if lead else None)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Matrices (or stacks of as many experts) of one type and row length stacked along N: a fused projection
    stored as two tensors, or the experts' gate and up as one [E, 2I, H] stack."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.k != first.k or p.experts != first.experts for p in parts):
        raise ValueError("concat_rows needs matrices of one type, row length and expert count")
    cat = lambda ts: torch.cat(ts, dim=-2)  # noqa: E731  [.., NSB, N, w] along N
    return PackedWeight(first.qtype, sum(p.n for p in parts), first.k, cat([p.lo for p in parts]),
                        cat([p.hi for p in parts]), cat([p.d for p in parts]), cat([p.sc for p in parts]),
                        first.experts)


def as_stack(w: PackedWeight) -> PackedWeight:
    """One matrix as a stack of one expert ([1, N, K]; views): what the MoE kernel reads, for a SwiGLU MLP run as
    a one-expert MoE."""
    if w.experts is not None:
        raise ValueError("already a stack of experts")
    return PackedWeight(w.qtype, w.n, w.k, w.lo[None], w.hi[None], w.d[None], w.sc[None], 1)

"""What the Gluon kernels (quant_gemv_reg, quant_rows_reg) share: whether Gluon can run here, the PTX that turns Q4_K
code words into bf16 pairs (Q6_K's is quant_gemv_mma's), and small Gluon helpers (PDL's entry, the barrier under
Triton 3.6's and 3.9's names, a word joined eightfold for the PTX's pack of 8, a tile's register copies).
"""
from __future__ import annotations

import functools

import torch

from ktrans.kernels.triton import interpreting
from ktrans.kernels.triton.quant_gemv_mma import _q6_asm

try:  # Gluon is Triton's experimental layout-explicit dialect (Triton 3.5+); without it these bodies are unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401 (the bodies' mma: checked here)
    _GLUON = True
except ImportError:  # pragma: no cover - an older Triton
    _GLUON = False


def available() -> bool:
    """Whether the Gluon bodies can run here: Gluon imports and Triton compiles for a GPU (not its interpreter)."""
    return _GLUON and not interpreting()


def runs_on(device: torch.device) -> bool:
    """available() and `device` a CUDA GPU with bf16 mma.sync (compute capability 8.0 and newer)."""
    if device.type != "cuda" or not available():
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index) >= 8


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _q4_asm() -> str:
    """PTX: a code word ($4) -> four registers of two bf16 each, pair j = nibbles j (low half) and j + 4 (high half)
    as 1 + q / 128: the pair sits at bits 4j..4j+3 and 4j+16..4j+19, so one shift right by 4j puts it at the two
    halves' mantissa bits 0-3, and lop3 0xEA ((t & mask) | bits) masks it and ORs in 1.0's bits."""
    text = "{\n.reg .b32 t;\n"
    for j in range(4):
        src = "$4"
        if j:
            text += f"shr.u32 t, $4, {4 * j};\n"
            src = "t"
        text += f"lop3.b32 ${j}, {src}, 0x000F000F, 0x3F803F80, 0xEA;\n"
    return text + "}"


if _GLUON:
    _Q4_ASM = gl.constexpr(_q4_asm())
    _Q6_ASM = gl.constexpr(_q6_asm())
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6's name, 3.9's

    @gluon.jit
    def _enter(PDL: gl.constexpr):
        """ktrans.kernels.triton.pdl.enter, in Gluon."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _join8(t):
        """t [...] -> [..., 2, 2, 2]: eight copies (the asm's pack of 8 takes one word eight times)."""
        t2 = gl.join(t, t)
        t4 = gl.join(t2, t2)
        return gl.join(t4, t4)

    @gluon.jit
    def _twice(t, AXIS: gl.constexpr):
        """[R, C] -> t twice along AXIS (0: [2R, C], 1: [R, 2C]), the copy's index the axis's top bit."""
        if AXIS == 0:
            u = gl.reshape(gl.permute(gl.join(t, t), (2, 0, 1)), [2 * t.shape[0], t.shape[1]])
        else:
            u = gl.reshape(gl.permute(gl.join(t, t), (0, 2, 1)), [t.shape[0], 2 * t.shape[1]])
        return u

    @gluon.jit
    def tile_copies(t, N: gl.constexpr, AXIS: gl.constexpr):
        """[R, C] -> N (1, 2, 4 or 8) copies of t along AXIS, the copy's index the axis's top bits: where those bits
        are a thread's registers (its further row or column tiles of an mma layout), register copies."""
        if N >= 2:
            t = _twice(t, AXIS)
        if N >= 4:
            t = _twice(t, AXIS)
        if N >= 8:
            t = _twice(t, AXIS)
        return t

    @gluon.jit
    def dequant_rows(words, hi, R: gl.constexpr, QT: gl.constexpr):
        """Code words [R, 4, 8] (word 8 a + m of each row) -> [R, 256] bf16 in the dot's K order, column
        64 j + 8 m + 2 a + e = word 8 a + m's nibble j + 4 e as 1 + q / 128 (Q4_K, _q4_asm), or with its two high
        bits from `hi` (the matching high-bit words, already shifted to bits 2s, 2s + 1 for nibble s) as
        1 + q6 / 64 (Q6_K, QT 2: quant_gemv_mma._q6_asm); the caller converts it to its operand's layout."""
        if QT == 2:
            f = gl.inline_asm_elementwise(_Q6_ASM, "=r,=r,=r,=r" + ",r" * 16, [_join8(words), _join8(hi)],
                                          dtype=gl.bfloat16, is_pure=True, pack=8)
        else:
            f = gl.inline_asm_elementwise(_Q4_ASM, "=r,=r,=r,=r" + ",r" * 8, [_join8(words)], dtype=gl.bfloat16,
                                          is_pure=True, pack=8)  # [R, 4, 8, 2, 2, 2]: element 2 j + e of a word
        return gl.reshape(gl.permute(gl.reshape(f, [R, 4, 8, 4, 2]), (0, 3, 2, 1, 4)), [R, 256])

    @gluon.jit
    def word_offsets(row0, n_valid, R: gl.constexpr, LW: gl.constexpr):
        """(woff, wmask, hoff, hshift) of rows row0.. (R of them, those < n_valid real) in the code words' layout LW
        [R, 4, 8] (word 8 a + m of each row): the words' offsets in a super-block's plane rows, their mask, and for
        Q6_K the matching high-bit word's offset ((8 a + m) % 16) and its shift (16 (a // 2))."""
        n_w = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
        a_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
        m_w = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
        woff = n_w[:, None, None] * 32 + (a_w * 8)[None, :, None] + m_w[None, None, :]
        hoff = n_w[:, None, None] * 16 + ((a_w % 2) * 8)[None, :, None] + m_w[None, None, :]
        return woff, (n_w < n_valid)[:, None, None], hoff, (16 * (a_w // 2))[None, :, None]

    @gluon.jit
    def store_split(y, offs, mask, out_ptr, part_ptr, cnt, pid_k, SPLIT, STRIDE, FUSED: gl.constexpr):
        """A program's fp32 result y at `offs`: SPLIT = 1, into out_ptr (its dtype); else its K split's partial into
        part_ptr + pid_k * STRIDE, and with FUSED the tile's last program to finish (counted at `cnt`, zero between
        calls) sums the SPLIT partials in split order into out_ptr and zeroes the count (quant_gemv.store_split in
        Gluon)."""
        if SPLIT == 1:
            gl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            gl.store(part_ptr + pid_k * STRIDE + offs, y, mask=mask)
            if FUSED:
                _barrier()  # every thread's partial stored before the count's release
                if gl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                    total = gl.zeros_like(y)
                    for s in range(SPLIT):
                        total += gl.load(part_ptr + s * STRIDE + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    gl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                    gl.atomic_xchg(cnt, 0)

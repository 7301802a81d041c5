"""`ktrans bench kernels` cases of the Gated DeltaNet family: the Triton chunked prefill, varlen conv and fused decode
step at Qwen3-Next's shapes (HK=16, HV=32, Dk=Dv=128, conv width 4, conv_dim 8192), bf16 activations, fp32 states.

Chunked prefill runs fla-core's chunk_gated_delta_rule as the peer when `import fla` works (with the gates and the
L2 norm in its kernels too; its g is precomputed, ours is computed from a and b inside). Decode counts the bytes a
step must move: the fp32 state of every row read and written (2 MiB each way per sequence), the conv window read
and written, the row of q|k|v, the gate inputs, the conv weight and the output.
"""
from __future__ import annotations

import torch

from dataclasses import dataclass

from ktrans.bench.kernels import Timed, case

WIDTH, BF16 = 4, 2


@dataclass(frozen=True)
class Shape:
    hk: int
    hv: int
    d: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.d + self.hv * self.d


def _shape(device: torch.device) -> Shape:
    return Shape(16, 32, 128) if device.type == "cuda" else Shape(1, 2, 16)


def _rand(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    return g, lambda *shape: torch.randn(*shape, generator=g).to(device)


def _prefill_inputs(t: int, sh: Shape, device: torch.device):
    _, rnd = _rand(device)
    y = rnd(t, sh.conv_dim).to(torch.bfloat16)  # the conv's output: q, k and v are views into it, as in the op
    kd = sh.hk * sh.d
    q, k = y[:, :kd].view(t, sh.hk, sh.d), y[:, kd:2 * kd].view(t, sh.hk, sh.d)
    v = y[:, 2 * kd:].view(t, sh.hv, sh.d)
    a, b = rnd(t, sh.hv).to(torch.bfloat16), rnd(t, sh.hv).to(torch.bfloat16)
    A_log, dt_bias = rnd(sh.hv) * 0.5, rnd(sh.hv)
    pool = torch.zeros(2, sh.hv, sh.d, sh.d, device=device)
    return q, k, v, a, b, A_log, dt_bias, pool


def _fla_peer(q, k, v, a, b, A_log, dt_bias, pool):
    """fla-core on the same work, or None where it does not import. Its q and k take HK heads where its version
    groups value heads, else they are expanded to HV here (outside the timed call)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    from ktrans.operators.gdn import gdn_gate

    g = gdn_gate(a, A_log, dt_bias)[None]
    beta = b.float().sigmoid().to(q.dtype)[None]
    h0 = pool[1:2].clone()
    qc, kc, vc = q.contiguous()[None], k.contiguous()[None], v.contiguous()[None]

    def call(qq, kk):
        return chunk_gated_delta_rule(qq, kk, vc, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    try:
        call(qc, kc)
    except Exception:  # a version without grouped value heads
        qc, kc = (x.repeat_interleave(v.shape[1] // q.shape[1], dim=2) for x in (qc, kc))
        call(qc, kc)
    return lambda: call(qc, kc)


def _prefill_case(t: int):
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton.gated_delta import chunk_gated_delta_rule_varlen, plan_chunks

        sh = _shape(device)
        n = t if device.type == "cuda" else min(t, 130)
        q, k, v, a, b, A_log, dt_bias, pool = _prefill_inputs(n, sh, device)
        plan = plan_chunks([(0, n, 0, False)], device, [0])
        out = torch.empty(n, sh.hv, sh.d, dtype=torch.bfloat16, device=device)
        fn = lambda: chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, plan, out=out)  # noqa: E731
        hk, hv, d = sh.hk, sh.hv, sh.d
        moved = 2 * n * hk * d * BF16 + 2 * n * hv * d * BF16 + 2 * n * hv * BF16 + 2 * hv * d * d * 4
        # Per token and value head: k k^T, q k^T and the solve (~3 * 64 * D), w S, k^T v_new and q S (3 * D * D),
        # attn v_new (64 * D); multiply-adds, so 2 flops each.
        flops = 2 * n * hv * (3 * 64 * d + 3 * d * d + 64 * d)
        peer = _fla_peer(q, k, v, a, b, A_log, dt_bias, pool) if device.type == "cuda" else None
        return Timed(fn, moved, flops, peer, "fla" if peer else "")
    return setup


def _decode_case(batch: int, split_v: bool | None = None, norm: str | None = None, fold: bool | None = None):
    """split_v: force the one-launch (False) or two-launch (True) decode path; None: the kernel's own choice.
    norm: also the layer's gated output norm, by its own launch ("launch") or inside the state launch ("fused",
    KTRANS_GDN_DECODE_NORM's form); its z read counted in the bytes. fold: the two launches as one
    (KTRANS_GDN_DECODE_FOLD's form; None: the flag's setting)."""
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton.gated_delta_decode import gated_delta_decode
        from ktrans.kernels.triton.norm import rms_norm_gated

        sh = _shape(device)
        n = batch if device.type == "cuda" else min(batch, 2)
        g, rnd = _rand(device)
        mixed = rnd(n, sh.conv_dim).to(torch.bfloat16)
        a, b = rnd(n, sh.hv).to(torch.bfloat16), rnd(n, sh.hv).to(torch.bfloat16)
        A_log, dt_bias = rnd(sh.hv) * 0.5, rnd(sh.hv)
        weight = rnd(sh.conv_dim, WIDTH).to(torch.bfloat16)
        conv_pool = rnd(n + 1, sh.conv_dim, WIDTH - 1).to(torch.bfloat16)
        ssm_pool = rnd(n + 1, sh.hv, sh.d, sh.d) * 0.1
        slots = torch.randperm(n, generator=g).to(device)  # rows out of slot order, as in a running batch
        out = torch.empty(n, sh.hv, sh.d, dtype=torch.bfloat16, device=device)
        z = rnd(n, sh.hv, sh.d).to(torch.bfloat16)
        nw = (1 + 0.1 * rnd(sh.d)).to(torch.bfloat16)

        def fn():
            o = gated_delta_decode(mixed, a, b, A_log, dt_bias, weight, conv_pool, ssm_pool, slots, sh.hk, sh.d,
                                   out=out, split_v=split_v, norm=(z, nw, 1e-6) if norm == "fused" else None,
                                   fold=fold)
            return rms_norm_gated(o, z, nw, 1e-6) if norm == "launch" else o

        per_row = (2 * sh.hv * sh.d * sh.d * 4 + 2 * sh.conv_dim * (WIDTH - 1) * BF16 + sh.conv_dim * BF16
                   + 2 * sh.hv * BF16 + sh.hv * sh.d * BF16 + (sh.hv * sh.d * BF16 if norm else 0))
        return Timed(fn, n * per_row + sh.conv_dim * WIDTH * BF16 + 2 * sh.hv * 4)
    return setup


def _conv_case(t: int):
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton.conv import causal_conv1d_varlen
        from ktrans.kernels.triton.gated_delta import plan_chunks

        sh = _shape(device)
        n = t if device.type == "cuda" else min(t, 130)
        _, rnd = _rand(device)
        x = rnd(n, sh.conv_dim).to(torch.bfloat16)
        weight = rnd(sh.conv_dim, WIDTH).to(torch.bfloat16)
        pool = torch.zeros(2, sh.conv_dim, WIDTH - 1, dtype=torch.bfloat16, device=device)
        plan = plan_chunks([(0, n, 0, False)], device)
        out = torch.empty_like(x)
        return Timed(lambda: causal_conv1d_varlen(x, weight, pool, plan, out=out), 2 * n * sh.conv_dim * BF16)
    return setup


case("gdn", "chunked prefill T=8192", ("prefill",))(_prefill_case(8192))
case("gdn", "chunked prefill T=32768", ("prefill",))(_prefill_case(32768))
case("gdn", "conv prefill T=8192", ("prefill",))(_conv_case(8192))
case("gdn", "decode B=1", ("decode",))(_decode_case(1))
case("gdn", "decode B=1, one launch", ("decode",))(_decode_case(1, split_v=False))
case("gdn", "decode B=1 and output norm, its own launch", ("decode",))(_decode_case(1, norm="launch"))
case("gdn", "decode B=1 and output norm, fused", ("decode",))(_decode_case(1, norm="fused"))
case("gdn", "decode B=1, folded", ("decode",))(_decode_case(1, split_v=True, fold=True))
case("gdn", "decode B=1 and output norm, folded and fused", ("decode",))(_decode_case(1, True, "fused", True))
case("gdn", "decode B=64", ("decode",))(_decode_case(64))
case("gdn", "decode B=64, folded", ("decode",))(_decode_case(64, split_v=True, fold=True))
case("gdn", "decode B=64 and output norm, its own launch", ("decode",))(_decode_case(64, norm="launch"))
case("gdn", "decode B=64 and output norm, fused", ("decode",))(_decode_case(64, norm="fused"))
case("gdn", "decode B=64, one launch", ("decode",))(_decode_case(64, split_v=False))
case("gdn", "decode B=256", ("decode",))(_decode_case(256))
case("gdn", "decode B=256, one launch", ("decode",))(_decode_case(256, split_v=False))

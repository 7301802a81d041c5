"""`ktrans bench kernels --family quant`: the Triton quantized linears and MoE (ktrans.kernels.triton.quant,
moe_quant) at the 80B model's shapes (hidden 2048; configs/qwen3-next-80b-a3b.json), on random GGUF blocks repacked
on the device.

- GEMV at M=1 (decode) of one DeltaNet layer's and one attention layer's projections at Q4_K, each projection alone
  and the layer's set in one call; bytes = the packed weights the kernels read (Q4_K: 4.625 bits per weight, the
  GGUF's 4.5 plus fp16 d/dmin beside byte-wide scales). Peer: cuBLAS on the same matrices in bf16.
- GEMM at M=4096 (prefill) with flops = 2 M N K. Peer: cuBLAS bf16.
- The router's float gate at M=1 through the Triton dense GEMV. Peer: cuBLAS bf16.
- One MoE layer (512 experts, hidden 2048, intermediate 512, top-10, Q4_K) at B = 1, 16, 256 tokens; bytes = the
  distinct routed experts' packed weights. Peer (B <= 16): KExpertsTorch's gathered bf16 bmm.
- The on-device repack of one MoE layer's blocks by the Triton kernel (ktrans.kernels.triton.repack), from ggml rows and
  from the CPU experts' 16-row layout, as split prefill runs it: bytes = blocks read plus
  planes written. The host-to-device copy of those blocks comes on top (a layer is ~0.9 GB at Q4_K).
"""
from __future__ import annotations

import torch

from ktrans.bench.kernels import Timed, case

H, I_MOE, E, TOP_K = 2048, 512, 512, 10
# (name, N, K) of one layer's projections (Qwen3-Next-80B-A3B)
DELTANET = (("in_proj_qkvz", 12288, 2048), ("in_proj_ba", 64, 2048), ("out_proj", 2048, 4096))
ATTENTION = (("q_proj", 8192, 2048), ("k_proj", 512, 2048), ("v_proj", 512, 2048), ("o_proj", 2048, 4096))
SHARED = (("shared_expert.gate_up", 1024, 2048), ("shared_expert.down", 2048, 512))
_BLOCK = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,)), "Q8_0": (34, (0,)), "Q5_K": (176, (0, 2))}


def random_blocks(qtype: str, rows: int, k: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random ggml blocks whose fp16 scales are finite and small."""
    size, offsets = _BLOCK[qtype]
    per_block = 256 if qtype != "Q8_0" else 32
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, k // per_block, size), dtype=torch.uint8, device=device, generator=g)
    for off in offsets:
        d = (torch.rand(rows, k // per_block, device=device, generator=g) * 1e-3).to(torch.float16)
        raw[:, :, off:off + 2] = d.view(torch.uint8).reshape(rows, k // per_block, 2)
    return raw.reshape(rows, -1)


def _full_size_only(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError("a full-size case: CUDA only (Triton's interpreter would take hours)")


def _packed(qtype: str, n: int, k: int, device: torch.device, seed: int = 0):
    from ktrans.kernels.triton.quant_layout import repack

    return repack(random_blocks(qtype, n, k, device, seed), qtype, (n, k), device)


def random_stack(qtype: str, n: int, rows: int, cols: int, device: torch.device, seed: int):
    """n experts' [rows, cols] random blocks (expert e drawn from seed + 7 e), repacked on the device."""
    from ktrans.kernels.triton.quant_layout import repack

    raw = torch.stack([random_blocks(qtype, rows, cols, device, seed + 7 * e) for e in range(n)])
    return repack(raw, qtype, (n, rows, cols), device)


def random_moe_layer(device: torch.device, down_type: str = "Q4_K"):
    """One 80B MoE layer's routed experts: (gate and up as one [E, 2 I, H] Q4_K stack, down [E, H, I])."""
    from ktrans.kernels.triton.quant_layout import concat_rows

    gate_up = concat_rows([random_stack("Q4_K", E, I_MOE, H, device, 1), random_stack("Q4_K", E, I_MOE, H, device, 2)])
    return gate_up, random_stack(down_type, E, H, I_MOE, device, 3)


def _gemv_case(shapes, m: int, qtype: str = "Q4_K"):
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton.quant import qlinear

        if sum(n for _, n, _ in shapes) * m > 64:  # all but in_proj_ba at M=1, the CPU smoke case
            _full_size_only(device)

        ws = [_packed(qtype, n, k, device, s) for s, (_, n, k) in enumerate(shapes)]
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _, n, k in shapes]
        xs = {k: torch.randn(m, k, device=device, dtype=torch.bfloat16) for _, _, k in shapes}
        io = sum(m * (k + n) * 2 for _, n, k in shapes)
        flops = sum(2 * m * n * k for _, n, k in shapes)

        def fn():
            for w, (_, _, k) in zip(ws, shapes):
                qlinear(xs[k], w)

        def peer():
            for w, (_, _, k) in zip(dense, shapes):
                torch.matmul(xs[k], w.T)

        def copy(i: int):  # the same shapes, other weights (seeds past the first copy's)
            ws_i = [_packed(qtype, n, k, device, 1000 * i + s) for s, (_, n, k) in enumerate(shapes)]
            return lambda: [qlinear(xs[k], w) for w, (_, _, k) in zip(ws_i, shapes)]

        return Timed(fn, sum(w.nbytes for w in ws) + io, flops if m > 16 else 0, peer, "bf16_cublas",
                     copies=copy if m <= 16 else None)
    return setup


for _group, _shapes in (("deltanet", DELTANET), ("attention", ATTENTION), ("shared_expert", SHARED)):
    for _one in _shapes:
        case("quant", f"gemv q4_k {_group}.{_one[0]} [{_one[1]}x{_one[2]}] M=1", ("decode",))(_gemv_case((_one,), 1))
    case("quant", f"gemv q4_k {_group} layer projections M=1", ("decode",))(_gemv_case(_shapes, 1))
case("quant", "gemv q6_k deltanet.in_proj_qkvz [12288x2048] M=1", ("decode",))(_gemv_case(DELTANET[:1], 1, "Q6_K"))
# the output projection, Q6_K in a Q4_K_M file: the largest single read of a decode token (255 MB at the 80B's vocab)
case("quant", "gemv q6_k lm_head [151936x2048] M=1", ("decode",))(_gemv_case((("lm_head", 151936, 2048),), 1, "Q6_K"))
case("quant", "gemv q4_k deltanet.in_proj_qkvz [12288x2048] M=16", ("decode",))(_gemv_case(DELTANET[:1], 16))
# a 16-request decode step's projections (the tile path: 60% of that step's GPU time on the H100, session 35)
for _group, _shapes in (("deltanet", DELTANET), ("attention", ATTENTION), ("shared_expert", SHARED)):
    case("quant", f"gemv q4_k {_group} layer projections M=16", ("decode",))(_gemv_case(_shapes, 16))
case("quant", "gemv q6_k lm_head [151936x2048] M=16", ("decode",))(_gemv_case((("lm_head", 151936, 2048),), 16, "Q6_K"))
for _one in (DELTANET[0], DELTANET[2], ATTENTION[0]):
    case("quant", f"gemm q4_k {_one[0]} [{_one[1]}x{_one[2]}] M=4096", ("prefill",))(_gemv_case((_one,), 4096))


def _pair_case(device: torch.device) -> Timed:
    """A DeltaNet layer's in_proj_qkvz and in_proj_ba at one row in one GEMV launch (qlinear_pair, KTRANS_GEMV_PAIR)
    against the two launches it replaces (the peer)."""
    from ktrans.kernels.triton.quant import qlinear, qlinear_pair

    _full_size_only(device)
    wa, wb = (_packed("Q4_K", n, k, device, s) for s, (_, n, k) in enumerate(DELTANET[:2]))
    x = torch.randn(1, DELTANET[0][2], device=device, dtype=torch.bfloat16)
    return Timed(lambda: qlinear_pair(x, wa, wb), wa.nbytes + wb.nbytes + 2 * (x.numel() + wa.n + wb.n), 0,
                 lambda: (qlinear(x, wa), qlinear(x, wb)), "two_launches")


case("quant", "gemv q4_k deltanet in_proj_qkvz + in_proj_ba M=1, one launch", ("decode",))(_pair_case)


def _dense_gemv_case(setup_device: torch.device) -> Timed:
    """The router's gate as KLinearMarlin keeps it (floats, bf16 [512, 2048]) at one row: the Triton GEMV against
    cuBLAS (F.linear), which it replaces for decode rows."""
    from ktrans.kernels.triton.dense_gemv import dense_gemv

    _full_size_only(setup_device)
    w = torch.randn(E, H, device=setup_device, dtype=torch.bfloat16)
    x = torch.randn(1, H, device=setup_device, dtype=torch.bfloat16)
    return Timed(lambda: dense_gemv(x, w), w.numel() * 2 + (H + E) * 2, 0, lambda: torch.nn.functional.linear(x, w),
                 "bf16_cublas")


case("quant", "gemv bf16 router gate [512x2048] M=1", ("decode",))(_dense_gemv_case)


def _moe_case(tokens: int, down_type: str = "Q4_K", lanes: bool = False):
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton import moe_quant as mq

        def moe_quant(*args):  # lanes: the few-token path through the GEMV's lane-wise decoding (moe_quant.LANES),
            # at any of these token counts (False: the tile path, also at 1-4 tokens)
            was = dict(mq.LANES)
            mq.LANES.update(on=lanes, max_tokens=max(tokens, mq.DIRECT_MAX_TOKENS))
            try:
                return mq.moe_quant(*args)
            finally:
                mq.LANES.update(was)

        _full_size_only(device)
        gate_up, down = random_moe_layer(device, down_type)
        g = torch.Generator(device="cpu").manual_seed(tokens)
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)]).to(device)
        weights = torch.rand(tokens, TOP_K, device=device)
        x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16) * 0.1
        distinct = int(torch.unique(ids).numel())
        per_expert = (gate_up.nbytes + down.nbytes) // E
        io = tokens * H * 2 * 2 + tokens * TOP_K * (I_MOE * 2 + H * 4)

        peer = None
        if tokens <= 16:
            bf = [torch.randn(E, r, c, device=device, dtype=torch.bfloat16) * 0.01
                  for r, c in ((I_MOE, H), (I_MOE, H), (H, I_MOE))]

            def peer():  # KExpertsTorch's decode path: the k experts' matrices gathered per token, bmm
                xs = x[:, None, :].expand(tokens, TOP_K, H).reshape(-1, H, 1)
                flat = ids.reshape(-1)
                h = torch.nn.functional.silu(torch.bmm(bf[0][flat], xs)) * torch.bmm(bf[1][flat], xs)
                return (torch.bmm(bf[2][flat], h).view(tokens, TOP_K, H) * weights[:, :, None]).sum(1)

        return Timed(lambda: moe_quant(x, ids, weights, gate_up, down), distinct * per_expert + io,
                     2 * tokens * TOP_K * 3 * H * I_MOE if tokens > 16 else 0, peer, "gathered_bf16")
    return setup


for _b in (1, 16, 256):
    case("quant", f"moe q4_k layer E=512 top-10 B={_b}", ("decode",) if _b <= 16 else ("prefill",))(_moe_case(_b))
case("quant", "moe q4_k/q6_k-down layer E=512 top-10 B=1", ("decode",))(_moe_case(1, "Q6_K"))
for _b in (1, 4, 8, 16, 32, 64):
    case("quant", f"moe q4_k layer E=512 top-10 B={_b}, lanes", ("decode",))(_moe_case(_b, lanes=True))
for _b in (4, 8, 32, 64):  # the tile path where the lanes path is the default, and past it
    case("quant", f"moe q4_k layer E=512 top-10 B={_b}", ("decode",))(_moe_case(_b))
case("quant", "moe q4_k/q6_k-down layer E=512 top-10 B=1, lanes", ("decode",))(_moe_case(1, "Q6_K", lanes=True))


def _block_case(tokens: int):
    """A MoE block's decode step on the GPU, routed experts and shared expert (Q4_K, the 80B's shapes): fused
    (KTRANS_MOE_FUSED_SHARED: router and shared gate in one GEMV, one top-k launch, the shared expert as the routed
    MoE's extra pair; four launches) against the peer, the unfused block (router GEMV, top-k, the routed lanes MoE,
    the shared expert as a one-expert MoE, the gated sum with its gate's dot; seven launches)."""
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton import moe_quant as mq
        from ktrans.kernels.triton.dense_gemv import dense_gemv
        from ktrans.kernels.triton.quant_layout import concat_rows
        from ktrans.kernels.triton.router import gated_sum_dot, route, route_with_shared

        _full_size_only(device)
        if not (mq.LANES["on"] and tokens <= mq.LANES["max_tokens"]):
            raise ValueError(f"the fused block takes the lanes path's steps (<= {mq.LANES['max_tokens']} tokens)")

        gate_up, down = random_moe_layer(device)
        sh = (concat_rows([random_stack("Q4_K", 1, I_MOE, H, device, 4), random_stack("Q4_K", 1, I_MOE, H, device, 5)]),
              random_stack("Q4_K", 1, H, I_MOE, device, 6))  # one-expert stacks
        router = torch.randn(E, H, device=device, dtype=torch.bfloat16) * 0.02
        shared_gate = torch.randn(1, H, device=device, dtype=torch.bfloat16) * 0.02
        both = torch.cat([router, shared_gate])
        x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16) * 0.1
        ones = torch.ones(tokens, 1, device=device)
        zeros = torch.zeros(tokens, 1, dtype=torch.int32, device=device)
        gemv = dense_gemv if tokens <= 4 else (lambda a, w: torch.nn.functional.linear(a, w))

        def fused():
            ids, w = route_with_shared(gemv(x, both), TOP_K, True)
            return mq.moe_quant(x, ids, w, gate_up, down, extra=sh)

        def unfused():
            ids, w = route(gemv(x, router), TOP_K, True)
            routed = mq.moe_quant(x, ids, w, gate_up, down)
            return gated_sum_dot(routed, mq.moe_quant(x, zeros, ones, *sh), x, shared_gate)

        per_expert = (gate_up.nbytes + down.nbytes) // E
        return Timed(fused, (min(E, tokens * TOP_K) + 1) * per_expert + both.numel() * 2, 0, unfused, "unfused")
    return setup


for _b in (1, 16):
    case("quant", f"moe block q4_k E=512 top-10 + shared expert B={_b}, fused", ("decode",))(_block_case(_b))


def _repack_case(down_type: str, x16: bool):
    """One MoE layer's blocks (already on the GPU) repacked by the Triton kernel, as split prefill does for every
    streamed layer; x16: gate and up in the CPU experts' 16-row layout. Peer: the torch repack (row-major blocks)."""
    def setup(device: torch.device) -> Timed:
        from ktrans.kernels.triton.quant_layout import repack
        from ktrans.kernels.triton.repack import repack_blocks

        _full_size_only(device)
        mats = (("Q4_K", I_MOE, H), ("Q4_K", I_MOE, H), (down_type, H, I_MOE))
        raws = [torch.stack([random_blocks(q, r, c, device, e) for e in range(E)]) for q, r, c in mats]
        planes = [repack_blocks(raw[:1], q, (1, r, c)).nbytes * E for raw, (q, r, c) in zip(raws, mats)]

        def fn():
            for raw, (q, r, c) in zip(raws, mats):
                repack_blocks(raw, q, (E, r, c), x16=x16 and q != "Q6_K")  # the same bytes read in another order

        def peer():
            for raw, (q, r, c) in zip(raws, mats):
                repack(raw, q, (E, r, c), device)

        return Timed(fn, sum(raw.numel() for raw in raws) + sum(planes), 0, peer, "torch_repack")
    return setup


for _down in ("Q4_K", "Q6_K"):
    for _x16 in (False, True):
        case("quant", f"repack moe layer on device q4_k/{_down.lower()}-down E=512{' from x16' if _x16 else ''}",
             ("load",))(_repack_case(_down, _x16))

"""C++ CPU MoE experts (ktrans.kernels.cpu.CPUMoE) against the torch reference on gguf-py-dequantized weights.

Every weight format on every kernel path this CPU runs, awkward routings (odd token counts, repeated experts in
one token's top-k, k = 1, everything on one expert, skipped ids), thread counts, and concurrent submits.
The integer formats quantize activations to int8 (per 256 values for K-quants, per 32 for Q8_0), which is where
their error comes from; float formats multiply exactly and sum in float32.
"""
import threading

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

from ktrans import _cpu  # noqa: E402
from ktrans.kernels import cpu  # noqa: E402
from ktrans.kernels.torch.moe import moe_experts  # noqa: E402
from ktrans.weights import quants as Q  # noqa: E402

PATHS = [p for p, why in _cpu.path_status().items() if why is None]
# relative error bound ||y - ref|| / ||ref|| per format
BOUND = {"Q8_0": 0.03, "Q4_0": 0.03, "Q4_1": 0.03, "Q5_0": 0.03, "Q5_1": 0.03, "Q4_K": 0.04, "Q5_K": 0.04,
         "Q6_K": 0.04, "BF16": 1e-5, "F16": 1e-5, "F32": 1e-5}
# (hidden, intermediate): multiples of the block; the float ones leave vector tails
SIZES = {"BF16": (72, 40), "F16": (72, 40), "F32": (72, 40)}
LEGACY_SIZE = (96, 64)  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: blocks of 32
K_SIZE = (512, 256)
E = 8
_TORCH_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _matrix(qtype: str, rows: int, cols: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [E, rows, cols] weights as the kernels read them, and their float64 value (gguf-py's dequant)."""
    x = (rng.standard_normal((E, rows, cols)) * 0.1).astype(np.float32)
    if qtype in _TORCH_FLOAT:
        w = torch.from_numpy(x).to(_TORCH_FLOAT[qtype])
        return w, w.double()
    raw = Q.quantize(x, qtype)
    deq = gguf_quants.dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(raw), torch.from_numpy(deq).double()


_CACHE: dict = {}


def layer(qtypes: tuple[str, str, str]):
    """(raw gate, up, down), (float64 gate, up, down), hidden, intermediate for one set of types (cached)."""
    if qtypes not in _CACHE:
        h, i = K_SIZE if any(t.endswith("_K") for t in qtypes) else SIZES.get(qtypes[0], LEGACY_SIZE)
        rng = np.random.default_rng(len(_CACHE))
        mats = [_matrix(t, r, c, rng) for t, (r, c) in zip(qtypes, [(i, h), (i, h), (h, i)])]
        _CACHE[qtypes] = tuple(m[0] for m in mats), tuple(m[1] for m in mats), h, i
    return _CACHE[qtypes]


def make_moe(qtypes, pool, isa="auto"):
    raw, _, h, i = layer(qtypes)
    return cpu.CPUMoE(*raw, n_experts=E, hidden=h, intermediate=i, types=qtypes, pool=pool, isa=isa)


def reference(qtypes, x, ids, w):
    _, deq, _, _ = layer(qtypes)
    return moe_experts(x.double(), ids, w.double(), *deq)


def rel_err(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def routing(t: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return ids.long(), torch.rand(t, k, generator=gen)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", list(BOUND))
def test_formats_match_reference(qtype, path, pool):
    qtypes = (qtype,) * 3
    moe = make_moe(qtypes, pool, isa=path)
    assert moe.path == path
    gen = torch.Generator().manual_seed(1)
    # up to 256 (token, expert) pairs the down projection runs per expert, above that per block of output rows
    for t, k in [(1, 3), (7, 3), (33, 2), (131, 2)]:
        x = torch.randn(t, moe.hidden, generator=gen)
        ids, w = routing(t, k, gen)
        err = rel_err(moe(x, ids, w), reference(qtypes, x, ids, w))
        assert err < BOUND[qtype], f"{qtype} on {path}, T={t}: relative error {err:.2e}"


@pytest.mark.parametrize("path", PATHS)
def test_mixed_types_like_q4_k_m(path, pool):
    """Q4_K_M files keep gate/up at Q4_K and down at Q6_K (or Q5_K): per-matrix types."""
    for qtypes in [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q4_K", "Q8_0")]:
        moe = make_moe(qtypes, pool, isa=path)
        gen = torch.Generator().manual_seed(2)
        x = torch.randn(5, moe.hidden, generator=gen)
        ids, w = routing(5, 3, gen)
        assert rel_err(moe(x, ids, w), reference(qtypes, x, ids, w)) < 0.04


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "BF16"])
def test_awkward_routings(qtype, path, pool):
    qtypes = (qtype,) * 3
    moe = make_moe(qtypes, pool, isa=path)
    gen = torch.Generator().manual_seed(3)
    h = moe.hidden
    cases = {
        "repeated expert in one token": (torch.tensor([[2, 2, 5], [1, 1, 1], [0, 7, 0]]), torch.rand(3, 3)),
        "k = 1": (torch.randint(0, E, (9, 1), generator=gen), torch.rand(9, 1, generator=gen)),
        "all tokens on one expert": (torch.full((37, 2), 3), torch.rand(37, 2, generator=gen)),
        "negative ids are skipped": (torch.tensor([[4, -1], [-1, -1], [6, 2]]), torch.rand(3, 2, generator=gen)),
    }
    for name, (ids, w) in cases.items():
        x = torch.randn(ids.shape[0], h, generator=gen)
        y = moe(x, ids, w)
        ref = reference(qtypes, x, ids, w)
        if name == "negative ids are skipped":
            assert torch.all(y[1] == 0)
            ids, ref = ids[[0, 2]], ref[[0, 2]]
            y = y[[0, 2]]
        assert rel_err(y, ref) < BOUND[qtype], f"{name} ({qtype}, {path})"


@pytest.mark.parametrize("path", PATHS)
def test_unrouted_tokens_of_a_long_step(path, pool):
    # A share of the experts (split prefill's CPU part) routes only some of a step's tokens here; those rows alone
    # are quantized, in runs that cross the 8-row quantization tasks. The others come out zero, and the routed ones
    # equal the same tokens computed without the unrouted rows (the same pairs per expert, in the same order).
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    moe = make_moe(qtypes, pool, isa=path)
    gen = torch.Generator().manual_seed(4)
    t = 45
    ids, w = routing(t, 3, gen)
    unrouted = torch.tensor([0, 1, 2, 7, 8, 9, 15, 16, 30, 31, 32, 33, 34, 35, 36, 44])
    ids[unrouted] = -1
    ids[5, 1] = -1  # a token with some slots elsewhere keeps the rest
    x = torch.randn(t, moe.hidden, generator=gen)
    y = moe(x, ids, w)
    assert torch.all(y[unrouted] == 0)
    keep = torch.ones(t, dtype=torch.bool)
    keep[unrouted] = False
    assert torch.equal(y[keep], moe(x[keep], ids[keep], w[keep]))


def test_empty_batch_and_bad_input(pool):
    moe = make_moe(("Q8_0",) * 3, pool)
    out = moe(torch.zeros(0, moe.hidden), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, moe.hidden)
    x = torch.randn(2, moe.hidden)
    with pytest.raises(ValueError, match="outside"):
        moe(x, torch.tensor([[0, E]]).expand(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="activations"):
        moe(torch.randn(2, moe.hidden + 1), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    raw, _, h, i = layer(("Q8_0",) * 3)
    with pytest.raises(ValueError, match="bytes"):
        cpu.CPUMoE(raw[0][:-1], raw[1], raw[2], n_experts=E, hidden=h, intermediate=i, types=("Q8_0",) * 3)
    with pytest.raises(ValueError, match="do not read"):
        cpu.CPUMoE(*raw, n_experts=E, hidden=h, intermediate=i, types=("Q3_K",) * 3)


@pytest.mark.parametrize("qtype", ["Q4_K", "BF16"])
def test_thread_counts_agree_bitwise(qtype):
    qtypes = (qtype,) * 3
    gen = torch.Generator().manual_seed(4)
    for t in (19, 100):  # 57 and 300 (token, expert) pairs: down per expert, then per block of output rows
        outs = []
        for n in (1, 2, 3, 4):
            moe = make_moe(qtypes, cpu.make_pool(n, pin=False))
            x = torch.randn(t, moe.hidden, generator=torch.Generator().manual_seed(5))
            ids, w = routing(t, 3, torch.Generator().manual_seed(6))
            outs.append(moe(x, ids, w))
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), f"T={t}"
    del gen


def test_concurrent_submits_do_not_corrupt(pool):
    """Two layers in flight at once (submit, submit, then wait), and submits from two Python threads."""
    a, b = make_moe(("Q4_K",) * 3, pool), make_moe(("Q8_0",) * 3, pool)
    gen = torch.Generator().manual_seed(7)
    xa, xb = torch.randn(6, a.hidden, generator=gen), torch.randn(6, b.hidden, generator=gen)
    ra, rb = routing(6, 3, gen), routing(6, 3, gen)
    want_a, want_b = a(xa, *ra), b(xb, *rb)
    for _ in range(5):
        pa, pb = a.submit(xa, *ra), b.submit(xb, *rb)
        assert torch.equal(pb.wait(), want_b) and torch.equal(pa.wait(), want_a)
    results = {}

    def run(name, moe, x, r):
        results[name] = [moe.submit(x, *r) for _ in range(10)]

    threads = [threading.Thread(target=run, args=("a", a, xa, ra)), threading.Thread(target=run, args=("b", b, xb, rb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(p.wait(), want_a) for p in results["a"])
    assert all(torch.equal(p.wait(), want_b) for p in results["b"])
    assert torch.equal(a.sync(), want_a)


def test_submit_returns_before_the_work_is_done(pool):
    """The async API: submit hands back a Pending at once; the inputs may be dropped meanwhile."""
    moe = make_moe(("Q4_K",) * 3, pool)
    x = torch.randn(64, moe.hidden)
    ids, w = routing(64, 4, torch.Generator().manual_seed(8))
    want = moe(x, ids, w)
    pending = moe.submit(x.clone(), ids.clone(), w.clone())  # the clones live only in the Pending
    assert torch.equal(pending.wait(), want)
    assert pending.done()


def test_jobs_in_flight_complete_in_order_under_stress():
    """Several jobs in flight on more threads than cores: a job's finisher may be descheduled while the others run
    the next job to its end; completions must still go in order (this once left wait() blocked forever)."""
    import time

    pool = cpu.make_pool(4, pin=False, spin_us=0)
    lin = cpu.CPULinear(torch.randn(16, 256), 16, 256, pool=pool)
    x = torch.randn(1, 256)
    want = lin(x)
    state = {"iters": 0, "ok": True}

    def loop():
        t0 = time.time()
        while time.time() - t0 < 4.0:
            ps = [lin.submit(x) for _ in range(4)]
            out = ps[-1].wait()
            state["ok"] &= all(p.done() for p in ps) and torch.equal(out, want)
            state["iters"] += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"wait() blocked after {state['iters']} rounds of 4 jobs"
    assert state["ok"] and state["iters"] > 100


def test_more_jobs_in_flight_than_ring_slots():
    """Workers pick jobs from a ring of 64 slots; a submit whose slot is still taken waits for the workers, so 300
    jobs in flight at once all run, in order, with their own inputs."""
    pool = cpu.make_pool(3, pin=False)
    lin = cpu.CPULinear(torch.randn(24, 64), 24, 64, pool=pool)
    xs = [torch.randn(2, 64, generator=torch.Generator().manual_seed(i)) for i in range(300)]
    want = [lin(x) for x in xs]
    pending = [lin.submit(x) for x in xs]
    outs = [p.wait() for p in reversed(pending)][::-1]
    assert all(torch.equal(o, w) for o, w in zip(outs, want))


def test_hugepage_copy_gives_the_same_results(pool, monkeypatch):
    """Matrices of 4 MiB and more are copied into 2 MiB-aligned memory advised into transparent huge pages; the
    kernels read the same bytes there, so the output is bitwise the one read in place."""
    gen = torch.Generator().manual_seed(9)
    e, h, i = 64, 256, 512  # Q8_0: 64 x 512 x 272 bytes = 8.9 MB per matrix
    mats = [torch.randint(0, 256, (e * r * cpu.row_bytes("Q8_0", c),), dtype=torch.uint8, generator=gen)
            for r, c in ((i, h), (i, h), (h, i))]
    for m in mats:  # small finite fp16 scales at the start of each 34-byte block
        m.view(-1, 34)[:, :2] = torch.full((m.numel() // 34,), 0.004).half().view(torch.uint8).view(-1, 2)
    kw = dict(n_experts=e, hidden=h, intermediate=i, types=("Q8_0",) * 3, pool=pool)
    in_place = cpu.CPUMoE(*mats, hugepages=False, **kw)
    copied = cpu.CPUMoE(*mats, **kw)
    assert not in_place.hugepages and all(w.data_ptr() == m.data_ptr() for w, m in zip(in_place.weights, mats))
    for w, m in zip(copied.weights, mats):
        assert w.data_ptr() % (1 << 21) == 0 and w.data_ptr() != m.data_ptr() and torch.equal(w, m)
    x = torch.randn(5, h, generator=gen)
    ids, w = routing(5, 4, gen)
    ids = ids % e
    assert torch.equal(copied(x, ids, w), in_place(x, ids, w))
    monkeypatch.setattr(cpu, "thp_mode", lambda: "never")  # THP off: no copy, no memory spent on one
    kept = cpu.CPUMoE(*mats, **kw)
    assert not kept.hugepages and all(w.data_ptr() == m.data_ptr() for w, m in zip(kept.weights, mats))


def test_out_must_not_alias_x_and_a_dropped_pending_waits(pool):
    moe = make_moe(("Q8_0",) * 3, pool)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, moe.hidden, generator=gen)
    ids, w = routing(6, 3, gen)
    with pytest.raises(ValueError, match="share memory with x"):
        moe.submit(x, ids, w, out=x)
    want = moe(x, ids, w)
    moe.submit(x.clone(), ids.clone(), w.clone())  # dropped at once: its finalizer waits before the clones go
    moe._last = None
    import gc

    gc.collect()
    assert torch.equal(moe(x, ids, w), want)


def test_forward_takes_other_dtypes_and_layouts_through_the_checked_path(pool):
    """forward's flat check takes the model's own tensors as they are; anything else goes through the general
    path, which converts (or refuses with the same errors), with the same result."""
    moe = make_moe(("Q8_0",) * 3, pool)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, moe.hidden, generator=gen)
    ids, w = routing(7, 3, gen)
    want = moe(x, ids, w)
    wide = torch.randn(moe.hidden, 7, generator=gen)
    wide.copy_(x.t())
    for args in [(x.double(), ids.int(), w.double()), (wide.t(), ids, w), (x.requires_grad_(), ids, w)]:
        assert torch.equal(moe(*args), want)
    with pytest.raises(ValueError, match="activations"):
        moe(torch.randn(7, moe.hidden + 1), ids, w)
    with pytest.raises(ValueError, match="topk_ids"):
        moe(x.detach(), ids[:5], w[:5])


def test_hugepage_copy_of_a_non_contiguous_view(pool):
    """Half of a fused gate_up tensor (a non-contiguous view) lands in huge pages in one copy, values intact."""
    gen = torch.Generator().manual_seed(12)
    e, h, i = 16, 256, 256  # float32: 4 MiB per matrix
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * 0.02
    down = torch.randn(e, h, i, generator=gen) * 0.02
    kw = dict(n_experts=e, hidden=h, intermediate=i, pool=pool)
    copied = cpu.CPUMoE(gate_up[:, :i], gate_up[:, i:], down, **kw)
    in_place = cpu.CPUMoE(gate_up[:, :i], gate_up[:, i:], down, hugepages=False, **kw)
    if cpu.thp_mode() in ("always", "madvise"):
        assert all(w.data_ptr() % (1 << 21) == 0 for w in copied.weights)
    for a, b in zip(copied.weights, in_place.weights):
        assert torch.equal(a.view(torch.uint8).reshape(-1), b.reshape(-1).view(torch.uint8))
    x = torch.randn(3, h, generator=gen)
    ids, w = routing(3, 2, gen)
    assert torch.equal(copied(x, ids, w), in_place(x, ids, w))

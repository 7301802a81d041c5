"""One tuning config per CPUMoE (ktrans.kernels.cpu.CPUMoEConfig, csrc/cpu/config.h): two layers in one process run
with different settings and both match the torch reference; the KTRANS_* variables only give the defaults, read when
a config is made; bad values are refused naming the field."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from ktrans import _cpu
from ktrans.kernels import cpu

from .test_cpu_moe import BOUND, E, layer, reference, rel_err, routing

CFG = cpu.CPUMoEConfig
# Two settings as far apart as the ranges allow. A: one task per thread for gate/up and down, rows of 16 per down
# task, the tiles from one activation row on (AMX emulated where there are AVX-512 tiles), every prefetch at its
# shortest with the non-temporal hint and no stop; B: many small tasks, the tiles off, long prefetches into L2.
SMALL = dict(gate_up_tasks=1, down_tasks=1, down_expert_rows=16, prefetch_bytes=64, prefetch_hint="nta",
             x16_prefetch_bytes=64, tile_min_tokens=1, x16_tile_from=1, amx=2, prefetch_clamp=False)
LARGE = dict(gate_up_tasks=16, down_tasks=8, down_expert_rows=512, prefetch_bytes=1 << 20, prefetch_hint="t1",
             x16_prefetch_bytes=8192, tile_min_tokens=cpu.TILES_OFF, x16_tile_from=1000, amx=0)
# The KTRANS_* tuning variables; a test that sets them starts from none
ENV = ("KTRANS_GU_TASKS", "KTRANS_DN_TASKS", "KTRANS_DN_ROWS", "KTRANS_PREFETCH_BYTES", "KTRANS_PREFETCH_HINT",
       "KTRANS_X16_PREFETCH_BYTES", "KTRANS_TILE_MIN_TOKENS", "KTRANS_X16_TILE_FROM", "KTRANS_AMX")


def pair(qtypes, pool, **kw):
    """Two CPUMoEs on the same weights, with the SMALL and the LARGE config."""
    raw, _, h, i = layer(qtypes)
    return [cpu.CPUMoE(*raw, n_experts=E, hidden=h, intermediate=i, types=qtypes, pool=pool, config=CFG(**c), **kw)
            for c in (SMALL, LARGE)]


@pytest.mark.parametrize("qtype,repack", [("Q4_K", True), ("Q4_K", False), ("Q8_0", True), ("F32", True)])
def test_two_configs_in_one_process_match_the_reference(qtype, repack, pool):
    qtypes = (qtype,) * 3
    a, b = pair(qtypes, pool, repack=repack)
    assert a.config == CFG(**SMALL) and b.config == CFG(**LARGE)
    for moe in (a, b):  # the C++ side holds the same
        assert CFG.from_native(moe._moe.config) == moe.config
    gen = torch.Generator().manual_seed(11)
    # odd token counts and top-k: decode-sized (down per expert) up to prefill-sized (down by rows, > 256 pairs)
    for t, k in [(1, 3), (3, 5), (7, 1), (37, 3), (131, 3)]:
        x = torch.randn(t, a.hidden, generator=gen)
        ids, w = routing(t, k, gen)
        ref = reference(qtypes, x, ids, w)
        pa, pb = a.submit(x, ids, w), b.submit(x, ids, w)  # both in flight at once, each with its own config
        ya, yb = pa.wait(), pb.wait()
        for name, y in (("small", ya), ("large", yb)):
            err = rel_err(y, ref)
            assert err < BOUND[qtype], f"{qtype}, {name} config, T={t}, k={k}: relative error {err:.2e}"
        assert torch.equal(a(x, ids, w), ya) and torch.equal(b(x, ids, w), yb)  # and each reproduces itself


def test_the_work_split_is_the_layers_own(pool):
    """The pool's trace counts the tasks of a job: SMALL's and LARGE's split differ, job after job, interleaved."""
    a, b = pair(("Q8_0",) * 3, pool)
    x = torch.randn(1, a.hidden)
    ids, w = torch.tensor([[0, 2, 5, 7]]), torch.rand(1, 4)

    def tasks(moe):
        pool.set_trace(True)
        try:
            moe(x, ids, w)
            return sum(r[2] for r in pool.last_trace())
        finally:
            pool.set_trace(False)

    counts = [tasks(m) for m in (a, b, a, b)]
    assert counts[0] == counts[2] < counts[1] == counts[3], counts
    b.set_config(a.config)  # the same split now
    assert tasks(b) == counts[0] and tasks(a) == counts[0]


def test_tiles_per_layer(pool):
    """Q4_K blocks as they are: with the tiles from one activation row on, A sums in the tiles' order; B, tiles off,
    in the row kernels'. Both are near the reference and differ from each other (where tiles exist), interleaved."""
    qtypes = ("Q4_K",) * 3
    a, b = pair(qtypes, pool, repack=False)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(41, a.hidden, generator=gen)
    ids, w = routing(41, 3, gen)  # ~15 tokens per expert: past the AVX2 tiles' 8 too
    ya, yb = a(x, ids, w), b(x, ids, w)
    ref = reference(qtypes, x, ids, w)
    assert rel_err(ya, ref) < BOUND["Q4_K"] and rel_err(yb, ref) < BOUND["Q4_K"]
    if a.path != "scalar":
        assert not torch.equal(ya, yb), "the tiles did not run in one layer, or ran in both"
    assert torch.equal(b(x, ids, w), yb) and torch.equal(a(x, ids, w), ya)
    b.set_config(a.config)
    assert torch.equal(b(x, ids, w), ya)


def test_a_submitted_job_keeps_its_config(pool):
    a, _ = pair(("Q8_0",) * 3, pool)
    x = torch.randn(5, a.hidden)
    ids, w = routing(5, 3, torch.Generator().manual_seed(13))
    want = a(x, ids, w)
    pending = a.submit(x, ids, w)
    a.set_config(CFG(**LARGE))
    assert torch.equal(pending.wait(), want)
    assert a.config == CFG(**LARGE) and CFG.from_native(a._moe.config) == CFG(**LARGE)


def test_env_vars_only_change_the_defaults(monkeypatch, pool):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    before = cpu.CPUMoEConfig()
    raw, _, h, i = layer(("Q8_0",) * 3)
    kw = dict(n_experts=E, hidden=h, intermediate=i, types=("Q8_0",) * 3, pool=pool)
    old = cpu.CPUMoE(*raw, **kw)
    monkeypatch.setenv("KTRANS_GU_TASKS", "7")
    monkeypatch.setenv("KTRANS_DN_ROWS", "8")            # clamped to 16, as the environment always was
    monkeypatch.setenv("KTRANS_PREFETCH_BYTES", "1000")  # rounded down to a multiple of 64
    monkeypatch.setenv("KTRANS_PREFETCH_HINT", "nta")
    monkeypatch.setenv("KTRANS_AMX", "0")
    env = cpu.CPUMoEConfig()
    assert env == before.replace(gate_up_tasks=7, down_expert_rows=16, prefetch_bytes=960, prefetch_hint="nta", amx=0)
    assert cpu.CPUMoE(*raw, **kw).config == env  # made now: the defaults of now
    assert old.config == before and CFG.from_native(old._moe.config) == before  # made before: unchanged
    given = cpu.CPUMoE(*raw, config=CFG(gate_up_tasks=3), **kw).config  # a field given is not the environment's
    assert given.gate_up_tasks == 3 and given.prefetch_hint == "nta"
    assert CFG.from_native(_cpu.MoE(pool, E, h, i, *(v for r in raw for v in (r.data_ptr(), 8))).config) == env


_ENV_PROBE = '''
import dataclasses, json
from ktrans.kernels import cpu
print(json.dumps([dataclasses.asdict(cpu.CPUMoEConfig()), dataclasses.asdict(cpu.CPUMoEConfig(tile_min_tokens=9))]))
'''


def test_env_vars_in_a_fresh_process():
    """The same in a process that starts with the variables set (and, for the built-in defaults, with none)."""
    import json

    base = {k: v for k, v in os.environ.items() if k not in ENV}

    def probe(env):
        out = subprocess.run([sys.executable, "-c", _ENV_PROBE], env={**base, **env}, check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out)

    plain, given = probe({})
    x16 = 1024 if plain["x16_prefetch_bytes"] == 1024 else 4096  # 1 KiB on AMD CPUs
    assert plain == dict(gate_up_tasks=4, down_tasks=2, down_expert_rows=256, prefetch_bytes=4096, prefetch_hint="t0",
                         x16_prefetch_bytes=x16, tile_min_tokens=3, x16_tile_from=24, amx=1, prefetch_clamp=True)
    assert given == {**plain, "tile_min_tokens": 9}
    env, given = probe({"KTRANS_TILE_MIN_TOKENS": "5", "KTRANS_DN_TASKS": "3", "KTRANS_X16_TILE_FROM": "40",
                        "KTRANS_X16_PREFETCH_BYTES": "2048"})
    assert env == {**plain, "tile_min_tokens": 5, "down_tasks": 3, "x16_tile_from": 40, "x16_prefetch_bytes": 2048}
    assert given == {**env, "tile_min_tokens": 9}


@pytest.mark.parametrize("field,value", [
    ("gate_up_tasks", 0), ("gate_up_tasks", "4"), ("gate_up_tasks", 4.0), ("gate_up_tasks", True),
    ("down_tasks", -1), ("down_expert_rows", 15), ("prefetch_bytes", 0), ("prefetch_bytes", 100),
    ("prefetch_bytes", (1 << 20) + 64), ("prefetch_bytes", 1 << 40), ("prefetch_hint", "t2"), ("prefetch_hint", 1),
    ("x16_prefetch_bytes", 32), ("tile_min_tokens", 0), ("x16_tile_from", -5), ("amx", 3), ("amx", -1),
    ("prefetch_clamp", 1), ("prefetch_clamp", "yes"),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^CPUMoEConfig\.{field}: must be"):
        CFG(**{field: value})
    with pytest.raises(ValueError, match=rf"^CPUMoEConfig\.{field}: must be"):
        CFG(**SMALL).replace(**{field: value})


def test_unknown_fields_and_other_config_types_are_refused(pool):
    with pytest.raises(ValueError, match="unknown CPUMoEConfig field 'gate_up_task'"):
        CFG.from_dict({"gate_up_tasks": 2, "gate_up_task": 2})
    assert CFG.from_dict({"down_tasks": 3, "prefetch_hint": "t1"}) == CFG(down_tasks=3, prefetch_hint="t1")
    raw, _, h, i = layer(("Q8_0",) * 3)
    with pytest.raises(TypeError, match="CPUMoEConfig"):
        cpu.CPUMoE(*raw, n_experts=E, hidden=h, intermediate=i, types=("Q8_0",) * 3, pool=pool, config={"amx": 0})
    ptrs = [v for r in raw for v in (r.data_ptr(), 8)]
    with pytest.raises(ValueError, match="unknown config field 'tiles'"):  # the extension checks too
        _cpu.MoE(pool, E, h, i, *ptrs, config={"tiles": 1})
    with pytest.raises(ValueError, match="down_expert_rows: must be at least 16"):
        _cpu.MoE(pool, E, h, i, *ptrs, config={"down_expert_rows": 1})
    with pytest.raises(ValueError, match="amx"):
        _cpu.Linear(pool, 16, 32, raw[0].data_ptr(), 8, config={"amx": 7})
    a, _ = pair(("Q8_0",) * 3, pool)
    with pytest.raises(ValueError, match="gate_up_tasks: must be at least 1"):
        a._moe.set_config({"gate_up_tasks": 0})
    assert CFG.from_native(a._moe.config) == a.config == CFG(**SMALL)  # a refused config leaves the last one
    assert set(_cpu.moe_config()) == {f.name for f in dataclasses.fields(CFG)}

"""Where the CPU pool pins its workers (csrc/cpu/pool.cpp): every CPU the process may use but the caller's first,
the caller's SMT siblings last, so that with a CPU to spare no polling worker shares the caller's core."""
from __future__ import annotations

import os

from ktrans import _cpu


def test_pin_order_puts_the_callers_siblings_last():
    assert _cpu.pin_order([0, 1, 2, 3, 4, 5, 6, 7], [0, 4]) == [0, 1, 2, 3, 5, 6, 7, 4]  # siblings i and i + 4
    assert _cpu.pin_order([0, 8, 1, 9], [0, 8]) == [0, 1, 9, 8]  # siblings i and i + 8, allowed CPUs in any order
    assert _cpu.pin_order([3, 5, 7], [3]) == [3, 5, 7]  # no SMT: unchanged
    assert _cpu.pin_order([], [0]) == []


def test_a_pinned_pool_leaves_the_first_cpu_to_the_caller():
    cpus = sorted(os.sched_getaffinity(0))
    pool = _cpu.ThreadPool(len(cpus), True, 0)
    if not pool.pinned:  # fewer CPUs than threads: nothing pinned
        assert pool.worker_cpus == []
        return
    assert len(pool.worker_cpus) == len(cpus) - 1 and cpus[0] not in pool.worker_cpus
    assert set(pool.worker_cpus) <= set(cpus[1:])
    assert _cpu.ThreadPool(len(cpus), False, 0).worker_cpus == []


def test_core_siblings_include_the_cpu_itself():
    from ktrans.kernels import cpu

    first = sorted(os.sched_getaffinity(0))[0]
    siblings = cpu.core_siblings(first)
    assert first in siblings and len(siblings) == len(set(siblings)) >= 1

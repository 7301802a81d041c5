"""release_file_pages: a copied GGUF tensor's file pages leave the process (RSS falls by them) and read back the same
bytes from the file; anonymous memory is never touched (MADV_DONTNEED would zero it)."""
import mmap
import warnings

import torch

from ktrans.kernels.host_memory import host_rss, release_file_pages


def _mapped(tmp_path, n: int):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.numpy().tobytes())
    f = open(path, "rb")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # a read-only buffer: torch warns that writes would be undefined
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=torch.uint8)
    return data, t, (f, buf)


def test_file_pages_are_released_and_read_back(tmp_path):
    n = 64 << 20
    data, t, keep = _mapped(tmp_path, n)
    assert int(t.sum()) == int(data.sum())  # every page resident now
    before = host_rss()[0]
    copy = t.clone()
    assert release_file_pages(t) == n
    after = host_rss()[0]
    if before is not None:  # the copy added n, the release took about n away
        assert after - before < n // 2, (before, after)
    assert torch.equal(t, data) and torch.equal(copy, data)  # faulted back in from the file
    del t, copy
    keep[1].close()
    keep[0].close()


def test_anonymous_memory_is_left_alone():
    t = torch.arange(8 << 20, dtype=torch.int32)
    want = t.clone()
    assert release_file_pages(t) == 0
    assert torch.equal(t, want)
    assert release_file_pages(torch.zeros(1000)) == 0  # small tensors are not worth a walk of the maps


def test_numa_nodes_from_sysfs(tmp_path):
    """`ktrans doctor`'s NUMA nodes: each node's CPUs (those this process may use) and memory, from a sysfs tree;
    none where the tree has no node directory."""
    import os

    from ktrans.kernels.host_memory import _cpulist, numa_nodes

    assert _cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and _cpulist("") == set()
    allowed = sorted(os.sched_getaffinity(0))
    for node, cpus in ((0, f"{allowed[0]}"), (10, "100000-100003")):
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       16777216 kB\nNode {node} MemFree: 1 kB\n")
    (tmp_path / "node2").mkdir()  # no files: skipped
    assert numa_nodes(str(tmp_path)) == [{"node": 0, "cpus": [allowed[0]], "memory_gib": 16.0},
                                         {"node": 10, "cpus": [], "memory_gib": 16.0}]
    assert numa_nodes(str(tmp_path / "absent")) == []

"""The floors of doc/architecture.md hold: import-linter's layers contract in pyproject.toml passes."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is a test dependency: pip install -e '.[test]'")
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "floors KEPT" in out.stdout


def test_no_import_cycles():
    """No module reaches itself through imports, lazy (in-function) imports included: a circle hides which of two
    modules is the lower one. Packages' __init__ re-exports are left out (they only gather their own modules)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("ktrans")
    modules = sorted(m for m in graph.modules if not graph.find_children(m))
    cycles = []
    for m in modules:
        for n in sorted(graph.find_modules_directly_imported_by(m)):
            if n == m or graph.find_children(n) or not n.startswith("ktrans."):
                continue
            back = graph.find_shortest_chain(importer=n, imported=m)
            if back is not None and all(not graph.find_children(x) for x in back):
                cycle = (m, *back)
                if min(cycle) == m:  # report each circle once, from its smallest module
                    cycles.append(" -> ".join(cycle))
    assert not cycles, "import circles:\n" + "\n".join(cycles)

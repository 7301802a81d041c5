"""The attention family's bench cases build and run (on the CPU: Triton interpreted at smoke sizes; the
timings mean nothing there), and count the bytes their docstring says."""
import pytest

from ktrans.bench import kernels

pytest.importorskip("triton")
pytestmark = pytest.mark.triton


def test_attention_cases_run_and_count_kv_bytes(triton_device):
    from ktrans.bench import kernels_attention as ka

    names = {c.name for c in kernels.CASES if c.family == "attention"}
    assert {"decode 32k B=1", "decode 32k B=16", "prefill T=4096", "rmsnorm+residual T=4096",
            "rope q+k T=1", "router top-10/512 T=16"} <= names
    c = ka.real_config()
    t = ka.decode_32k_b1(triton_device)
    kv_len = 32768 if triton_device.type == "cuda" else 200
    assert t.bytes == 2 * kv_len * c.num_key_value_heads * c.head_dim * (2 if triton_device.type == "cuda" else 4)
    t.fn()
    rows = kernels.run(["attention"], "rope q+k T=4096", reps=2, as_json=True, device=str(triton_device))
    assert [r["case"] for r in rows if "case" in r] == ["rope q+k T=4096"] and "error" not in rows[-1]

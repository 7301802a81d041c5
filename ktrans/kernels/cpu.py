"""Loader for the C++ extension ktrans._cpu and a readable report of which ISA path it will use."""
from __future__ import annotations

from ktrans import _cpu  # noqa: F401  (ImportError here means the package was installed without its build)


def isa_info() -> dict[str, bool]:
    return dict(_cpu.isa_info())


def best_path(info: dict[str, bool] | None = None) -> tuple[str, str]:
    """The kernel path the dispatcher picks, and why."""
    i = info or isa_info()
    if i["amx_int8"] and i["amx_bf16"]:
        return "amx", "AMX tiles (int8/bf16) for prefill-sized batches, AVX-512 VNNI for decode"
    if i["avx512bw"] and i["avx512vl"]:
        extra = " with VNNI" if i["avx512vnni"] else ""
        why = "AVX-512" + extra + (" (AMX present but the kernel denied tile permission)" if i["amx_denied"] else "")
        return "avx512", why
    if i["avx2"]:
        return "avx2", "AVX2 + FMA (no AVX-512 on this CPU)"
    return "scalar", "portable C++ (no AVX2/FMA on this CPU)"


def isa_report() -> dict:
    info = isa_info()
    path, why = best_path(info)
    return {"path": path, "why": why, "features": info}

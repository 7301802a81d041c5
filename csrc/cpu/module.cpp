// Python bindings of ktrans._cpu. Kernels take raw pointers and sizes, never torch tensors, so the module
// does not depend on torch's C++ ABI; ktrans/kernels/cpu.py turns tensors into pointers.
#include <pybind11/pybind11.h>

#include "isa.h"

namespace py = pybind11;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "ktrans CPU kernels";
  m.def("isa_info", [] {
    const auto& i = ktrans::isa();
    py::dict d;
    d["avx2"] = i.avx2;
    d["avx512f"] = i.avx512f;
    d["avx512bw"] = i.avx512bw;
    d["avx512vl"] = i.avx512vl;
    d["avx512vnni"] = i.avx512vnni;
    d["avx512bf16"] = i.avx512bf16;
    d["amx_tile"] = i.amx_tile;
    d["amx_int8"] = i.amx_int8;
    d["amx_bf16"] = i.amx_bf16;
    d["amx_denied"] = i.amx_denied;
    return d;
  }, "Features of this CPU that the OS enables, as the kernels' dispatcher sees them.");
}

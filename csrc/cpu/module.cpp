// Python bindings of ktrans._cpu. Kernels take raw pointers (Python ints) and sizes, never torch tensors, so the
// module does not depend on torch's C++ ABI; ktrans/kernels/cpu.py turns tensors into pointers and keeps them
// alive until the job that reads them is waited for. Every call that computes or blocks releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>

#include <chrono>
#include <memory>
#include <vector>
#include <stdexcept>
#include <string>

#include "isa.h"
#include "layers.h"
#include "tiles.h"
#include "moe.h"
#include "pool.h"
#include "quant.h"
#include "row_ops.h"
#include "stream.h"

namespace py = pybind11;
using namespace ktrans;

namespace {

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

// A MoE layer bound to the pool that runs it.
struct PyMoE {
  std::shared_ptr<ThreadPool> pool;
  MoE moe;
};

struct PyLinear {
  std::shared_ptr<ThreadPool> pool;
  Linear lin;
};

// MoEConfig <-> dict {field: int, prefetch_clamp: bool}, the form Python's CPUMoEConfig (ktrans/kernels/cpu.py)
// passes; prefetch_hint is 0 (t0), 1 (t1) or 2 (nta) here.
constexpr std::pair<const char*, int MoEConfig::*> kIntFields[] = {
    {"gate_up_tasks", &MoEConfig::gate_up_tasks},
    {"down_tasks", &MoEConfig::down_tasks},
    {"down_expert_rows", &MoEConfig::down_expert_rows},
    {"prefetch_bytes", &MoEConfig::prefetch_bytes},
    {"prefetch_hint", &MoEConfig::prefetch_hint},
    {"x16_prefetch_bytes", &MoEConfig::x16_prefetch_bytes},
    {"tile_min_tokens", &MoEConfig::tile_min_tokens},
    {"x16_tile_from", &MoEConfig::x16_tile_from},
    {"amx", &MoEConfig::amx},
};

py::dict config_dict(const MoEConfig& c) {
  py::dict d;
  for (const auto& f : kIntFields) d[f.first] = c.*f.second;
  d["prefetch_clamp"] = c.prefetch_clamp;
  return d;
}

// MoEConfig::defaults() with the fields in `d` replaced, checked (std::invalid_argument, i.e. ValueError, naming the
// field: out of range, not an integer, or not a field at all).
MoEConfig config_from(const py::dict& d) {
  MoEConfig c = MoEConfig::defaults();
  for (const auto& item : d) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (key == "prefetch_clamp") {
      if (!py::isinstance<py::bool_>(v))
        throw std::invalid_argument("prefetch_clamp: must be a bool, got " + std::string(py::repr(v)));
      c.prefetch_clamp = v.cast<bool>();
      continue;
    }
    int MoEConfig::*field = nullptr;
    for (const auto& f : kIntFields)
      if (key == f.first) field = f.second;
    if (!field) {
      std::string known;
      for (const auto& f : kIntFields) known += std::string(f.first) + ", ";
      throw std::invalid_argument("unknown config field '" + key + "' (known: " + known + "prefetch_clamp)");
    }
    if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
      throw std::invalid_argument(key + ": must be an integer, got " + std::string(py::repr(v)));
    const long long x = v.cast<long long>();
    if (x < INT32_MIN || x > INT32_MAX)
      throw std::invalid_argument(key + ": must be a 32-bit integer, got " + std::to_string(x));
    c.*field = static_cast<int>(x);
  }
  c.check();
  return c;
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "ktrans CPU kernels: quantized MoE experts and linear on raw GGUF blocks, a thread pool, ISA dispatch";
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

  m.def("path_status", [] {
    py::dict d;
    for (Isa i : {Isa::avx512, Isa::avx2, Isa::scalar}) {
      const char* why = nullptr;
      const bool ok = isa_available(i, &why);
      d[isa_name(i)] = ok ? py::none() : py::cast(std::string(why));
    }
    return d;
  }, "For each kernel path: None when this CPU runs it, else the reason it cannot.");

  m.def("select_path", [](const std::string& name) { return std::string(select_kernels(name.c_str()).name); },
        py::arg("name") = "auto",
        "The kernel path that `name` resolves to (auto honours KTRANS_CPU_ISA). ValueError if it cannot run here.");

  m.def("type_row_bytes", [](int type, int64_t k) {
    if (!type_supported(type)) throw std::invalid_argument("unsupported ggml type " + std::to_string(type));
    if (k % type_block_size(type)) throw std::invalid_argument("row length is not a multiple of the block size");
    return type_row_bytes(type, k);
  }, py::arg("type"), py::arg("k"), "Bytes of a row of k values of ggml type `type`.");

  m.def("core_siblings", &core_siblings, py::arg("cpu"),
        "The CPUs sharing a core with `cpu`, itself included (sysfs thread_siblings_list; [cpu] where it says nothing).");
  m.def("pin_order", &pin_order, py::arg("cpus"), py::arg("caller_siblings"),
        "The CPUs in the order a pool pins to: cpus[0] (the caller's) first, its SMT siblings last.");
  py::class_<ThreadPool, std::shared_ptr<ThreadPool>>(m, "ThreadPool",
      "n_threads threads per job: n_threads - 1 persistent workers plus the caller of wait(), which takes tasks "
      "instead of sleeping. Jobs run and complete in submission order.")
      .def(py::init<int, bool, int>(), py::arg("n_threads"), py::arg("pin") = true, py::arg("spin_us") = 200,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("size", &ThreadPool::size)
      .def_property_readonly("pinned", &ThreadPool::pinned)
      .def_property_readonly("worker_cpus", &ThreadPool::worker_cpus, "the CPU each worker is pinned to (empty: none)")
      .def_property("spin_us", &ThreadPool::spin_us, &ThreadPool::set_spin_us,
                    "how long idle workers poll for the next job before sleeping (0 where they share cores)")
      .def("wait", &ThreadPool::wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
           "Block until the job with this ticket is done; raises its error, if any.")
      .def("done", &ThreadPool::done, py::arg("ticket"))
      .def("set_trace", &ThreadPool::set_trace, py::arg("on"),
           "Diagnostics: record when each thread starts and ends its share of every job.")
      .def("last_trace", &ThreadPool::last_trace,
           "Per thread id of the last traced job: (ns from submit to its first task, to the end of its last, tasks).")
      .def_property("caller_helps", &ThreadPool::caller_helps, &ThreadPool::set_caller_helps,
                    "Whether wait() works on the jobs (default) or only waits (tuning).")
      .def("last_job_times", &ThreadPool::last_job_times,
           "(posted, completed) of the last traced job in steady-clock ns, comparable with time.perf_counter_ns().")
      .def("busy", &ThreadPool::busy,
           "(jobs completed, ns during which at least one job was posted and not complete): always counted.");

  m.def("moe_config", [](const py::dict& overrides) { return config_dict(config_from(overrides)); },
        py::arg("overrides") = py::dict(),
        "The config of a MoE or Linear as a dict (gate_up_tasks, down_tasks, down_expert_rows, prefetch_bytes, "
        "prefetch_hint 0 t0 / 1 t1 / 2 nta, x16_prefetch_bytes, tile_min_tokens, x16_tile_from, amx, prefetch_clamp): "
        "the defaults, which the KTRANS_* environment variables set (read at this call), with `overrides` applied, "
        "checked. ValueError names a field that is out of range, not an integer, or unknown.");
  m.def("amx_mode", &amx_mode, py::arg("amx"),
        "How the Q4_K/Q5_K prefill tiles run on this CPU for config field amx: 1 AMX, 0 AVX-512 VNNI, 2 emulated "
        "AMX (1 asks for AMX and gets it only where the CPU has AMX-INT8 and the OS granted tile data).");

  py::class_<PyMoE>(m, "MoE", "One MoE layer's routed experts on raw ggml blocks (stacked [E, rows, cols]).")
      .def(py::init([](std::shared_ptr<ThreadPool> pool, int n_experts, int hidden, int intermediate,
                       uintptr_t gate, int gate_type, uintptr_t up, int up_type, uintptr_t down, int down_type,
                       const std::string& isa, const py::dict& config) {
             const Kernels& k = select_kernels(isa.c_str());
             return std::unique_ptr<PyMoE>(new PyMoE{
                 std::move(pool),
                 MoE(n_experts, hidden, intermediate, ExpertMatrix{ptr<const uint8_t>(gate), gate_type, intermediate, hidden},
                     ExpertMatrix{ptr<const uint8_t>(up), up_type, intermediate, hidden},
                     ExpertMatrix{ptr<const uint8_t>(down), down_type, hidden, intermediate}, k, config_from(config))});
           }),
           py::arg("pool"), py::arg("n_experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("gate"),
           py::arg("gate_type"), py::arg("up"), py::arg("up_type"), py::arg("down"), py::arg("down_type"),
           py::arg("isa") = "auto", py::arg("config") = py::dict(),
           "config: fields of moe_config to set (the others take their defaults, read from the environment now).")
      .def_property_readonly("path", [](const PyMoE& s) { return std::string(s.moe.kernels().name); })
      .def_property_readonly("config", [](const PyMoE& s) { return config_dict(s.moe.config()); },
                             "This layer's config (a dict, as moe_config gives it).")
      .def("set_config", [](PyMoE& s, const py::dict& config) { s.moe.set_config(config_from(config)); },
           py::arg("config"),
           "Replace this layer's config (fields not given take their defaults), checked: ValueError names the field. "
           "Jobs submitted from now on run with it; a job already submitted keeps the config it was submitted with.")
      .def("run",
           [](const PyMoE& s, uintptr_t x, int64_t T, int64_t ldx, uintptr_t ids, uintptr_t weights, int k,
              uintptr_t out, int64_t ldo) {
             s.pool->wait(s.moe.submit(*s.pool, ptr<const float>(x), T, ldx, ptr<const int64_t>(ids),
                                       ptr<const float>(weights), k, ptr<float>(out), ldo));
           },
           py::arg("x"), py::arg("T"), py::arg("ldx"), py::arg("ids"), py::arg("weights"), py::arg("k"),
           py::arg("out"), py::arg("ldo"), py::call_guard<py::gil_scoped_release>(),
           "submit and wait in one call (the synchronous path).")
      .def("submit",
           [](const PyMoE& s, uintptr_t x, int64_t T, int64_t ldx, uintptr_t ids, uintptr_t weights, int k,
              uintptr_t out, int64_t ldo) {
             return s.moe.submit(*s.pool, ptr<const float>(x), T, ldx, ptr<const int64_t>(ids),
                                 ptr<const float>(weights), k, ptr<float>(out), ldo);
           },
           py::arg("x"), py::arg("T"), py::arg("ldx"), py::arg("ids"), py::arg("weights"), py::arg("k"),
           py::arg("out"), py::arg("ldo"), py::call_guard<py::gil_scoped_release>(),
           "Queue out = MoE(x); returns a ticket for pool.wait. The buffers must live until then.");

  m.def("stream_hooks_available",
        []() {
          std::string why;
          bool ok = stream_hooks_available(&why);
          return py::make_tuple(ok, why);
        },
        "(True, '') where CPU work can be enqueued on a CUDA stream (the driver's cuLaunchHostFunc was found), "
        "else (False, why).");
  m.def("relay_kick", &relay_kick, py::arg("spin_us"),
        "Wake the flag path's relay thread and have it poll for spin_us after this (a step is starting).");
  m.def("relay_stats", &relay_stats, "[go numbers served, StreamCalls on the flag path].");
  py::class_<StreamCall>(m, "StreamCall",
                         "One MoE layer's call on a CUDA stream: enqueue_submit and enqueue_wait put its submit and "
                         "wait on the stream as host functions, reading and writing only the pinned host buffers "
                         "given here; the live row count is read from the host cell `rows` when the submit runs.")
      .def(py::init([](const PyMoE& moe, uintptr_t x, int64_t ldx, uintptr_t ids, uintptr_t weights, int k,
                       uintptr_t out, int64_t ldo, int64_t max_rows, uintptr_t rows) {
             if (max_rows < 0 || k <= 0 || ldx <= 0 || ldo <= 0)
               throw std::invalid_argument("StreamCall: max_rows, k, ldx and ldo must be positive");
             auto c = std::make_unique<StreamCall>();
             c->moe = &moe.moe;
             c->pool = moe.pool.get();
             c->x = ptr<const float>(x);
             c->ids = ptr<const int64_t>(ids);
             c->weights = ptr<const float>(weights);
             c->out = ptr<float>(out);
             c->ldx = ldx;
             c->ldo = ldo;
             c->k = k;
             c->max_rows = max_rows;
             c->rows = ptr<const int64_t>(rows);
             return c;
           }),
           py::arg("moe"), py::arg("x"), py::arg("ldx"), py::arg("ids"), py::arg("weights"), py::arg("k"),
           py::arg("out"), py::arg("ldo"), py::arg("max_rows"), py::arg("rows"), py::keep_alive<1, 2>(),
           "The buffers (Python ints: addresses) must outlive every enqueued or captured use.")
      .def("enqueue_submit", &StreamCall::enqueue_submit, py::arg("stream"),
           "Put the submit on `stream` (a cudaStream_t as an int). RuntimeError if the driver call fails.")
      .def("enqueue_wait", &StreamCall::enqueue_wait, py::arg("stream"))
      .def("enqueue_submit_wait", &StreamCall::enqueue_submit_wait, py::arg("stream"),
           "Submit and wait as one host function on `stream` (one driver round trip instead of two).")
      .def("run_submit", &StreamCall::run_submit, py::call_guard<py::gil_scoped_release>(),
           "What the submit host function does, called directly (tests without CUDA).")
      .def("run_wait", &StreamCall::run_wait, py::call_guard<py::gil_scoped_release>())
      .def("run_submit_wait", &StreamCall::run_submit_wait, py::call_guard<py::gil_scoped_release>())
      .def("use_flags", [](StreamCall& c, uintptr_t flags) { c.use_flags(ptr<int64_t>(flags)); }, py::arg("flags"),
           "The flag path: the relay thread serves this call whenever the int64 at `flags` (go) changes, storing "
           "the same number at flags + 8 (done) after the output. `flags` (3 int64: go, done, GPU timed out; pinned) "
           "must outlive drop_flags().")
      .def("drop_flags", &StreamCall::drop_flags, py::call_guard<py::gil_scoped_release>(),
           "Off the flag path; returns once the relay no longer touches this call or its flags.")
      .def_property_readonly("flag_calls", [](const StreamCall& c) { return c.flag_calls.load(); },
                             "Go numbers the relay served for this call.")
      .def("take_error", &StreamCall::take_error,
           "The first failure of a host function since the last call ('' if none), cleared.")
      .def_property_readonly("calls", [](const StreamCall& c) { return c.calls.load(std::memory_order_acquire); },
                             "Waits completed so far.")
      .def_property_readonly("last_busy_ns", [](const StreamCall& c) { return c.last_busy_ns.load(); },
                             "The pool's busy nanoseconds from the last job's submit to its wait: that job's "
                             "compute span when nothing else ran on the pool meanwhile (0 before the first).");

  py::class_<PyLinear>(m, "Linear", "y = x W^T with W [n_out, n_in] in ggml blocks.")
      .def(py::init([](std::shared_ptr<ThreadPool> pool, int64_t n_out, int64_t n_in, uintptr_t w, int type,
                       const std::string& isa, const py::dict& config) {
             const Kernels& k = select_kernels(isa.c_str());
             return std::unique_ptr<PyLinear>(new PyLinear{
                 std::move(pool), Linear(n_out, n_in, ptr<const uint8_t>(w), type, k, config_from(config))});
           }),
           py::arg("pool"), py::arg("n_out"), py::arg("n_in"), py::arg("w"), py::arg("type"), py::arg("isa") = "auto",
           py::arg("config") = py::dict(),
           "config: as MoE's (the kernel fields apply; the work split fields do not).")
      .def_property_readonly("path", [](const PyLinear& s) { return std::string(s.lin.kernels().name); })
      .def_property_readonly("config", [](const PyLinear& s) { return config_dict(s.lin.config()); },
                             "This linear's config (a dict, as moe_config gives it).")
      .def("set_config", [](PyLinear& s, const py::dict& config) { s.lin.set_config(config_from(config)); },
           py::arg("config"), "As MoE.set_config.")
      .def("submit",
           [](const PyLinear& s, uintptr_t x, int64_t T, int64_t ldx, uintptr_t y, int64_t ldy) {
             return s.lin.submit(*s.pool, ptr<const float>(x), T, ldx, ptr<float>(y), ldy);
           },
           py::arg("x"), py::arg("T"), py::arg("ldx"), py::arg("y"), py::arg("ldy"),
           py::call_guard<py::gil_scoped_release>());

  // Decode-step layer kernels (layers.h). Buffers are addresses; ktrans/kernels/cpu_layers.py checks the tensors.
  m.def("gdn_decode",
        [](std::shared_ptr<ThreadPool> pool, int64_t B, int hk, int hv, int dk, int dv, int kernel, uintptr_t mixed,
           int64_t ld_mixed, uintptr_t z, int64_t ld_z, uintptr_t a, uintptr_t b, int64_t ld_ab, uintptr_t rows,
           int64_t n_rows, uintptr_t slots, int64_t n_slots, uintptr_t A_log, uintptr_t dt_bias, uintptr_t conv_w,
           uintptr_t norm_w, float eps, uintptr_t conv_pool, bool conv_bf16, uintptr_t ssm_pool, uintptr_t out,
           int64_t ld_out, const std::string& isa) {
          GdnDecodeArgs g;
          g.B = B, g.hk = hk, g.hv = hv, g.dk = dk, g.dv = dv, g.kernel = kernel;
          g.mixed = ptr<const float>(mixed), g.ld_mixed = ld_mixed, g.z = ptr<const float>(z), g.ld_z = ld_z;
          g.a = ptr<const float>(a), g.b = ptr<const float>(b), g.ld_ab = ld_ab;
          g.rows = ptr<const int64_t>(rows), g.n_rows = n_rows, g.slots = ptr<const int64_t>(slots), g.n_slots = n_slots;
          g.A_log = ptr<const float>(A_log), g.dt_bias = ptr<const float>(dt_bias), g.conv_w = ptr<const float>(conv_w);
          g.norm_w = ptr<const float>(norm_w), g.eps = eps, g.conv_pool = ptr<void>(conv_pool);
          g.conv_dtype = conv_bf16 ? PoolDtype::bf16 : PoolDtype::f32, g.ssm_pool = ptr<float>(ssm_pool);
          g.out = ptr<float>(out), g.ld_out = ld_out;
          const bool avx512 = select_kernels(isa.c_str()).isa == Isa::avx512;
          gdn_decode(g, pool.get(), avx512);
        },
        py::arg("pool"), py::arg("B"), py::arg("hk"), py::arg("hv"), py::arg("dk"), py::arg("dv"), py::arg("kernel"),
        py::arg("mixed"), py::arg("ld_mixed"), py::arg("z"), py::arg("ld_z"), py::arg("a"), py::arg("b"),
        py::arg("ld_ab"), py::arg("rows"), py::arg("n_rows"), py::arg("slots"), py::arg("n_slots"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("conv_w"), py::arg("norm_w"), py::arg("eps"), py::arg("conv_pool"),
        py::arg("conv_bf16"), py::arg("ssm_pool"), py::arg("out"), py::arg("ld_out"), py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>(),
        "One Gated DeltaNet decode step for B sequences in place on the state pools (see csrc/cpu/layers.h); on the "
        "pool when it has more than one thread (None: this thread). rows = 0: sequence i is token row i.");
  m.def("attn_decode",
        [](std::shared_ptr<ThreadPool> pool, int64_t B, int hq, int hkv, int d, int page_size, float scale,
           uintptr_t q, uintptr_t k_new, uintptr_t v_new, uintptr_t slot_mapping, uintptr_t k_cache, uintptr_t v_cache,
           bool cache_bf16, int64_t n_cache_rows, uintptr_t kv_lens, uintptr_t block_tables, int64_t ld_bt,
           uintptr_t out, const std::string& isa) {
          AttnDecodeArgs t;
          t.B = B, t.hq = hq, t.hkv = hkv, t.d = d, t.page_size = page_size, t.scale = scale;
          t.q = ptr<const float>(q), t.k_new = ptr<const float>(k_new), t.v_new = ptr<const float>(v_new);
          t.slot_mapping = ptr<const int64_t>(slot_mapping), t.k_cache = ptr<void>(k_cache);
          t.v_cache = ptr<void>(v_cache), t.cache_dtype = cache_bf16 ? PoolDtype::bf16 : PoolDtype::f32;
          t.n_cache_rows = n_cache_rows, t.kv_lens = ptr<const int64_t>(kv_lens);
          t.block_tables = ptr<const int64_t>(block_tables), t.ld_bt = ld_bt, t.out = ptr<float>(out);
          const bool avx512 = select_kernels(isa.c_str()).isa == Isa::avx512;
          attn_decode(t, pool.get(), avx512);
        },
        py::arg("pool"), py::arg("B"), py::arg("hq"), py::arg("hkv"), py::arg("d"), py::arg("page_size"),
        py::arg("scale"), py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("slot_mapping"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_bf16"), py::arg("n_cache_rows"), py::arg("kv_lens"),
        py::arg("block_tables"), py::arg("ld_bt"), py::arg("out"), py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>(),
        "Write B new tokens' K and V at their slot_mapping rows, then attend each sequence's query heads over its "
        "kv_lens[i] cached tokens through its block table (see csrc/cpu/layers.h).");

  // Per-row ops of a CPU decode step (row_ops.h), on the calling thread; ktrans/kernels/cpu_layers.py checks the
  // tensors. residual / sum_out = 0: no residual add.
  m.def("rms_norm_rows",
        [](int64_t T, int64_t n, uintptr_t x, int64_t ldx, uintptr_t residual, int64_t ldr, uintptr_t sum_out,
           int64_t lds, uintptr_t w, float w_offset, float eps, uintptr_t out, int64_t ldo) {
          rms_norm_rows(T, n, ptr<const float>(x), ldx, ptr<const float>(residual), ldr, ptr<float>(sum_out), lds,
                        ptr<const float>(w), w_offset, eps, ptr<float>(out), ldo);
        },
        py::arg("T"), py::arg("n"), py::arg("x"), py::arg("ldx"), py::arg("residual"), py::arg("ldr"),
        py::arg("sum_out"), py::arg("lds"), py::arg("w"), py::arg("w_offset"), py::arg("eps"), py::arg("out"),
        py::arg("ldo"), py::call_guard<py::gil_scoped_release>());
  m.def("moe_route",
        [](int64_t T, int64_t E, uintptr_t logits, int64_t ld, int k, bool renorm, uintptr_t ids, uintptr_t weights) {
          moe_route(T, E, ptr<const float>(logits), ld, k, renorm, ptr<int64_t>(ids), ptr<float>(weights));
        },
        py::arg("T"), py::arg("E"), py::arg("logits"), py::arg("ld"), py::arg("k"), py::arg("renorm"), py::arg("ids"),
        py::arg("weights"), py::call_guard<py::gil_scoped_release>());
  m.def("moe_gated_sum",
        [](int64_t T, int64_t n, uintptr_t routed, uintptr_t shared, uintptr_t gate, uintptr_t out) {
          moe_gated_sum(T, n, ptr<const float>(routed), ptr<const float>(shared), ptr<const float>(gate),
                        ptr<float>(out));
        },
        py::arg("T"), py::arg("n"), py::arg("routed"), py::arg("shared"), py::arg("gate"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());

  m.attr("AVX2_TILE_MIN_TOKENS") = kAvx2TileMinTokens;

  m.def("bench_gemm",
        [](int type, uintptr_t w, int64_t M, int64_t k, int N, int reps, const std::string& isa,
           const py::dict& config) {
          // One thread, no pool: the kernel alone, for tuning. Activations are random; weights are the caller's.
          const MoEConfig cfg = config_from(config);
          py::gil_scoped_release release;
          const Kernels& K = select_kernels(isa.c_str());
          if (!type_supported(type)) throw std::invalid_argument("bench_gemm: unsupported type " + std::to_string(type));
          if (is_x16(type) && (!K.reads_x16 || M % kX16Rows))
            throw std::invalid_argument(std::string("bench_gemm: ") + type_name(type) +
                                        " needs a path that reads it and a multiple of 16 rows");
          if (k % type_block_size(type))
            throw std::invalid_argument("bench_gemm: k must be a multiple of the type's block size");
          const ActFormat f = K.act_format(type);
          const size_t la = act_row_bytes(f, k);
          std::vector<float> x(static_cast<size_t>(N) * k);
          for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.f - 1.f;
          std::vector<uint8_t> a(static_cast<size_t>(N) * la + 64);
          uint8_t* ab = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(a.data()) + 63) & ~uintptr_t(63));
          quantize_act(f, x.data(), k, N, k, ab, la);
          std::vector<const uint8_t*> rows(N);
          for (int n = 0; n < N; ++n) rows[n] = f == ACT_F32 ? reinterpret_cast<const uint8_t*>(x.data() + n * k) : ab + n * la;
          std::vector<float> c(static_cast<size_t>(N) * M);
          const size_t ldw = type_row_bytes(type, k);
          const auto t0 = std::chrono::steady_clock::now();
          for (int r = 0; r < reps; ++r)
            K.gemm(cfg, type, ptr<const uint8_t>(w), ldw, static_cast<int>(M), rows.data(), N, k, c.data(), M);
          return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
        },
        py::arg("type"), py::arg("w"), py::arg("M"), py::arg("k"), py::arg("N"), py::arg("reps"),
        py::arg("isa") = "auto", py::arg("config") = py::dict(),
        "Seconds per call of the raw gemm kernel on this thread (tuning aid), under `config` (fields of moe_config; "
        "the others take their defaults).");

  m.def("read_bandwidth",
        [](std::shared_ptr<ThreadPool> pool, size_t nbytes, int reps, const std::string& isa) {
          return read_bandwidth(*pool, select_kernels(isa.c_str()), nbytes, reps);
        },
        py::arg("pool"), py::arg("nbytes"), py::arg("reps") = 3, py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>(),
        "Best GB/s of streaming reads over a fresh buffer of nbytes, split across the pool's threads.");

  m.def("stream_bandwidth",
        [](std::shared_ptr<ThreadPool> pool, uintptr_t data, size_t nbytes, int reps, const std::string& isa) {
          return stream_bandwidth(*pool, select_kernels(isa.c_str()), ptr<const uint8_t>(data), nbytes, reps);
        },
        py::arg("pool"), py::arg("data"), py::arg("nbytes"), py::arg("reps") = 3, py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>(),
        "Best GB/s of streaming reads over an existing buffer (e.g. the expert weights), split across the pool.");

  m.attr("Q4_K_X16") = KT_Q4_K_X16;
  m.attr("Q5_K_X16") = KT_Q5_K_X16;
  m.def("reads_x16", [](const std::string& isa) { return select_kernels(isa.c_str()).reads_x16; },
        py::arg("isa") = "auto",
        "Whether the kernel path takes Q4_K and Q5_K repacked 16 rows at a time (Q4_K_X16, Q5_K_X16).");
  m.def("repack_x16",
        [](std::shared_ptr<ThreadPool> pool, int type, uintptr_t src, uintptr_t dst, int64_t rows, int64_t k) {
          repack_x16(*pool, type, ptr<const uint8_t>(src), ptr<uint8_t>(dst), rows, k);
        },
        py::arg("pool"), py::arg("type"), py::arg("src"), py::arg("dst"), py::arg("rows"), py::arg("k"),
        py::call_guard<py::gil_scoped_release>(),
        "Q4_K or Q5_K (ggml type id) rows [rows, k] at src into their 16-row layout at dst (the same number of "
        "bytes), on the pool.");

  m.def("advise_hugepages",
        [](uintptr_t p, size_t n) {
          // The whole 2 MiB pages inside [p, p + n); untouched anonymous pages there then fault in as huge pages
          // where the kernel's transparent_hugepage mode is "madvise" (or "always").
          const uintptr_t h = uintptr_t(1) << 21, lo = (p + h - 1) & ~(h - 1), hi = (p + n) & ~(h - 1);
#ifdef MADV_HUGEPAGE
          return hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE) == 0;
#else
          return false;
#endif
        },
        py::arg("p"), py::arg("n"), "madvise(MADV_HUGEPAGE) on the 2 MiB pages inside [p, p + n); True if applied.");
  m.def("drop_pages",
        [](uintptr_t p, size_t n) {
          // The whole 4 KiB pages inside [p, p + n) leave this process's page tables (MADV_DONTNEED). Only for a
          // file mapping that was never written: its pages fault back in from the file if read again, while an
          // anonymous range would read back as zeros (the Python side checks which it is).
          const uintptr_t g = uintptr_t(4096), lo = (p + g - 1) & ~(g - 1), hi = (p + n) & ~(g - 1);
          return hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0;
        },
        py::arg("p"), py::arg("n"), "madvise(MADV_DONTNEED) on the pages inside [p, p + n); True if applied.");
  m.def("read_tasks",
        [](std::shared_ptr<ThreadPool> pool, const std::vector<std::vector<std::pair<uintptr_t, size_t>>>& tasks,
           const std::string& isa) {
          std::vector<std::vector<Range>> t(tasks.size());
          for (size_t i = 0; i < tasks.size(); ++i)
            for (const auto& r : tasks[i]) t[i].emplace_back(ptr<const uint8_t>(r.first), r.second);
          py::gil_scoped_release release;
          return read_tasks(*pool, select_kernels(isa.c_str()), t);
        },
        py::arg("pool"), py::arg("tasks"), py::arg("isa") = "auto",
        "Seconds for one pool job whose task i streams the (address, bytes) ranges tasks[i], no arithmetic: the "
        "memory side of a compute step's access pattern (diagnostics).");
}

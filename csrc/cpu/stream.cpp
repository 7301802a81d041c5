// CPU expert work placed on a CUDA stream (stream.h): the driver's cuLaunchHostFunc, found at run time.
#include "stream.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <stdexcept>
#include <thread>

namespace ktrans {

namespace {

// CUresult cuLaunchHostFunc(CUstream, CUhostFn, void*); CUresult and CUstream are an int and a pointer in the
// driver's ABI, which is stable across CUDA versions (the entry point exists since CUDA 10.0).
using LaunchHostFunc = int (*)(void* stream, void (*fn)(void*), void* user);
using GetErrorString = int (*)(int error, const char** str);

struct Driver {
  LaunchHostFunc launch = nullptr;
  GetErrorString error_string = nullptr;
  std::string why;

  Driver() {
    // The process that hands us a stream has loaded the driver already; RTLD_NOLOAD first avoids loading a
    // second copy from another path.
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) {
      why = std::string("the CUDA driver (libcuda.so.1) is not available: ") + dlerror();
      return;
    }
    launch = reinterpret_cast<LaunchHostFunc>(dlsym(lib, "cuLaunchHostFunc"));
    error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    if (launch == nullptr) why = "the CUDA driver has no cuLaunchHostFunc (CUDA 10.0 or newer is needed)";
  }
};

const Driver& driver() {
  static const Driver d;
  return d;
}

void launch(uintptr_t stream, void (*fn)(void*), void* user) {
  const Driver& d = driver();
  if (d.launch == nullptr) throw std::runtime_error(d.why);
  int rc = d.launch(reinterpret_cast<void*>(stream), fn, user);
  if (rc != 0) {
    const char* msg = nullptr;
    if (d.error_string != nullptr) d.error_string(rc, &msg);
    throw std::runtime_error("cuLaunchHostFunc failed: " + std::string(msg ? msg : "error ") +
                             (msg ? "" : std::to_string(rc)));
  }
}

void host_submit(void* p) { static_cast<StreamCall*>(p)->run_submit(); }
void host_wait(void* p) { static_cast<StreamCall*>(p)->run_wait(); }
void host_submit_wait(void* p) { static_cast<StreamCall*>(p)->run_submit_wait(); }

}  // namespace

bool stream_hooks_available(std::string* why) {
  const Driver& d = driver();
  if (why != nullptr) *why = d.why;
  return d.launch != nullptr;
}

// Host functions may not throw into the driver: a failure is kept for take_error() and the call's output is left
// as it is (the Python side raises at its next step).
void StreamCall::run_submit() {
  // The stream orders one call's submit before its wait; a second submit first means two forwards share the call's
  // buffers at once, which would mix their rows. The job already submitted stays the one the wait waits for.
  if (in_flight.exchange(1, std::memory_order_acq_rel) != 0) {
    std::lock_guard<std::mutex> g(error_mu);
    if (error.empty()) error = "a MoE layer's stream call was submitted again before its wait ran";
    return;
  }
  has_job = false;
  try {
    int64_t n = rows != nullptr ? *rows : max_rows;
    if (n < 0 || n > max_rows)
      throw std::out_of_range("live rows " + std::to_string(n) + " outside [0, " + std::to_string(max_rows) + "]");
    if (n > 0) {
      busy_at_submit = pool->busy()[1];
      ticket = moe->submit(*pool, x, n, ldx, ids, weights, k, out, ldo);
      has_job = true;
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(error_mu);
    if (error.empty()) error = e.what();
  }
}

void StreamCall::run_wait() {
  try {
    if (has_job) {
      last_busy_ns.store(0, std::memory_order_relaxed);  // a failed wait leaves no span to read
      pool->wait(ticket);
      last_busy_ns.store(pool->busy()[1] - busy_at_submit, std::memory_order_relaxed);
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> g(error_mu);
    if (error.empty()) error = e.what();
  }
  has_job = false;
  calls.fetch_add(1, std::memory_order_release);  // a reader that sees this count sees this call's span
  in_flight.store(0, std::memory_order_release);
}

void StreamCall::enqueue_submit(uintptr_t stream) { launch(stream, host_submit, this); }

void StreamCall::enqueue_wait(uintptr_t stream) { launch(stream, host_wait, this); }

void StreamCall::enqueue_submit_wait(uintptr_t stream) { launch(stream, host_submit_wait, this); }

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Relay {
 public:
  static Relay& get() {
    static Relay* r = new Relay();  // never destroyed: its thread may outlive static destructors at exit
    return *r;
  }
  void add(StreamCall* c) {
    std::lock_guard<std::mutex> g(mu_);
    if (std::find(calls_.begin(), calls_.end(), c) == calls_.end()) calls_.push_back(c);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    pin();
  }
  // Blocks while the relay runs a layer of this call: after it returns the relay never touches c again.
  void remove(StreamCall* c) {
    std::lock_guard<std::mutex> g(mu_);
    calls_.erase(std::remove(calls_.begin(), calls_.end(), c), calls_.end());
  }
  void kick(int spin_us) {
    spin_ns_.store(std::max(spin_us, 0) * int64_t{1000}, std::memory_order_relaxed);
    spin_until_.store(now_ns() + spin_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> g(sleep_mu_);
      kicked_ = true;
    }
    cv_.notify_one();
  }
  std::vector<uint64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {served_.load(), calls_.size()};
  }

 private:
  void loop() {
    for (;;) {
      uint64_t served = 0;
      {
        std::lock_guard<std::mutex> g(mu_);
        for (StreamCall* c : calls_) served += c->serve_flag() ? 1 : 0;
      }
      if (served) {
        served_.fetch_add(served, std::memory_order_relaxed);
        spin_until_.store(now_ns() + spin_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
        continue;
      }
      if (now_ns() < spin_until_.load(std::memory_order_relaxed)) {
        cpu_pause();  // not backoff(): yielding would put a runnable thread between the GPU's go and this one
        continue;
      }
      std::unique_lock<std::mutex> lk(sleep_mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(1), [this] { return kicked_; });
      kicked_ = false;
    }
  }
  // The relay is its pools' caller (it helps in their jobs), and a pinned pool leaves one CPU for the caller: the
  // relay goes there, the CPUs this thread may use less those the pools' workers are pinned to (on the 16-core
  // Xeon, unpinned, it polled beside a worker and a batch-1 token's CPU experts took 10.4 ms instead of 9.4).
  void pin() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return;
    bool any_pinned = false;
    for (StreamCall* c : calls_) {
      if (c->pool == nullptr || !c->pool->pinned()) continue;
      any_pinned = true;
      for (int cpu : c->pool->worker_cpus()) CPU_CLR(cpu, &set);
    }
    if (any_pinned && CPU_COUNT(&set) > 0) pthread_setaffinity_np(thread_.native_handle(), sizeof(set), &set);
  }
  std::mutex mu_;  // calls_, and held while a layer runs
  std::vector<StreamCall*> calls_;
  std::thread thread_;
  std::atomic<int64_t> spin_ns_{20'000'000}, spin_until_{0};
  std::atomic<uint64_t> served_{0};
  std::mutex sleep_mu_;
  std::condition_variable cv_;
  bool kicked_ = false;
};

}  // namespace

void StreamCall::use_flags(int64_t* f) {
  drop_flags();
  flags_ = f;
  seen_ = __atomic_load_n(&f[0], __ATOMIC_ACQUIRE);  // what is there now was served (or never will be)
  Relay::get().add(this);
}

void StreamCall::drop_flags() {
  if (flags_ == nullptr) return;
  Relay::get().remove(this);
  flags_ = nullptr;
}

bool StreamCall::serve_flag() {
  int64_t go = __atomic_load_n(&flags_[0], __ATOMIC_ACQUIRE);
  if (go == seen_) return false;
  seen_ = go;
  run_submit();  // a failure is kept for take_error(); done is stored anyway, so the GPU never waits forever
  run_wait();
  flag_calls.fetch_add(1, std::memory_order_relaxed);
  __atomic_store_n(&flags_[1], go, __ATOMIC_RELEASE);  // after the output rows (x86 stores stay in order)
  return true;
}

void relay_kick(int spin_us) { Relay::get().kick(spin_us); }

std::vector<uint64_t> relay_stats() { return Relay::get().stats(); }

std::string StreamCall::take_error() {
  std::lock_guard<std::mutex> g(error_mu);
  std::string e;
  e.swap(error);
  return e;
}

}  // namespace ktrans

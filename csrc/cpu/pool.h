// A persistent pool of worker threads that runs submitted jobs in order, asynchronously.
//
// A job is a list of phases; a phase is n independent tasks that every participating thread takes from a shared
// counter, and the next phase starts when every task of the previous one is done. submit() returns a ticket at
// once; wait(ticket) blocks until that job (and all before it) finished and rethrows the job's error, if any.
// Jobs own their buffers, so jobs from different layers in flight together never share memory.
//
// A pool of n threads is n - 1 workers plus the caller: wait() does not sleep while there is work, it takes tasks
// itself. So the waiting thread starts at once and sees the end at once (no futex wake-ups on the critical path),
// and while the caller is busy elsewhere (the GPU's share of a layer) the workers already run.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ktrans {

struct Phase {
  int n_tasks = 0;
  std::function<void(int task, int thread)> run;
};

class Job {
 public:
  virtual ~Job() = default;
  std::vector<Phase> phases;
  // A task threw: the job's remaining tasks are skipped, so a task waiting on another must stop waiting.
  bool failed() const { return failed_.load(std::memory_order_relaxed); }

 private:
  friend class ThreadPool;
  // Per phase, each counter on a cache line of its own: `next` hands out tasks, `done` counts finished ones and
  // `finished` is set once by whoever finishes the last task, so the threads waiting for the phase spin on a line
  // nobody writes until then (spinning on `done`, next to `next`, made every task grab and every finish contend
  // with all the spinning readers).
  struct alignas(64) Counter {
    std::atomic<int> v{0};
  };
  struct PhaseSync {
    Counter next, done, finished;
  };
  std::unique_ptr<PhaseSync[]> sync_;
  std::atomic<bool> failed_{false};
  // Workers take a posted job from its ring slot without a lock or a shared_ptr copy: the job keeps itself alive
  // (self_) until every worker has passed it (refs_ counts them down), and only then frees its slot.
  std::atomic<int> refs_{0};
  std::shared_ptr<Job> self_;
  // With tracing on: per thread id, ns from submit to its first task's start and to its last task's end, and the
  // number of tasks it ran (-1, -1, 0 when it ran none).
  std::vector<std::array<int64_t, 3>> trace_;
  int64_t t_submit_ = 0;  // steady-clock ns
  int64_t t_posted_ = 0;  // steady-clock ns, always recorded (busy time)
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// One step of a polling wait: a pause instruction for the first 4096 steps, then the core is given up (with more
// threads than free cores, the thread waited for may be the descheduled one).
inline void cpu_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
inline void backoff(int step) {
  if (step < 4096) cpu_pause();
  else std::this_thread::yield();
}
template <class F>
void spin_until(F cond) {
  for (int i = 0; !cond(); ++i) backoff(i);
}

// A test-and-test-and-set lock for the job queue, held for a few instructions by submit(), complete() and a helping
// caller (workers take posted jobs from the ring slots; when they took them from the queue too, a sleeping mutex
// handed it on one futex wake-up at a time: on a 16-core Xeon the median worker started ~19 us after submit).
class SpinLock {
 public:
  void lock() {
    while (flag_.exchange(true, std::memory_order_acquire))
      for (int i = 0; flag_.load(std::memory_order_relaxed); ++i) backoff(i);
  }
  void unlock() { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

// The CPUs sharing a core with `cpu` (itself included), from sysfs ("0,8" or "0-1"); just `cpu` where it says nothing.
std::vector<int> core_siblings(int cpu);
// The CPUs in the order the pool pins to: the caller's (cpus[0]) first, then the others, the caller's SMT siblings
// (caller_siblings) last.
std::vector<int> pin_order(const std::vector<int>& cpus, const std::vector<int>& caller_siblings);

class ThreadPool {
 public:
  // n_threads: threads working on a job, the caller of wait() included: n_threads - 1 workers. With n_threads = 1
  // there is one worker and the caller only waits, so that submit() still runs in the background.
  // pin: pin the workers to the allowed CPUs after the first (which is left to the caller).
  // spin_us: how long an idle worker polls for the next job before sleeping (a decode step submits a job per layer
  // every few hundred microseconds, and a futex wake-up costs tens of them). Polling and pinning apply only when
  // the process may use at least n_threads CPUs: otherwise a polling or pinned worker takes a core another thread
  // needs, and workers sleep instead.
  ThreadPool(int n_threads, bool pin, int spin_us);
  ~ThreadPool();  // finishes queued jobs, then joins
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // The polling window, changeable while the pool runs (the CPU experts widen it once a GPU stream drives them:
  // their jobs then come with the GPU's work between). Stays 0 where the threads have no cores of their own.
  void set_spin_us(int us) { spin_us_.store(own_cores_ ? std::max(us, 0) : 0); }
  int spin_us() const { return spin_us_.load(); }
  bool pinned() const { return pinned_; }
  const std::vector<int>& worker_cpus() const { return worker_cpus_; }  // where each worker is pinned (empty: none)
  // Whether wait() works on the jobs (the default) or only waits, polling for spin_us and then sleeping: the
  // workers alone then stream the weights, and the caller's caches keep what it runs next (tuning).
  void set_caller_helps(bool on) { caller_helps_.store(on); }
  bool caller_helps() const { return caller_helps_.load(); }
  uint64_t submit(std::shared_ptr<Job> job);
  // Helps with (or, when another thread is helping, waits for) the oldest jobs until `ticket` is done; raises the
  // earliest not yet raised error of that job or one before it.
  void wait(uint64_t ticket);
  bool done(uint64_t ticket) const { return completed_.load(std::memory_order_acquire) > ticket; }
  // A per-thread buffer of at least `bytes` (64-byte aligned), valid until that thread's next call.
  void* scratch(int thread, size_t bytes);
  // Diagnostics: record, per job, when each thread started and ended its share (costs two clock reads per task).
  void set_trace(bool on) { trace_on_.store(on); }
  // The per-thread record of the last completed job with tracing on: [thread] -> (start ns, end ns, tasks).
  std::vector<std::array<int64_t, 3>> last_trace();
  // ... and when it was posted and completed, in steady-clock ns (comparable with time.perf_counter_ns()).
  std::array<int64_t, 2> last_job_times();
  // Always on (two clock reads per job): (jobs completed, ns with at least one job posted and not yet complete).
  // Jobs complete in order, so the busy time is the union of their [posted, completed] spans; benchmarks read it
  // before and after a step for the step's CPU share.
  std::array<int64_t, 2> busy();

 private:
  void worker_loop(int id);
  void leave(uint64_t seq, Job* job);  // a worker is done with job seq (ran it or skipped it)
  bool wait_for_job(uint64_t seq);
  bool run_job(Job& job, int id);  // true for the thread that finished the job's last task
  void complete(uint64_t seq, const Job& job);

  int n_threads_, n_workers_;
  std::atomic<bool> caller_helps_{true};
  std::vector<std::thread> threads_;
  bool pinned_ = false;
  std::vector<int> worker_cpus_;
  std::atomic<int> spin_us_;
  bool own_cores_ = false;
  std::mutex mu_;       // sleeping and waking (cv_work_, cv_done_), errors_, stop_
  SpinLock q_mu_;       // queue_ and base_
  std::mutex help_mu_;  // one helping caller at a time: it uses the last scratch slot
  std::condition_variable cv_work_, cv_done_;
  std::deque<std::shared_ptr<Job>> queue_;  // queue_[i] is the job with ticket base_ + i
  // Job seq sits in slots_[seq % kSlots] from submit until every worker has passed it; a submit whose slot is still
  // taken (kSlots jobs behind a slow worker) waits. Workers read the slots, never queue_, so a posted job reaches
  // all of them at once instead of through one lock (on a 16-core Xeon the last worker started ~9 us after submit).
  static constexpr int kSlots = 64;
  std::unique_ptr<std::atomic<Job*>[]> slots_;
  uint64_t base_ = 0;
  std::atomic<uint64_t> posted_{0};     // tickets handed out
  std::atomic<uint64_t> completed_{0};  // every ticket below this is done
  std::map<uint64_t, std::exception_ptr> errors_;
  bool stop_ = false;
  std::atomic<bool> trace_on_{false};
  std::vector<std::array<int64_t, 3>> last_trace_;
  std::array<int64_t, 2> last_times_{0, 0};
  int64_t busy_ns_ = 0, last_completed_ns_ = 0;  // under mu_
  struct Scratch {
    void* p = nullptr;
    size_t cap = 0;
  };
  std::vector<Scratch> scratch_;  // one per worker, then the helping caller's
};

}  // namespace ktrans

// The worker pool (see pool.h). Baseline ISA.
#include "pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ktrans {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() { return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count(); }

}  // namespace

std::vector<int> core_siblings(int cpu) {
  std::vector<int> out;
  std::string path = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list";
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[256] = {0};
    if (std::fgets(buf, sizeof(buf), f)) {
      const char* p = buf;
      while (*p) {
        char* end;
        long lo = std::strtol(p, &end, 10);
        if (end == p) break;
        long hi = lo;
        p = end;
        if (*p == '-') {
          hi = std::strtol(p + 1, &end, 10);
          p = end;
        }
        for (long c = lo; c <= hi; ++c) out.push_back(static_cast<int>(c));
        if (*p == ',') ++p;
        else break;
      }
    }
    std::fclose(f);
  }
  if (out.empty()) out.push_back(cpu);
  return out;
}


std::vector<int> pin_order(const std::vector<int>& cpus, const std::vector<int>& caller_siblings) {
  if (cpus.empty()) return {};
  std::vector<int> order{cpus[0]}, shared;
  for (size_t i = 1; i < cpus.size(); ++i) {
    bool sibling = std::find(caller_siblings.begin(), caller_siblings.end(), cpus[i]) != caller_siblings.end();
    (sibling ? shared : order).push_back(cpus[i]);
  }
  order.insert(order.end(), shared.begin(), shared.end());
  return order;
}

ThreadPool::ThreadPool(int n_threads, bool pin, int spin_us)
    : n_threads_(n_threads), n_workers_(std::max(n_threads - 1, 1)), spin_us_(std::max(spin_us, 0)) {
  if (n_threads < 1) throw std::invalid_argument("the CPU thread pool needs at least 1 thread");
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  // Every thread (the workers and the caller) has a core of its own: pin the workers to all but the first, and to
  // the first's SMT siblings last (a polling worker there would share the caller's core: its norms, gathers and
  // Python between the jobs).
  const bool own_cores = static_cast<int>(cpus.size()) >= n_workers_ + 1;
  own_cores_ = own_cores;
  pinned_ = pin && own_cores;
  if (!own_cores) spin_us_ = 0;
  if (pinned_) cpus = pin_order(cpus, core_siblings(cpus[0]));
  scratch_.resize(n_workers_ + 1);
  slots_.reset(new std::atomic<Job*>[kSlots]);
  for (int i = 0; i < kSlots; ++i) slots_[i].store(nullptr, std::memory_order_relaxed);
  threads_.reserve(n_workers_);
  try {
    for (int i = 0; i < n_workers_; ++i) {
      threads_.emplace_back([this, i] { worker_loop(i); });
      if (pinned_) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[i + 1], &one);
        pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one);
        worker_cpus_.push_back(cpus[i + 1]);
      }
    }
  } catch (...) {  // could not start them all: stop and join the ones that did, then report
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    for (auto& t : threads_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
  for (auto& s : scratch_) std::free(s.p);
}

uint64_t ThreadPool::submit(std::shared_ptr<Job> job) {
  // Empty phases are dropped; a job needs one task at least, since whoever finishes its last task completes it.
  std::vector<Phase> phases;
  for (auto& ph : job->phases)
    if (ph.n_tasks > 0) phases.push_back(std::move(ph));
  if (phases.empty()) phases.push_back({1, [](int, int) {}});
  job->phases = std::move(phases);
  const size_t n = job->phases.size();
  job->sync_.reset(new Job::PhaseSync[n]);  // counters start at 0
  if (trace_on_.load(std::memory_order_relaxed)) {
    job->trace_.assign(n_workers_ + 1, {-1, -1, 0});
    job->t_submit_ = now_ns();
  }
  job->t_posted_ = now_ns();
  job->refs_.store(n_workers_, std::memory_order_relaxed);
  job->self_ = job;
  Job* raw = job.get();
  uint64_t ticket;
  for (int i = 0;; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) {
        job->self_.reset();
        throw std::runtime_error("the CPU thread pool is shut down");
      }
      ticket = posted_.load(std::memory_order_relaxed);  // posted_ only changes here, under mu_
      std::atomic<Job*>& slot = slots_[ticket % kSlots];
      if (slot.load(std::memory_order_acquire) == nullptr) {
        std::lock_guard<SpinLock> q(q_mu_);
        try {
          queue_.push_back(job);  // first: if it throws, nothing is published and the slot stays free
        } catch (...) {
          job->self_.reset();
          throw;
        }
        slot.store(raw, std::memory_order_relaxed);
        posted_.store(ticket + 1, std::memory_order_release);
        break;
      }
    }
    backoff(i);  // kSlots jobs in flight, or a worker kSlots jobs behind: let it catch up (not holding mu_)
  }
  cv_work_.notify_all();
  return ticket;
}

void ThreadPool::wait(uint64_t ticket) {
  if (ticket >= posted_.load(std::memory_order_acquire))
    throw std::invalid_argument("wait(): ticket " + std::to_string(ticket) + " was never submitted to this pool");
  std::unique_lock<std::mutex> help(help_mu_, std::defer_lock);
  if (n_threads_ > 1 && caller_helps_.load(std::memory_order_relaxed) && help.try_lock()) {
    // Work on the oldest incomplete job until ours is done; its tasks go to whoever takes them first.
    while (completed_.load(std::memory_order_acquire) <= ticket) {
      std::shared_ptr<Job> job;
      uint64_t seq;
      {
        std::lock_guard<SpinLock> q(q_mu_);
        if (queue_.empty()) break;
        seq = base_;
        job = queue_.front();
      }
      if (run_job(*job, n_workers_)) complete(seq, *job);
      else spin_until([&] { return completed_.load(std::memory_order_acquire) > seq; });
    }
  }
  // Not helping (or another thread helps): poll for a while, as idle workers do, then sleep.
  const auto deadline = Clock::now() + std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
  for (int i = 0; completed_.load(std::memory_order_acquire) <= ticket; ++i) {
    if ((i & 255) == 255 && Clock::now() > deadline) break;
    cpu_pause();
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) > ticket; });
  // A ticket stands for its job and every one before it, errors included: the earliest error not yet reported
  // among them is raised (and forgotten), so waiting only on a layer's last job still surfaces an earlier failure.
  auto it = errors_.begin();
  if (it != errors_.end() && it->first <= ticket) {
    std::exception_ptr e = it->second;
    errors_.erase(it);
    std::rethrow_exception(e);
  }
}

void* ThreadPool::scratch(int thread, size_t bytes) {
  Scratch& s = scratch_[thread];
  if (s.cap < bytes) {
    std::free(s.p);
    s.cap = (bytes + 4095) & ~size_t(4095);
    s.p = std::aligned_alloc(64, s.cap);
    if (!s.p) {
      s.cap = 0;
      throw std::bad_alloc();
    }
  }
  return s.p;
}

std::vector<std::array<int64_t, 3>> ThreadPool::last_trace() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_trace_;
}

std::array<int64_t, 2> ThreadPool::busy() {
  std::lock_guard<std::mutex> lock(mu_);
  return {static_cast<int64_t>(completed_.load(std::memory_order_acquire)), busy_ns_};
}

std::array<int64_t, 2> ThreadPool::last_job_times() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_times_;
}

bool ThreadPool::wait_for_job(uint64_t seq) {
  const auto deadline = Clock::now() + std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
  for (int i = 0; posted_.load(std::memory_order_acquire) <= seq; ++i) {
    if ((i & 255) == 255 && Clock::now() > deadline) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || posted_.load(std::memory_order_acquire) > seq; });
      return posted_.load(std::memory_order_acquire) > seq;
    }
    cpu_pause();
  }
  return true;
}

bool ThreadPool::run_job(Job& job, int id) {
  // Only tasks wait for tasks: a thread that comes late (descheduled, still waking up, or the caller joining in
  // wait()) finds the tasks taken and passes through, and the job is complete when its last task is, not when
  // every thread has seen it.
  bool finished_job = false;
  const bool tr = !job.trace_.empty();
  int64_t t_first = -1, t_last = -1, n_run = 0;
  const size_t last = job.phases.size() - 1;
  for (size_t p = 0; p <= last; ++p) {
    const Phase& ph = job.phases[p];
    for (;;) {
      const int t = job.sync_[p].next.v.fetch_add(1, std::memory_order_relaxed);
      if (t >= ph.n_tasks) break;
      if (tr && t_first < 0) t_first = now_ns();
      if (!job.failed_.load(std::memory_order_relaxed)) {
        try {
          ph.run(t, id);
        } catch (...) {
          std::lock_guard<std::mutex> lock(job.error_mu_);
          if (!job.error_) job.error_ = std::current_exception();
          job.failed_.store(true);
        }
      }
      if (tr) {  // recorded before the done count releases it to whoever completes the job
        t_last = now_ns(), ++n_run;
        job.trace_[id] = {t_first - job.t_submit_, t_last - job.t_submit_, n_run};
      }
      if (job.sync_[p].done.v.fetch_add(1, std::memory_order_acq_rel) + 1 == ph.n_tasks) {
        job.sync_[p].finished.v.store(1, std::memory_order_release);
        if (p == last) finished_job = true;
      }
    }
    // Also after the last phase, so no worker starts the next job before this one is complete: jobs complete in
    // order, which is what lets a ticket mean "this job and every one before it".
    spin_until([&] { return job.sync_[p].finished.v.load(std::memory_order_acquire) != 0; });
  }
  return finished_job;
}

void ThreadPool::complete(uint64_t seq, const Job& job) {
  // The other threads leave a job once its last task is done, so a later job can finish before this thread gets
  // here; completions must still go in order (the queue's front is this job, a ticket means "this and every job
  // before it", and its error must be recorded before wait() returns).
  spin_until([&] { return completed_.load(std::memory_order_acquire) == seq; });
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job.error_) errors_[seq] = job.error_;
    const int64_t t = now_ns();
    busy_ns_ += t - std::max(job.t_posted_, last_completed_ns_);
    last_completed_ns_ = t;
    if (!job.trace_.empty()) {
      last_trace_ = job.trace_;
      last_times_ = {job.t_submit_, t};
    }
    std::lock_guard<SpinLock> q(q_mu_);
    queue_.pop_front();  // jobs complete in order: the oldest incomplete one is this one
    ++base_;
    completed_.store(seq + 1, std::memory_order_release);
  }
  cv_done_.notify_all();
}

void ThreadPool::worker_loop(int id) {
  // Every worker passes every job once, in order: runs it, or skips it when the others have completed it already.
  for (uint64_t seq = 0;; ++seq) {
    if (!wait_for_job(seq)) return;
    Job* job = slots_[seq % kSlots].load(std::memory_order_acquire);  // set before posted_, cleared after leave()
    if (completed_.load(std::memory_order_acquire) <= seq && run_job(*job, id)) complete(seq, *job);
    leave(seq, job);
  }
}

void ThreadPool::leave(uint64_t seq, Job* job) {
  if (job->refs_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  std::shared_ptr<Job> last = std::move(job->self_);  // freed on return unless queue_ or a waiter still holds it
  slots_[seq % kSlots].store(nullptr, std::memory_order_release);
}

}  // namespace ktrans

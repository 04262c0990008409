// ThreadPool: a fixed set of worker threads for data-parallel loops.
//
// ParallelFor(n, fn) runs fn(i) for i in [0, n) across the workers and the
// calling thread, and returns when all are done. Calls from several threads
// at once are safe (each waits for its own work). fn must not throw. The
// destructor joins the workers; no ParallelFor may be running then.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

class ThreadPool {
 public:
  // `threads` workers (0: hardware_concurrency() - 1, at least 0 workers).
  explicit ThreadPool(size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t num_workers() const { return workers_.size(); }
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);
  // Runs `task` on a worker (or inline when the pool has none). Returns at
  // once; the task must not outlive what it references.
  void Submit(std::function<void()> task);

 private:
  void Work() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // set in the constructor, joined in the destructor
};

// Runs fn(i) for i in [0, n) on `pool`, or inline when pool is null.
void ParallelForOrInline(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn);

}  // namespace kvring

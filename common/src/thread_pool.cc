#include "kvring/common/thread_pool.h"

#include <pthread.h>

#include <atomic>
#include <memory>

namespace kvring {

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) {
    const unsigned hw = std::thread::hardware_concurrency();
    threads = hw > 1 ? hw - 1 : 0;
  }
  for (size_t i = 0; i < threads; ++i) {
    workers_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "kvring-pool");  // as top -H and /proc show it
      Work();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::Work() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stop_ || !p->tasks_.empty(); }, this));
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Helpers claim indices from `next`; the last to finish an index bumps
  // `done` to n under the mutex, which the caller awaits.
  struct Shared {
    explicit Shared(size_t total) : n(total) {}
    const size_t n;
    std::atomic<size_t> next{0};
    absl::Mutex mu;
    size_t done ABSL_GUARDED_BY(mu) = 0;
  };
  auto shared = std::make_shared<Shared>(n);
  auto run = [shared, n, &fn] {
    size_t local = 0;
    for (size_t i; (i = shared->next.fetch_add(1)) < n;) {
      fn(i);
      ++local;
    }
    if (local > 0) {
      absl::MutexLock l(&shared->mu);
      shared->done += local;
    }
  };
  const size_t helpers = std::min(workers_.size(), n - 1);
  {
    absl::MutexLock l(&mu_);
    for (size_t i = 0; i < helpers; ++i) tasks_.emplace_back(run);
  }
  run();
  absl::MutexLock l(&shared->mu);
  shared->mu.Await(absl::Condition(
      +[](Shared* sh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(sh->mu) { return sh->done == sh->n; }, shared.get()));
}

void ThreadPool::Submit(std::function<void()> task) {
  if (workers_.empty()) {
    task();
    return;
  }
  absl::MutexLock l(&mu_);
  tasks_.push_back(std::move(task));
}

void ParallelForOrInline(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n, fn);
  } else {
    for (size_t i = 0; i < n; ++i) fn(i);
  }
}

}  // namespace kvring

// BackgroundTask: runs a function on a thread of its own whenever Kick() is
// called. Kicks that arrive while it runs coalesce into one more run, so a
// burst of kicks costs at most two runs. The destructor waits for a run in
// progress and stops the thread.
//
// Thread-safe: Kick() may be called from any thread, including from `fn`.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

class BackgroundTask {
 public:
  explicit BackgroundTask(std::function<void()> fn) : fn_(std::move(fn)), thread_([this] { Loop(); }) {}
  ~BackgroundTask() {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  BackgroundTask(const BackgroundTask&) = delete;
  BackgroundTask& operator=(const BackgroundTask&) = delete;

  void Kick() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock l(&mu_);
    kicked_ = true;
  }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_) {
    for (;;) {
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](BackgroundTask* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) { return t->kicked_ || t->stop_; }, this));
        if (stop_) return;
        kicked_ = false;
      }
      fn_();
    }
  }

  std::function<void()> fn_;
  absl::Mutex mu_;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace kvring

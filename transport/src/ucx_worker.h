// UcxWorkerLoop (internal to transport/): one UCP context and worker, owned
// by one progress thread. Every UCP call on the worker runs on that thread
// (the worker is single-threaded); other threads Post() closures to it and
// wake it through an eventfd. The loop sleeps in poll() on the worker's
// event fd and the eventfd when there is nothing to do.
#pragma once

#include <ucp/api/ucp.h>

#include "kvring/transport/ucx_rpc.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <memory>

#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvring::ucx_internal {

absl::Status UcsError(ucs_status_t s, const std::string& what);
// host:port -> sockaddr_in (IPv4 literal or "localhost").
absl::Status ToSockaddr(const std::string& host_port, sockaddr_storage* out, socklen_t* len);
// Identifies "the same host" for shared-memory transports: the kernel boot id
// plus the pid and IPC namespaces (processes in other containers differ).
std::string HostKey();
// The network interface that holds the IPv4 address of `host_port` ("lo" for
// 127.0.0.1); "" for 0.0.0.0 (every interface); INVALID_ARGUMENT when no
// interface holds it.
absl::StatusOr<std::string> NetDeviceOf(const std::string& host_port);

class UcxWorkerLoop {
 public:
  static absl::StatusOr<std::unique_ptr<UcxWorkerLoop>> Create(uint64_t features, const std::string& name,
                                                               const UcxLoopOptions& options);
  ~UcxWorkerLoop();
  UcxWorkerLoop(const UcxWorkerLoop&) = delete;
  UcxWorkerLoop& operator=(const UcxWorkerLoop&) = delete;

  ucp_worker_h worker() const { return worker_; }
  // Largest active-message header the worker accepts.
  size_t max_am_header() const { return max_am_header_; }
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Runs fn on the progress thread, asynchronously.
  void Post(std::function<void()> fn);
  // Runs fn on the progress thread and waits for it.
  template <typename Fn>
  auto Run(Fn&& fn) -> decltype(fn()) {
    if (on_loop_thread()) return fn();
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<Fn>(fn));
    auto fut = task->get_future();
    Post([task] { (*task)(); });
    return fut.get();
  }
  // Stops the thread after running `last` on it (closing endpoints etc.).
  void Stop(std::function<void()> last);
  // Runs `fn` on the loop thread about every `every` (set before traffic).
  void SetPeriodic(std::function<void()> fn, std::chrono::milliseconds every);
  // How often the thread has gone to sleep (UcxRpcServer::sleeps). Any thread.
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }
  // How long a waiter should poll before it sleeps: the current spin window
  // (UcxLoopOptions). Any thread.
  std::chrono::microseconds spin_window() const {
    return std::chrono::microseconds(streaming_.load(std::memory_order_relaxed) ? spin_max_us_ : spin_us_);
  }

 private:
  UcxWorkerLoop() = default;
  void Loop();
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  int spin_us_ = 0;      // UcxLoopOptions::spin_us, resolved
  int spin_max_us_ = 0;  // UcxLoopOptions::spin_max_us, resolved
  bool wakeup_ = true;
  // The last wake came within spin_max_us_ of the activity before it.
  std::atomic<bool> streaming_{false};
  std::atomic<uint64_t> sleeps_{0};
  size_t max_am_header_ = 0;
  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);  // posted to the loop thread
  std::atomic<bool> stop_{false};
  std::function<void()> periodic_;
  std::chrono::milliseconds periodic_every_{250};
  std::chrono::steady_clock::time_point next_periodic_{};
  std::thread thread_;
};

// Closes an endpoint at once (force: what is in flight is cancelled),
// progressing the worker until done. The endpoint must be in peer-failure
// mode (UCX refuses to force-close any other). Loop thread.
void CloseEndpoint(ucp_worker_h worker, ucp_ep_h ep);

}  // namespace kvring::ucx_internal

#include "ucx_worker.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvring/common/status_macros.h"

namespace kvring {

absl::Status ValidateUcxLoopOptions(const UcxLoopOptions& options) {
  for (auto [name, v] :
       {std::pair<const char*, int>{"ucx_spin_us", options.spin_us}, {"ucx_spin_max_us", options.spin_max_us}}) {
    if (v < -1 || v > 1000000) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be -1 (by core count) or 0..1000000, not ", v));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvring

namespace kvring::ucx_internal {

absl::Status UcsError(ucs_status_t s, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
      return absl::UnavailableError(msg);
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::OutOfRangeError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_NO_MEMORY:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status ToSockaddr(const std::string& host_port, sockaddr_storage* out, socklen_t* len) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", host_port, "' is not host:port"));
  }
  std::string host = host_port.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  std::memset(out, 0, sizeof(*out));
  auto* sa = reinterpret_cast<sockaddr_in*>(out);
  sa->sin_family = AF_INET;
  sa->sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &sa->sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("'", host, "' is not an IPv4 address"));
  }
  *len = sizeof(sockaddr_in);
  return absl::OkStatus();
}

absl::StatusOr<std::string> NetDeviceOf(const std::string& host_port) {
  sockaddr_storage ss;
  socklen_t len = 0;
  KVRING_RETURN_IF_ERROR(ToSockaddr(host_port, &ss, &len));
  const in_addr want = reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr;
  if (want.s_addr == htonl(INADDR_ANY)) return std::string();
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return absl::InternalError("getifaddrs failed");
  std::string name;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want.s_addr) {
      name = i->ifa_name;
      break;
    }
  }
  freeifaddrs(all);
  if (name.empty())
    return absl::InvalidArgumentError(absl::StrCat("no network interface has the address of ", host_port));
  return name;
}

absl::StatusOr<std::unique_ptr<UcxWorkerLoop>> UcxWorkerLoop::Create(uint64_t features, const std::string& name,
                                                                     const UcxLoopOptions& options) {
  KVRING_RETURN_IF_ERROR(ValidateUcxLoopOptions(options));
  std::unique_ptr<UcxWorkerLoop> l(new UcxWorkerLoop());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError(s, "ucp_config_read");
  // Shared-memory transports with peer-failure support, so that every
  // endpoint, on one host too, runs in UCX's peer-failure mode: that is what
  // lets an endpoint be closed at once (UCX 1.13 keeps an endpoint without
  // it, and the peer's shared-memory segments it attached, until the worker
  // is destroyed) and what reports a peer's death (the shared-memory
  // transports check that the peer process is alive).
  for (const char* key : {"MM_ERROR_HANDLING"}) {
    s = ucp_config_modify(config, key, "y");
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, absl::StrCat("setting UCX ", key));
    }
  }
  if (!options.net_devices.empty()) {
    s = ucp_config_modify(config, "NET_DEVICES", options.net_devices.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, "setting UCX network devices to " + options.net_devices);
    }
  }
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  p.features = features | (options.wakeup ? UCP_FEATURE_WAKEUP : 0);
  p.name = name.c_str();
  s = ucp_init(&p, config, &l->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError(s, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(l->context_, &wp, &l->worker_);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_create");
  ucp_worker_attr_t wa{};
  wa.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  if (ucp_worker_query(l->worker_, &wa) == UCS_OK) l->max_am_header_ = wa.max_am_header;
  if (options.wakeup) {
    s = ucp_worker_get_efd(l->worker_, &l->worker_fd_);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_get_efd");
  }
  l->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  // UcxLoopOptions::spin_us says why the default depends on the core count.
  const bool big_host = std::thread::hardware_concurrency() >= 8;
  l->spin_us_ = options.spin_us >= 0 ? options.spin_us : (big_host ? 20 : 0);
  l->spin_max_us_ = options.spin_max_us >= 0 ? options.spin_max_us : (big_host ? 2000 : 0);
  l->spin_max_us_ = std::max(l->spin_max_us_, l->spin_us_);
  l->wakeup_ = options.wakeup;
  if (l->wake_fd_ < 0) return absl::InternalError("eventfd failed");
  UcxWorkerLoop* raw = l.get();
  l->thread_ = std::thread([raw] { raw->Loop(); });
  return l;
}

UcxWorkerLoop::~UcxWorkerLoop() {
  if (thread_.joinable()) Stop(nullptr);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void UcxWorkerLoop::Post(std::function<void()> fn) {
  {
    absl::MutexLock g(&mu_);
    tasks_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  (void)w;
}

void UcxWorkerLoop::SetPeriodic(std::function<void()> fn, std::chrono::milliseconds every) {
  Run([&] {
    periodic_ = std::move(fn);
    periodic_every_ = every;
    next_periodic_ = std::chrono::steady_clock::now() + every;
  });
}

std::string HostKey() {
  std::string key;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, key);
  for (const char* ns : {"/proc/self/ns/pid", "/proc/self/ns/ipc"}) {
    char buf[128];
    const ssize_t n = ::readlink(ns, buf, sizeof(buf) - 1);
    if (n > 0) key.append(buf, static_cast<size_t>(n));
  }
  // Keep it to [0-9a-z]: it travels inside an address string.
  std::string out;
  for (char c : key) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z')) out.push_back(c);
  }
  return out;
}

void UcxWorkerLoop::Stop(std::function<void()> last) {
  if (!thread_.joinable()) return;
  Post([this, last = std::move(last)] {
    if (last) last();
    stop_.store(true);
  });
  thread_.join();
}

void UcxWorkerLoop::Loop() {
  pthread_setname_np(pthread_self(), "kvring-ucx");  // as top -H and /proc show it
  auto last_activity = std::chrono::steady_clock::now();
  while (!stop_.load()) {
    std::deque<std::function<void()>> todo;
    {
      absl::MutexLock g(&mu_);
      todo.swap(tasks_);
    }
    for (auto& t : todo) t();
    if (!todo.empty()) last_activity = std::chrono::steady_clock::now();
    if (stop_.load()) break;
    if (periodic_ && std::chrono::steady_clock::now() >= next_periodic_) {
      periodic_();
      next_periodic_ = std::chrono::steady_clock::now() + periodic_every_;
    }
    // Hybrid polling: keep progressing while there is activity and for a
    // spin after it (UcxLoopOptions: longer while the traffic streams), then
    // arm the worker and sleep.
    const bool streaming = streaming_.load(std::memory_order_relaxed);
    const auto spin_until =
        std::chrono::steady_clock::now() + std::chrono::microseconds(streaming ? spin_max_us_ : spin_us_);
    bool idle = true;
    do {
      if (ucp_worker_progress(worker_) != 0) idle = false;
      {
        absl::MutexLock g(&mu_);
        if (!tasks_.empty()) {
          idle = false;
          break;
        }
      }
    } while (std::chrono::steady_clock::now() < spin_until);
    if (!idle) {
      last_activity = std::chrono::steady_clock::now();
      continue;
    }
    if (!wakeup_) continue;  // busy poll: never sleeps
    if (worker_fd_ < 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    pollfd fds[2] = {{worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, 100);
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      ssize_t r = ::read(wake_fd_, &v, sizeof(v));
      (void)r;
    }
    // Streaming when this wake came soon after the last activity.
    const auto woke = std::chrono::steady_clock::now();
    const bool woke_by_message = (fds[0].revents | fds[1].revents) & POLLIN;
    streaming_.store(
        spin_max_us_ > spin_us_ && woke_by_message && woke - last_activity <= std::chrono::microseconds(spin_max_us_),
        std::memory_order_relaxed);
  }
  // No progress after `last`: it closed every endpoint (cancelling what was
  // in flight), and progress now could answer a peer's messages for a closed
  // endpoint with a new one (UCX 1.13's endpoint matching; the peer aborts).
}

void CloseEndpoint(ucp_worker_h worker, ucp_ep_h ep) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  for (int i = 0; i < 100000 && ucp_request_check_status(r) == UCS_INPROGRESS; ++i) ucp_worker_progress(worker);
  ucp_request_free(r);
}

}  // namespace kvring::ucx_internal

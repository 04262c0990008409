#include "kvring/common/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvring {

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Handle(const std::string& path, Handler handler, std::string content_type) {
  routes_[path] = Route{[h = std::move(handler)] { return Response{"200 OK", h()}; }, std::move(content_type)};
}

void HttpServer::HandleWithStatus(const std::string& path, StatusHandler handler, std::string content_type) {
  routes_[path] = Route{std::move(handler), std::move(content_type)};
}

absl::StatusOr<int> HttpServer::Start(const std::string& host, int port) {
  if (options_.max_connections < 1 || options_.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("HttpServer: max_connections must be >= 1 and request_timeout positive");
  }
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd_);
    fd_ = -1;
    return absl::InvalidArgumentError(absl::StrCat("metrics address is not an IPv4 address: ", host));
  }
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 128) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd_);
    fd_ = -1;
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port, ": ", err));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  thread_ = std::thread([this] { Loop(); });
  return static_cast<int>(ntohs(addr.sin_port));
}

void HttpServer::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

size_t HttpServer::open_connections() const { return open_.load(std::memory_order_relaxed); }

std::string HttpServer::Answer(const std::string& request) const {
  std::string status = "400 Bad Request", body = "bad request\n", type = "text/plain";
  if (request.rfind("GET ", 0) == 0) {
    const size_t end = request.find_first_of(" \r\n", 4);
    std::string path = request.substr(4, end == std::string::npos ? std::string::npos : end - 4);
    if (size_t q = path.find('?'); q != std::string::npos) path.resize(q);
    auto it = routes_.find(path);
    if (it != routes_.end()) {
      Response r = it->second.handler();
      status = std::move(r.status);
      body = std::move(r.body);
      type = it->second.content_type;
    } else {
      status = "404 Not Found";
      body = "not found\n";
    }
  } else if (request.find("\r\n") != std::string::npos || request.find('\n') != std::string::npos) {
    status = "405 Method Not Allowed";
    body = "only GET is served\n";
  }
  return absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

// One thread multiplexes every connection with poll(): a connection that
// sends nothing (or dribbles) holds a slot until its deadline, never the
// server. Beyond max_connections the oldest connection is dropped for the
// newcomer, so idle sockets cannot lock scrapers and probes out.
void HttpServer::Loop() {
  struct Conn {
    int fd;
    std::chrono::steady_clock::time_point deadline;
    std::string in, out;
    size_t sent = 0;
  };
  std::vector<Conn> conns;
  const auto timeout = absl::ToChronoMilliseconds(options_.request_timeout);
  auto close_at = [&](size_t i) {
    ::close(conns[i].fd);
    conns.erase(conns.begin() + static_cast<long>(i));
  };
  while (!stop_.load()) {
    std::vector<pollfd> fds;
    fds.reserve(conns.size() + 1);
    fds.push_back(pollfd{fd_, POLLIN, 0});
    for (const Conn& c : conns) fds.push_back(pollfd{c.fd, static_cast<short>(c.out.empty() ? POLLIN : POLLOUT), 0});
    ::poll(fds.data(), fds.size(), 50);
    const auto now = std::chrono::steady_clock::now();
    // Work on existing connections first (indices in `fds` are i + 1).
    for (size_t i = conns.size(); i-- > 0;) {
      Conn& c = conns[i];
      const short ev = fds[i + 1].revents;
      if (ev & (POLLERR | POLLNVAL)) {
        close_at(i);
        continue;
      }
      if (c.out.empty() && (ev & (POLLIN | POLLHUP))) {
        char buf[2048];
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
        if (n > 0) c.in.append(buf, static_cast<size_t>(n));
        const bool complete = c.in.find("\r\n\r\n") != std::string::npos || c.in.find("\n\n") != std::string::npos;
        if (n == 0 || complete || c.in.size() >= options_.max_request_bytes) {
          if (c.in.empty()) {
            close_at(i);
            continue;
          }
          c.out = Answer(c.in);
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          close_at(i);
          continue;
        }
      }
      if (!c.out.empty() && (ev & POLLOUT)) {
        const ssize_t w = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (w > 0) c.sent += static_cast<size_t>(w);
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          close_at(i);
          continue;
        }
        if (c.sent == c.out.size()) {
          close_at(i);
          continue;
        }
      }
      if (now > c.deadline) close_at(i);  // idle, dribbling or not reading its answer
    }
    if (fds[0].revents & POLLIN) {
      for (;;) {
        const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) break;
        if (conns.size() >= options_.max_connections) close_at(0);  // the oldest makes room
        conns.push_back(Conn{c, now + timeout, {}, {}, 0});
      }
    }
    open_.store(conns.size(), std::memory_order_relaxed);
  }
  for (Conn& c : conns) ::close(c.fd);
  open_.store(0, std::memory_order_relaxed);
}

}  // namespace kvring

#include "kvring/common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

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
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address is not an IPv4 address: ", host));
  }
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 16) != 0) {
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

void HttpServer::Loop() {
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    timeval tv{2, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[2048];
    ssize_t n = ::recv(c, buf, sizeof(buf) - 1, 0);
    std::string status = "400 Bad Request", body = "bad request\n", type = "text/plain";
    if (n > 0) {
      buf[n] = 0;
      std::string req(buf, static_cast<size_t>(n));
      if (req.rfind("GET ", 0) == 0) {
        size_t end = req.find(' ', 4);
        std::string path = req.substr(4, end == std::string::npos ? std::string::npos : end - 4);
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
      }
    }
    std::string resp = absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", type,
                                    "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
    size_t off = 0;
    while (off < resp.size()) {
      ssize_t w = ::send(c, resp.data() + off, resp.size() - off, MSG_NOSIGNAL);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    ::close(c);
  }
}

}  // namespace kvring

#include "kvring/common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvring {
namespace {

int ConnectTo(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{20, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// The whole answer to one request ("" when the server closed without one).
std::string Fetch(int port, const std::string& request) {
  const int fd = ConnectTo(port);
  if (fd < 0) return "";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

TEST(HttpServerTest, AnswersRoutesAndRefusesTheRest) {
  HttpServer s;
  s.Handle("/metrics", [] { return std::string("kvring_up 1\n"); });
  s.HandleWithStatus("/healthz", [] { return HttpServer::Response{"503 Service Unavailable", "down\n"}; });
  absl::StatusOr<int> port = s.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  std::string r = Fetch(*port, "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_NE(r.find("200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("kvring_up 1"), std::string::npos) << r;
  EXPECT_NE(Fetch(*port, "GET /healthz?x=1 HTTP/1.1\r\nHost: a\r\n\r\n").find("503"), std::string::npos);
  EXPECT_NE(Fetch(*port, "GET /nope HTTP/1.0\r\n\r\n").find("404"), std::string::npos);
  EXPECT_NE(Fetch(*port, "POST /metrics HTTP/1.0\r\n\r\n").find("405"), std::string::npos);
}

// The probe's finding: a serial server let each idle connection block it for
// its read timeout, so 20 idle sockets timed out /metrics and /healthz. Here
// the request timeout is long (30 s): a serial server would answer after
// 20 x 30 s; a multiplexing one answers at once.
TEST(HttpServerTest, IdleConnectionsDoNotDelayOthers) {
  HttpServerOptions o;
  o.request_timeout = absl::Seconds(30);
  HttpServer s(o);
  s.Handle("/metrics", [] { return std::string("kvring_up 1\n"); });
  s.HandleWithStatus("/healthz", [] { return HttpServer::Response{"200 OK", "ok\n"}; });
  absl::StatusOr<int> port = s.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(ConnectTo(*port));
  // A client that sends half a request and stops.
  ::send(idle[0], "GET /met", 8, MSG_NOSIGNAL);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(Fetch(*port, "GET /healthz HTTP/1.0\r\n\r\n").find("200 OK"), std::string::npos);
  EXPECT_NE(Fetch(*port, "GET /metrics HTTP/1.0\r\n\r\n").find("kvring_up 1"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  for (int fd : idle) ::close(fd);
}

TEST(HttpServerTest, ClosesIdleConnectionsAtTheirDeadlineAndCapsTheirNumber) {
  HttpServerOptions o;
  o.request_timeout = absl::Milliseconds(200);
  o.max_connections = 8;
  HttpServer s(o);
  s.Handle("/metrics", [] { return std::string("m\n"); });
  absl::StatusOr<int> port = s.Start("127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  std::vector<int> idle;
  for (int i = 0; i < 30; ++i) idle.push_back(ConnectTo(*port));
  // Over the cap the oldest make room: a scrape still gets through.
  EXPECT_NE(Fetch(*port, "GET /metrics HTTP/1.0\r\n\r\n").find("200 OK"), std::string::npos);
  EXPECT_LE(s.open_connections(), 8u);
  // The idle ones are closed by the server (recv sees EOF) after the deadline.
  char c;
  for (int fd : idle) {
    EXPECT_EQ(::recv(fd, &c, 1, 0), 0);
    ::close(fd);
  }
  for (int i = 0; i < 100 && s.open_connections() > 0; ++i) ::usleep(20000);
  EXPECT_EQ(s.open_connections(), 0u);
}

}  // namespace
}  // namespace kvring

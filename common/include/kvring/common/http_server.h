// A small HTTP/1.0 server for scrape endpoints (/metrics, /healthz).
//
// Serves GET requests on one background thread that multiplexes every
// connection with poll(): connections are served concurrently, so an idle
// or slow client never delays another (a readiness probe keeps answering
// with any number of idle sockets open). Each connection has
// `request_timeout` to send its request and read the answer, then it is
// closed; beyond `max_connections` the oldest is dropped for the newcomer.
// Each registered handler returns the body for its path; unknown paths get
// 404, other methods 405. Start() binds and returns the port (useful with
// port 0). The destructor stops the thread and closes every socket.
// Handlers run on the server thread and must be thread-safe with respect to
// the rest of the process; they should be quick (they are not interrupted).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvring {

struct HttpServerOptions {
  // Connections served at once; a new one beyond it closes the oldest.
  // Default: 64.
  size_t max_connections = 64;
  // Time a connection has to send its request and take the answer.
  // Default: 2 s.
  absl::Duration request_timeout = absl::Seconds(2);
  // A request (line + headers) longer than this is answered as it stands.
  // Default: 8 KiB.
  size_t max_request_bytes = 8 << 10;
};

class HttpServer {
 public:
  using Handler = std::function<std::string()>;
  explicit HttpServer(HttpServerOptions options = {}) : options_(options) {}
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Register before Start(). `content_type` e.g. "text/plain; version=0.0.4".
  void Handle(const std::string& path, Handler handler, std::string content_type = "text/plain");
  // A handler that also chooses the status line (e.g. "503 Service
  // Unavailable" from a health check).
  struct Response {
    std::string status = "200 OK";
    std::string body;
  };
  using StatusHandler = std::function<Response()>;
  void HandleWithStatus(const std::string& path, StatusHandler handler, std::string content_type = "text/plain");
  // Binds host:port (port 0 = any) and starts serving; returns the port.
  absl::StatusOr<int> Start(const std::string& host, int port);
  void Stop();
  // Connections open now (tests and diagnostics).
  size_t open_connections() const;

 private:
  void Loop();
  // The full answer (status line, headers, body) to one request.
  std::string Answer(const std::string& request) const;
  HttpServerOptions options_;
  std::atomic<size_t> open_{0};
  struct Route {
    StatusHandler handler;
    std::string content_type;
  };
  std::map<std::string, Route> routes_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvring

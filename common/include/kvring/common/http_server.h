// A tiny HTTP/1.0 server for scrape endpoints (/metrics, /healthz).
//
// Serves GET requests on one background thread, one connection at a time
// (scrapers are few and responses small). Each registered handler returns the
// body for its path; unknown paths get 404. Start() binds and returns the
// port (useful with port 0). The destructor stops the thread and closes the
// socket. Handlers run on the server thread and must be thread-safe with
// respect to the rest of the process.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvring {

class HttpServer {
 public:
  using Handler = std::function<std::string()>;
  HttpServer() = default;
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

 private:
  void Loop();
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

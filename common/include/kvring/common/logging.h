// Minimal leveled logging to stderr: `KVRING_LOG(INFO) << "text";`.
//
// Thread-safe: each statement is written with one write(2). The level is
// process-wide (the one deliberate piece of process state in kvring: a log
// threshold), set once at start-up by the binary from its --log_level flag.
// Never log payload bytes.
#pragma once

#include <sstream>
#include <string_view>

namespace kvring {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warning", "error"; false when unknown.
bool ParseLogLevel(std::string_view text, LogLevel* out);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

}  // namespace kvring

#define KVRING_LOG_LEVEL_DEBUG ::kvring::LogLevel::kDebug
#define KVRING_LOG_LEVEL_INFO ::kvring::LogLevel::kInfo
#define KVRING_LOG_LEVEL_WARNING ::kvring::LogLevel::kWarning
#define KVRING_LOG_LEVEL_ERROR ::kvring::LogLevel::kError

namespace kvring {
// Lets KVRING_LOG be one expression (no dangling else inside an if).
struct LogVoidify {
  void operator&(std::ostream&) {}
};
}  // namespace kvring

#define KVRING_LOG(severity)                              \
  (KVRING_LOG_LEVEL_##severity < ::kvring::GetLogLevel()) \
      ? (void)0                                           \
      : ::kvring::LogVoidify() & ::kvring::LogMessage(KVRING_LOG_LEVEL_##severity, __FILE__, __LINE__).stream()

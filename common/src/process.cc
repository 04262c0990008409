#include "kvring/common/process.h"

#include <pthread.h>

#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  // A write past the file-size limit (ulimit -f, a full quota) fails with
  // EFBIG and reaches the caller as an error instead of killing the process.
  std::signal(SIGXFSZ, SIG_IGN);
}

void DisableMutexDeadlockDetection() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

int WaitForTerminationSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read secret file '", path, "'"));
  std::string line;
  std::getline(in, line);
  std::string out(absl::StripAsciiWhitespace(line));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("secret file '", path, "' is empty"));
  return out;
}

absl::StatusOr<std::string> TokenFromFlags(const std::string& value, const std::string& file, const std::string& flag,
                                           bool check_config) {
  if (file.empty() && value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " or --", flag, "_file is required"));
  }
  if (file.empty() || check_config) return value;
  absl::StatusOr<std::string> t = ReadSecretFile(file);
  if (!t.ok()) return absl::Status(t.status().code(), absl::StrCat("--", flag, "_file: ", t.status().message()));
  return t;
}

absl::StatusOr<std::string> HostBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string line;
  if (!in || !std::getline(in, line)) return absl::NotFoundError("cannot read /proc/sys/kernel/random/boot_id");
  std::string id(absl::StripAsciiWhitespace(line));
  if (id.empty()) return absl::NotFoundError("/proc/sys/kernel/random/boot_id is empty");
  return id;
}

absl::StatusOr<HostPort> ParseHostPort(const std::string& s) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0)
    return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not host:port"));
  HostPort hp;
  hp.host = s.substr(0, colon);
  if (!absl::SimpleAtoi(s.substr(colon + 1), &hp.port) || hp.port < 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", s, "' has a bad port"));
  }
  return hp;
}

}  // namespace kvring

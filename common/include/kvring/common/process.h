// Helpers for kvring's binaries: signals, secrets, host:port parsing.
#pragma once

#include <csignal>
#include <string>

#include "absl/status/statusor.h"

namespace kvring {

// Blocks SIGINT/SIGTERM in the calling thread (call first in main, before
// any thread starts, so every thread inherits the mask), and ignores
// SIGPIPE and SIGXFSZ (their errors come back from the write instead).
void BlockTerminationSignals();
// Waits for SIGINT or SIGTERM; returns the signal number.
int WaitForTerminationSignal();

// The first line of a file, trimmed (for tokens kept out of argv).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// This host's identity for same-host checks: the kernel's boot id
// (/proc/sys/kernel/random/boot_id; new at every boot, shared by every
// process and container of the host). NOT_FOUND where it cannot be read.
absl::StatusOr<std::string> HostBootId();

struct HostPort {
  std::string host;
  int port = 0;
};
// "host:port" with port in [0, 65535].
absl::StatusOr<HostPort> ParseHostPort(const std::string& s);

}  // namespace kvring

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

// Turns off abseil's mutex deadlock detection for this process. Debian's
// abseil is built with it on: every Mutex::Lock then records lock-order
// edges in a process-wide graph (behind one global lock) and, now and then,
// a stack trace, which makes a lock 4x and a nested pair 7x as expensive
// (bench/mutex_bench). The daemons, the CLI and the C ABI's clients (the
// engine's process) call it once at start; the tests keep detection on.
void DisableMutexDeadlockDetection();

// The first line of a file, trimmed (for tokens kept out of argv).
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);
// A token given as --<flag> (`value`) or --<flag>_file (`file`, read with
// ReadSecretFile; the file wins). One of them is required. With
// `check_config` the file is not read and `value` comes back as it is (""
// when only the file was given). Errors name the flag.
absl::StatusOr<std::string> TokenFromFlags(const std::string& value, const std::string& file, const std::string& flag,
                                           bool check_config);

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

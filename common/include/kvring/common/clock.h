// Clock: the source of time for timeouts and heartbeats, injectable so tests
// advance time instead of sleeping. SystemClock is the real one; FakeClock
// moves only when told. Both are thread-safe.
#pragma once

#include <atomic>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvring {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class SystemClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1700000000)) : nanos_(absl::ToUnixNanos(start)) {}
  absl::Time Now() const override { return absl::FromUnixNanos(nanos_.load()); }
  void Advance(absl::Duration d) { nanos_ += absl::ToInt64Nanoseconds(d); }

 private:
  std::atomic<int64_t> nanos_;
};

}  // namespace kvring

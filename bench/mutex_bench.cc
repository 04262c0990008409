// What abseil's mutex deadlock detection costs a lock (Debian's abseil is
// built with it on; kvring's binaries and the C ABI's clients turn it off,
// kvring/common/process.h): one Lock/Unlock, and a nested pair (a lock taken
// while holding another: the case that adds lock-order edges to the
// process-wide graph), with detection as Debian ships it and off, in one run.
// Threads: 1 and 4 (the graph sits behind one global lock).
//   build/bench/mutex_bench
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"

namespace {

void SetDetection(const benchmark::State& st) {
  absl::SetMutexDeadlockDetectionMode(st.range(0) ? absl::OnDeadlockCycle::kAbort : absl::OnDeadlockCycle::kIgnore);
}

void BM_Lock(benchmark::State& st) {
  if (st.thread_index() == 0) SetDetection(st);
  absl::Mutex mu;
  for (auto _ : st) {
    mu.Lock();
    mu.Unlock();
  }
}

void BM_NestedPair(benchmark::State& st) {
  if (st.thread_index() == 0) SetDetection(st);
  absl::Mutex a, b;
  for (auto _ : st) {
    a.Lock();
    b.Lock();
    b.Unlock();
    a.Unlock();
  }
}

// Arg: 1 = detection on (kAbort: what a build without NDEBUG defaults to), 0 = off.
BENCHMARK(BM_Lock)->ArgName("detection")->Arg(1)->Arg(0)->Threads(1)->Threads(4);
BENCHMARK(BM_NestedPair)->ArgName("detection")->Arg(1)->Arg(0)->Threads(1)->Threads(4);

}  // namespace

BENCHMARK_MAIN();

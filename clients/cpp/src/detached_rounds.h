// Detached device steps: rounds of a step on the engine's stream whose
// replies the engine's thread does not wait for (ClientOptions::
// detach_device_steps).
//
// A detached round has sent every job's request, queued on the engine's
// stream a wait on each job's word (the node's stream sets it when the
// job's work is done: DeviceExchange.done_flag_offset) and the merge of the
// partials the plan expects. Its replies are collected here, on a thread of
// this object's own, in the order the rounds were handed over:
// - a job whose node answered with its word set needs nothing;
// - a node that answered without setting it (its work was done before the
//   reply, or it answered with an event) has its word set here, after its
//   event where it gave one;
// - a job that failed (an error, a refused sequence, a refused exchange
//   buffer, a lost node) also has its word set here, so that the engine's
//   stream does not wait forever; the round's merge then merged what was
//   there, so the step's output is wrong: the failure is kept and the
//   engine's next call returns it (TakeError), and the round's exchange
//   buffer is never used again (its node may still write into it): kept
//   until this object goes, since freeing device memory waits for the whole
//   device, whose streams may wait for words only this thread sets.
// The exchange buffer goes back to its pool once every reply is in, ordered
// after the work queued on the engine's stream by then.
//
// At most `max_in_flight` rounds are outstanding: Add waits for the oldest
// first (the exchange buffers stay bounded, and the engine's thread runs at
// most that many steps ahead of the replies).
//
// Thread-safe. The destructor waits for every round handed over.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kvring/client/device_memory.h"
#include "node_channel.h"

namespace kvring {

class DetachedRounds {
 public:
  struct Job {
    std::unique_ptr<PendingAttend> pending;
    std::shared_ptr<NodeChannel> channel;  // held for the call
    std::string node_id;                   // for the error's message
    int sequences = 0;                     // the sequence statuses its reply may carry
    uint8_t* word = nullptr;               // its word in the exchange buffer, and the value that ends the wait
    uint32_t value = 0;
  };
  struct Round {
    std::vector<Job> jobs;
    DeviceMemory::Exchange xb;
    void* stream = nullptr;  // the engine's stream (the buffer's reuse is ordered after it)
    std::string what;        // "layer 3 of sequences a, b": for the error's message
  };

  DetachedRounds(DeviceMemory* dev, size_t max_in_flight);
  ~DetachedRounds();
  DetachedRounds(const DetachedRounds&) = delete;
  DetachedRounds& operator=(const DetachedRounds&) = delete;

  // Hands a sent round over (waits while max_in_flight are outstanding).
  void Add(Round r);
  // The first failure of a detached round not returned yet, and clears it.
  absl::Status TakeError();
  // Waits until every round handed over is collected, then TakeError().
  absl::Status Drain();

 private:
  void Loop();
  // Every reply of `r` in; its failures' words set. The first failure, or OK.
  absl::Status Collect(Round& r);
  absl::Status CollectJob(Job& j);

  DeviceMemory* const dev_;
  const size_t max_in_flight_;
  absl::Mutex mu_;
  std::deque<Round> rounds_ ABSL_GUARDED_BY(mu_);  // front: being collected
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<DeviceMemory::Exchange> dropped_ ABSL_GUARDED_BY(mu_);  // failed rounds' buffers
  std::thread thread_;
};

}  // namespace kvring

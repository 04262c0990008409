#include "detached_rounds.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvring/common/logging.h"
#include "kvring/protocol/wire.h"

namespace kvring {

DetachedRounds::DetachedRounds(DeviceMemory* dev, size_t max_in_flight)
    : dev_(dev), max_in_flight_(std::max<size_t>(1, max_in_flight)), thread_([this] { Loop(); }) {}

DetachedRounds::~DetachedRounds() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
  // (every round collected: no stream waits for a word of this thread's now)
  absl::MutexLock l(&mu_);
  dropped_.clear();
}

void DetachedRounds::Add(Round r) {
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](DetachedRounds* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->rounds_.size() < d->max_in_flight_; },
      this));
  rounds_.push_back(std::move(r));
}

absl::Status DetachedRounds::TakeError() {
  absl::MutexLock l(&mu_);
  return std::exchange(error_, absl::OkStatus());
}

absl::Status DetachedRounds::Drain() {
  {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(
        +[](std::deque<Round>* q) { return q->empty(); }, &rounds_));
  }
  return TakeError();
}

void DetachedRounds::Loop() {
  for (;;) {
    Round* r = nullptr;
    {
      absl::MutexLock l(&mu_);
      // (the destructor comes after the last Add: stop only once every round is in)
      mu_.Await(absl::Condition(
          +[](DetachedRounds* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) { return d->stop_ || !d->rounds_.empty(); },
          this));
      if (rounds_.empty()) return;
      r = &rounds_.front();  // (a deque's front stays put while others are pushed)
    }
    absl::Status s = Collect(*r);
    absl::MutexLock l(&mu_);
    if (!s.ok() && error_.ok()) error_ = std::move(s);
    rounds_.pop_front();
  }
}

absl::Status DetachedRounds::Collect(Round& r) {
  absl::Status first;
  for (Job& j : r.jobs) {
    absl::Status s = CollectJob(j);
    if (!s.ok() && first.ok()) {
      first = absl::Status(s.code(),
                           absl::StrCat("a detached step (", r.what, ") failed on node ", j.node_id, ": ", s.message(),
                                        "; its output and what was computed from it are "
                                        "wrong: recompute from before that step"));
    }
  }
  r.xb.UseOn(r.stream);
  if (!first.ok()) {
    // A node that failed may still write into it: never handed out again,
    // and kept here until this object goes (freeing device memory waits for
    // the whole device, whose streams may wait for words this thread sets).
    r.xb.Drop();
    absl::MutexLock l(&mu_);
    dropped_.push_back(std::move(r.xb));
  }
  r.xb = DeviceMemory::Exchange();  // back to the pool now
  return first;
}

absl::Status DetachedRounds::CollectJob(Job& j) {
  absl::StatusOr<v1::AttendResponse> r = j.pending->Wait();
  j.pending.reset();
  j.channel.reset();
  absl::Status failure;
  bool set_by_node = false;
  std::string event;
  if (!r.ok()) {
    failure = r.status();
  } else if (!r->device_refusal().empty()) {
    failure = absl::FailedPreconditionError(absl::StrCat("it refused the exchange buffer: ", r->device_refusal()));
  } else if (r->sequence_status_size() != 0 && r->sequence_status_size() != j.sequences) {
    failure = absl::DataLossError("its reply has the wrong number of sequence statuses");
  } else {
    for (const v1::Status& st : r->sequence_status()) {
      if (absl::Status ps = StatusFromProto(st); !ps.ok()) {
        failure = ps;
        break;
      }
    }
    set_by_node = r->done_flag();
    event = r->done_event();
  }
  if (!set_by_node) {
    // (after a failure at once: the engine's stream must go on)
    absl::Status w = dev_->SetWord(j.word, j.value, failure.ok() ? event : std::string());
    if (!w.ok()) {
      KVRING_LOG(ERROR) << "a detached step's word could not be set (" << w.message()
                        << "): the engine's stream waits for it";
      if (failure.ok()) failure = w;
    }
  }
  return failure;
}

}  // namespace kvring

// DetachedRounds (the client's collector of detached device steps) as a
// module: its replies from fake pending calls, its words set through a fake
// device memory that records them. The steps themselves, with real
// daemons on a GPU, are GpuExchangeTest.DetachedSteps* (tests/gpu).
#include "../../clients/cpp/src/detached_rounds.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace kvring {
namespace {

// (a build without CUDA never hands an exchange buffer back to its owner)
constexpr bool kBuffersComeBack = KVRING_TEST_HAVE_CUDA;

// Answers with `reply` (after `gate`, where given).
class FakePending final : public PendingAttend {
 public:
  FakePending(absl::StatusOr<v1::AttendResponse> reply, absl::Notification* gate = nullptr)
      : reply_(std::move(reply)), gate_(gate) {}
  absl::StatusOr<v1::AttendResponse> Wait() override {
    if (gate_ != nullptr) gate_->WaitForNotification();
    return reply_;
  }

 private:
  absl::StatusOr<v1::AttendResponse> reply_;
  absl::Notification* gate_;
};

// Records SetWord calls and the exchange buffers that come back.
class FakeDevice final : public DeviceMemory {
 public:
  struct SetCall {
    void* word;
    uint32_t value;
    std::string event;
  };
  std::vector<SetCall> sets;
  int returned = 0, dropped = 0;
  uint8_t buffer[256] = {};

  absl::Status SetWord(void* word, uint32_t value, const std::string& event) override {
    sets.push_back({word, value, event});
    return absl::OkStatus();
  }
  Exchange NewExchange() { return MakeExchange(buffer, sizeof(buffer), "h"); }

  absl::StatusOr<Staging> Pinned(size_t) override { return absl::UnimplementedError(""); }
  absl::StatusOr<Exchange> ExchangeBuffer(size_t, void*) override { return absl::UnimplementedError(""); }
  absl::Status CopyAsync(void*, const void*, size_t, void*) override { return absl::UnimplementedError(""); }
  absl::Status CopyDevice(absl::Span<const DeviceCopy>, void*) override { return absl::UnimplementedError(""); }
  absl::Status MergeRows(float*, float*, uint32_t, const float*, const float*, absl::Span<const int32_t>, int32_t*,
                         uint32_t, uint32_t, bool, void*, DType, void*) override {
    return absl::UnimplementedError("");
  }
  absl::Status Wait(void*) override { return absl::OkStatus(); }
  absl::StatusOr<std::string> RecordInputsEvent(void*) override { return absl::UnimplementedError(""); }
  absl::Status WaitNodeEvent(const std::string&, void*) override { return absl::UnimplementedError(""); }
  absl::Status WaitWord(const void*, uint32_t, void*) override { return absl::UnimplementedError(""); }
  bool WaitsOnWords() const override { return true; }
  absl::Status ToDevice(void*, const void*, size_t) override { return absl::UnimplementedError(""); }
  absl::Status ToHost(void*, const void*, size_t) override { return absl::UnimplementedError(""); }
  absl::StatusOr<ExportedAllocation> Export(const void*) override { return absl::UnimplementedError(""); }

 protected:
  void Return(uint8_t*, size_t, void*, bool) override {}
  void ReturnExchange(uint8_t*, size_t, std::string, bool drop, void*, bool) override {
    ++returned;
    dropped += drop ? 1 : 0;
  }
};

v1::AttendResponse Reply(bool done_flag, const std::string& event = "", int sequences = 0, bool refused = false) {
  v1::AttendResponse r;
  r.set_done_flag(done_flag);
  r.set_done_event(event);
  for (int i = 0; i < sequences; ++i) {
    v1::Status* s = r.add_sequence_status();
    if (refused && i == sequences - 1) {
      s->set_code(static_cast<int>(absl::StatusCode::kNotFound));
      s->set_message("sequence 'x' is not held here");
    }
  }
  return r;
}

DetachedRounds::Job JobOf(FakeDevice& dev, int j, absl::StatusOr<v1::AttendResponse> reply, int sequences = 1,
                          absl::Notification* gate = nullptr) {
  DetachedRounds::Job job;
  job.pending = std::make_unique<FakePending>(std::move(reply), gate);
  job.node_id = "node-" + std::to_string(j);
  job.sequences = sequences;
  job.word = dev.buffer + 4 * j;
  job.value = 100 + j;
  return job;
}

TEST(DetachedRoundsTest, WordsTheNodesDidNotSetAreSetAndTheBufferGoesBack) {
  FakeDevice dev;
  {
    DetachedRounds d(&dev, 4);
    DetachedRounds::Round r;
    r.jobs.push_back(JobOf(dev, 0, Reply(/*done_flag=*/true)));            // set by its node
    r.jobs.push_back(JobOf(dev, 1, Reply(false, "event-1")));              // answered with an event
    r.jobs.push_back(JobOf(dev, 2, Reply(false)));                         // answered once done
    r.jobs.push_back(JobOf(dev, 3, Reply(true, "", /*sequences=*/2), 2));  // statuses all OK
    r.xb = dev.NewExchange();
    r.what = "layer 3 of sequence 'a'";
    d.Add(std::move(r));
    EXPECT_TRUE(d.Drain().ok());
  }
  ASSERT_EQ(dev.sets.size(), 2u);
  EXPECT_EQ(dev.sets[0].word, dev.buffer + 4);
  EXPECT_EQ(dev.sets[0].value, 101u);
  EXPECT_EQ(dev.sets[0].event, "event-1");  // after the node's work
  EXPECT_EQ(dev.sets[1].word, dev.buffer + 8);
  EXPECT_EQ(dev.sets[1].event, "");
  EXPECT_EQ(dev.returned, kBuffersComeBack ? 1 : 0);
  EXPECT_EQ(dev.dropped, 0);
}

TEST(DetachedRoundsTest, AFailureSetsItsWordDropsTheBufferAndComesBackOnce) {
  FakeDevice dev;
  auto d = std::make_unique<DetachedRounds>(&dev, 4);
  DetachedRounds::Round r;
  r.jobs.push_back(JobOf(dev, 0, Reply(true)));
  r.jobs.push_back(JobOf(dev, 1, absl::UnavailableError("connection reset")));
  r.xb = dev.NewExchange();
  r.what = "layer 7 of sequence 'b'";
  d->Add(std::move(r));
  absl::Status s = d->Drain();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("layer 7 of sequence 'b'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("node-1"), std::string::npos) << s;
  EXPECT_NE(s.message().find("connection reset"), std::string::npos) << s;
  ASSERT_EQ(dev.sets.size(), 1u);  // the failed job's word: the stream goes on
  EXPECT_EQ(dev.sets[0].value, 101u);
  EXPECT_TRUE(d->TakeError().ok());  // returned once
  // Its node may still write into the buffer: kept while the collector runs,
  // then dropped (never handed out again).
  EXPECT_EQ(dev.returned, 0);
  d.reset();
  EXPECT_EQ(dev.returned, kBuffersComeBack ? 1 : 0);
  EXPECT_EQ(dev.dropped, kBuffersComeBack ? 1 : 0);
}

TEST(DetachedRoundsTest, ARefusedSequenceOrAWrongReplyIsAFailure) {
  FakeDevice dev;
  DetachedRounds d(&dev, 4);
  DetachedRounds::Round r;
  r.jobs.push_back(JobOf(dev, 0, Reply(true, "", 2, /*refused=*/true), 2));
  r.xb = dev.NewExchange();
  d.Add(std::move(r));
  absl::Status s = d.Drain();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  // The node set its word (it queued the rest): not set again.
  EXPECT_TRUE(dev.sets.empty());
  DetachedRounds::Round r2;
  r2.jobs.push_back(JobOf(dev, 0, Reply(true, "", 3), /*sequences=*/2));
  r2.xb = dev.NewExchange();
  d.Add(std::move(r2));
  EXPECT_TRUE(absl::IsDataLoss(d.Drain()));
  EXPECT_EQ(dev.sets.size(), 1u);  // a reply not understood: its word set here
  v1::AttendResponse refused;
  refused.set_device_refusal("no CUDA IPC here");
  DetachedRounds::Round r3;
  r3.jobs.push_back(JobOf(dev, 0, refused));
  r3.xb = dev.NewExchange();
  d.Add(std::move(r3));
  s = d.Drain();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_EQ(dev.sets.size(), 2u);
}

TEST(DetachedRoundsTest, AtMostMaxInFlightRoundsAreOutstanding) {
  FakeDevice dev;
  absl::Notification gate;
  DetachedRounds d(&dev, 1);
  DetachedRounds::Round r;
  r.jobs.push_back(JobOf(dev, 0, Reply(true), 1, &gate));
  d.Add(std::move(r));
  absl::Notification added;
  std::thread t([&] {
    DetachedRounds::Round r2;
    r2.jobs.push_back(JobOf(dev, 1, Reply(true)));
    d.Add(std::move(r2));
    added.Notify();
  });
  EXPECT_FALSE(added.WaitForNotificationWithTimeout(absl::Milliseconds(200)));  // the first is not in yet
  gate.Notify();
  EXPECT_TRUE(added.WaitForNotificationWithTimeout(absl::Seconds(10)));
  t.join();
  EXPECT_TRUE(d.Drain().ok());
}

}  // namespace
}  // namespace kvring

// UcxRpcServer and UcxRpcClient in one process: clients that abandon calls
// at every stage (before their send completes, while the server handles the
// request, while the reply is on its way, right after connecting, from
// another thread while a call is in flight), and clients that come and go.
// The server must keep serving every other client exactly: a UCX assertion
// would abort this test, and ASan (the sanitizer phase runs this test)
// catches any use of a freed request, reply or payload.
#include "kvring/transport/ucx_rpc.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "kvring/common/thread_pool.h"

namespace kvring {
namespace {

// A server whose handler waits `meta` microseconds, then answers with the
// request's payload reversed (so a reply is checked byte for byte).
class Echo {
 public:
  explicit Echo(const UcxLoopOptions& loop = {}) : pool_(4) {
    auto s = UcxRpcServer::Start(
        "127.0.0.1:0",
        [this](UcxRequest&& req, UcxReplier reply) {
          int64_t us = 0;
          (void)absl::SimpleAtoi(req.meta, &us);
          if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
          auto out = std::make_shared<std::vector<uint8_t>>(req.payload.rbegin(), req.payload.rend());
          ++served_;
          reply.Send(absl::OkStatus(), "ok", {absl::MakeConstSpan(*out)}, out);
        },
        &pool_, 64 << 20, nullptr, loop);
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) server_ = std::move(*s);
  }
  const std::string& address() const { return server_->address(); }
  int served() const { return served_.load(); }
  uint64_t sleeps() const { return server_->sleeps(); }

 private:
  ThreadPool pool_;
  std::unique_ptr<UcxRpcServer> server_;
  std::atomic<int> served_{0};
};

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed);
  return v;
}

// One call that must succeed and come back exact.
void ExpectExactCall(UcxRpcClient& c, size_t bytes, uint8_t seed) {
  const std::vector<uint8_t> in = Pattern(bytes, seed);
  std::vector<uint8_t> buf(bytes);
  const absl::Span<const uint8_t> part = absl::MakeConstSpan(in);
  absl::StatusOr<UcxReply> r = c.Call(7, "token", "0", {&part, 1}, absl::MakeSpan(buf), absl::Seconds(10));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->status.ok()) << r->status;
  EXPECT_EQ(r->meta, "ok");
  const std::vector<uint8_t>& got = r->payload_in_buffer ? buf : r->payload;
  ASSERT_EQ(got.size(), bytes);
  EXPECT_TRUE(std::equal(in.rbegin(), in.rend(), got.begin()));
}

TEST(UcxRpcTest, AnExactRoundTripSmallAndLarge) {
  Echo e;
  auto c = UcxRpcClient::Connect(e.address());
  ASSERT_TRUE(c.ok()) << c.status();
  for (size_t n : {size_t{0}, size_t{100}, size_t{64} << 10, size_t{4} << 20}) ExpectExactCall(**c, n, 3);
}

// Start/Finish: calls to several servers in flight from one thread (a
// fan-out with no thread per call), finished in another order than they
// were started, each exact; a call dropped unfinished leaves its reply
// buffer alone (its reply is discarded), and the client goes on.
TEST(UcxRpcTest, CallsStartedTogetherFromOneThreadFinishInAnyOrderAndDroppedOnesWriteNothing) {
  Echo a, b;
  auto ca = UcxRpcClient::Connect(a.address());
  auto cb = UcxRpcClient::Connect(b.address());
  ASSERT_TRUE(ca.ok() && cb.ok());
  constexpr int kCalls = 8;
  std::vector<std::vector<uint8_t>> in, buf;
  for (int i = 0; i < kCalls; ++i) {
    in.push_back(Pattern(1000 + 4096 * i, static_cast<uint8_t>(i)));
    buf.emplace_back(in.back().size());
  }
  std::vector<UcxPendingCall> calls;
  for (int i = 0; i < kCalls; ++i) {
    UcxRpcClient& c = i % 2 ? **cb : **ca;
    const absl::Span<const uint8_t> part = absl::MakeConstSpan(in[i]);
    // (the servers answer later calls sooner: replies arrive out of order)
    auto started = c.Start(7, "token", std::to_string((kCalls - i) * 300), {&part, 1}, absl::MakeSpan(buf[i]));
    ASSERT_TRUE(started.ok()) << started.status();
    calls.push_back(std::move(*started));
    in[i].push_back(0);  // the payload was staged: the caller's memory may change at once
    in[i].pop_back();
  }
  for (int i = kCalls - 1; i >= 0; --i) {
    UcxRpcClient& c = i % 2 ? **cb : **ca;
    absl::StatusOr<UcxReply> r = c.Finish(std::move(calls[i]), absl::Seconds(10));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(r->status.ok()) << r->status;
    ASSERT_TRUE(r->payload_in_buffer);
    EXPECT_TRUE(std::equal(in[i].rbegin(), in[i].rend(), buf[i].begin())) << "call " << i;
  }
  // A finished handle of one client is refused by another.
  {
    const absl::Span<const uint8_t> part = absl::MakeConstSpan(in[0]);
    auto started = (*ca)->Start(7, "token", "0", {&part, 1}, absl::MakeSpan(buf[0]));
    ASSERT_TRUE(started.ok());
    EXPECT_TRUE(absl::IsInvalidArgument((*cb)->Finish(std::move(*started), absl::Seconds(1)).status()));
  }
  // Dropped while the server still works on them: their buffers stay as
  // they were after the reply would have come.
  for (int i = 0; i < 4; ++i) {
    std::vector<uint8_t> mine(512, 0xAB);
    const std::vector<uint8_t> payload = Pattern(512, 9);
    const absl::Span<const uint8_t> part = absl::MakeConstSpan(payload);
    {
      auto started = (*ca)->Start(7, "token", "20000", {&part, 1}, absl::MakeSpan(mine));
      ASSERT_TRUE(started.ok());
    }  // dropped here
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    EXPECT_TRUE(std::all_of(mine.begin(), mine.end(), [](uint8_t v) { return v == 0xAB; }));
  }
  ExpectExactCall(**ca, 4096, 5);
  ExpectExactCall(**cb, 4096, 6);
}

// Calls a step apart (a decode loop: the engine computes between them): with
// the adaptive spin the server's progress thread stays awake across the gaps
// (it sleeps only once the calls stop); with a short fixed spin it sleeps
// before every call, whose wake-up the call then pays.
uint64_t ServerSleepsOverSpacedCalls(const UcxLoopOptions& loop, int calls, std::chrono::microseconds gap) {
  Echo e(loop);
  auto c = UcxRpcClient::Connect(e.address(), absl::Seconds(5), nullptr, loop);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return 0;
  for (int i = 0; i < 3; ++i) ExpectExactCall(**c, 64, 1);  // connected, warm
  const uint64_t before = e.sleeps();
  for (int i = 0; i < calls; ++i) {
    ExpectExactCall(**c, 256, static_cast<uint8_t>(i));
    const auto until = std::chrono::steady_clock::now() + gap;
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  return e.sleeps() - before;
}

TEST(UcxRpcTest, AdaptiveSpinKeepsTheProgressThreadAwakeWhileCallsStreamAndLetsItSleepAfter) {
  constexpr int kCalls = 200;
  UcxLoopOptions fixed;
  fixed.spin_us = 0;
  fixed.spin_max_us = 0;
  UcxLoopOptions adaptive;
  adaptive.spin_us = 0;
  adaptive.spin_max_us = 50000;  // generous: a 2-core CI machine may deschedule the spinning threads
  const uint64_t fixed_sleeps = ServerSleepsOverSpacedCalls(fixed, kCalls, std::chrono::microseconds(300));
  const uint64_t adaptive_sleeps = ServerSleepsOverSpacedCalls(adaptive, kCalls, std::chrono::microseconds(300));
  EXPECT_GE(fixed_sleeps, uint64_t{kCalls} * 3 / 4);
  EXPECT_LE(adaptive_sleeps, uint64_t{kCalls} / 4);

  // Once the calls stop, the adaptive loop sleeps again (an idle endpoint
  // costs no CPU): after its window it goes to sleep and stays asleep (each
  // poll lasts 100 ms: a handful of sleeps in a second, not a spinning core).
  Echo e(adaptive);
  auto c = UcxRpcClient::Connect(e.address(), absl::Seconds(5), nullptr, adaptive);
  ASSERT_TRUE(c.ok()) << c.status();
  for (int i = 0; i < 20; ++i) ExpectExactCall(**c, 64, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const uint64_t asleep = e.sleeps();
  EXPECT_GE(asleep, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LE(e.sleeps() - asleep, 10u);
}

TEST(UcxRpcTest, ClientsThatAbandonCallsAtEveryStageDoNotHurtTheServer) {
  Echo e;
  const std::vector<uint8_t> big = Pattern(4 << 20, 1), small = Pattern(256, 2);
  struct Stage {
    const char* what;
    const std::vector<uint8_t>* payload;
    absl::Duration timeout;
    const char* server_delay_us;
  };
  const Stage stages[] = {
      {"before the send completes", &big, absl::Nanoseconds(1), "0"},
      {"while the server handles it", &small, absl::Milliseconds(1), "20000"},
      {"while a large request is taken", &big, absl::Microseconds(200), "0"},
      {"while the reply travels", &big, absl::Milliseconds(2), "1500"},
  };
  for (const Stage& st : stages) {
    for (int i = 0; i < 6; ++i) {
      auto c = UcxRpcClient::Connect(e.address());
      ASSERT_TRUE(c.ok()) << st.what << ": " << c.status();
      const absl::Span<const uint8_t> part = absl::MakeConstSpan(*st.payload);
      std::vector<uint8_t> buf(st.payload->size());
      // Whatever it answers (a reply or UNAVAILABLE), it returns by its
      // deadline plus a margin and never crashes; the client then goes away
      // with the call possibly still in flight on both sides.
      const auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<UcxReply> r =
          (*c)->Call(7, "token", st.server_delay_us, {&part, 1}, absl::MakeSpan(buf), st.timeout);
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3)) << st.what;
      if (!r.ok()) EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << st.what << ": " << r.status();
      if (i % 2 == 1) {
        // A second call on a broken connection fails at once, cleanly.
        absl::StatusOr<UcxReply> again =
            (*c)->Call(7, "token", "0", {&part, 1}, absl::MakeSpan(buf), absl::Milliseconds(50));
        if (!again.ok()) EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
      }
    }
  }
  // Clients that connect and leave at once, and one destroyed while another
  // thread's call is in flight.
  for (int i = 0; i < 10; ++i) {
    auto c = UcxRpcClient::Connect(e.address());
    ASSERT_TRUE(c.ok()) << c.status();
  }
  {
    auto c = UcxRpcClient::Connect(e.address());
    ASSERT_TRUE(c.ok()) << c.status();
    std::shared_ptr<UcxRpcClient> shared(std::move(*c));
    std::thread caller([shared, &big] {
      const absl::Span<const uint8_t> part = absl::MakeConstSpan(big);
      std::vector<uint8_t> buf(big.size());
      (void)shared->Call(7, "token", "300000", {&part, 1}, absl::MakeSpan(buf), absl::Milliseconds(100));
    });
    caller.join();
  }
  // The server serves a new client exactly, and again after the stalled
  // replies have drained.
  auto c = UcxRpcClient::Connect(e.address());
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectExactCall(**c, 4 << 20, 9);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  ExpectExactCall(**c, 1000, 10);
  EXPECT_GT(e.served(), 0);
}

}  // namespace
}  // namespace kvring

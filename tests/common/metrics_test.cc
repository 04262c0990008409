#include "kvring/common/metrics.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvring {
namespace {

TEST(MetricsTest, CountersAddFromManyThreads) {
  MetricsRegistry r;
  CounterMetric* c = r.Counter("kvring_test_total", "help");
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([c] {
      for (int i = 0; i < 10000; ++i) c->Add();
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(c->value(), 40000u);
  EXPECT_EQ(r.Counter("kvring_test_total", "help"), c);  // same name -> same metric
}

TEST(MetricsTest, HistogramQuantilesFallInTheRightBucket) {
  HistogramMetric h({1, 2, 4, 8});
  for (int i = 0; i < 90; ++i) h.Observe(1.5);
  for (int i = 0; i < 10; ++i) h.Observe(6);
  EXPECT_EQ(h.count(), 100u);
  EXPECT_GT(h.Quantile(0.5), 1.0);
  EXPECT_LE(h.Quantile(0.5), 2.0);
  EXPECT_GT(h.Quantile(0.99), 4.0);
  EXPECT_LE(h.Quantile(0.99), 8.0);
}

TEST(MetricsTest, RendersPrometheusText) {
  MetricsRegistry r;
  r.Counter("kvring_puts_total", "Puts", "tenant=\"a\"")->Add(3);
  r.Gauge("kvring_free_pages", "Free pages")->Set(12);
  r.Histogram("kvring_latency_seconds", "Latency", "op=\"get\"", {0.001, 0.01})->Observe(0.005);
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE kvring_puts_total counter\nkvring_puts_total{tenant=\"a\"} 3\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("kvring_free_pages 12\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_bucket{op=\"get\",le=\"0.001\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_bucket{op=\"get\",le=\"0.01\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_count{op=\"get\"} 1\n"), std::string::npos) << text;
}

// Series of one family registered apart (as a daemon registers its
// per-operation metrics) still render as one family: one HELP and one TYPE,
// the series together. Prometheus refuses a scrape that repeats them.
TEST(MetricsTest, EachFamilyRendersOnceWithItsSeriesTogether) {
  MetricsRegistry r;
  r.Counter("kvring_requests_total", "Requests", "op=\"put\"")->Add(1);
  r.Histogram("kvring_request_seconds", "Latency", "op=\"put\"", {0.1});
  r.Counter("kvring_requests_total", "Requests", "op=\"get\"")->Add(2);
  r.Histogram("kvring_request_seconds", "Latency", "op=\"get\"", {0.1});
  r.Counter("kvring_evictions_total", "Evictions")->SetTotal(7);
  const std::string text = r.Render();
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("# HELP kvring_requests_total "), 1u) << text;
  EXPECT_EQ(count("# TYPE kvring_request_seconds "), 1u) << text;
  EXPECT_NE(text.find("kvring_requests_total{op=\"put\"} 1\nkvring_requests_total{op=\"get\"} 2\n"), std::string::npos)
      << text;
  EXPECT_LT(text.find("kvring_requests_total{op=\"get\"}"), text.find("# HELP kvring_request_seconds")) << text;
  EXPECT_NE(text.find("# TYPE kvring_evictions_total counter\nkvring_evictions_total 7\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace kvring

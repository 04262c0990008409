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
  for (int t = 0; t < 4; ++t) ts.emplace_back([c] { for (int i = 0; i < 10000; ++i) c->Add(); });
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
  EXPECT_NE(text.find("# TYPE kvring_puts_total counter\nkvring_puts_total{tenant=\"a\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_free_pages 12\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_bucket{op=\"get\",le=\"0.001\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_bucket{op=\"get\",le=\"0.01\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvring_latency_seconds_count{op=\"get\"} 1\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace kvring

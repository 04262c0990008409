// Counters, gauges and latency histograms, rendered in the Prometheus text
// exposition format.
//
// A MetricsRegistry is owned by the component that exports it (the daemon,
// the coordinator); it is not global. Metric objects are created once with
// Counter()/Gauge()/Histogram() and live as long as the registry; the returned
// pointers stay valid until it is destroyed. Updating a metric is lock-free
// and safe from any thread; registration and Render() take the registry's
// mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

class CounterMetric {
 public:
  void Add(uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  // Mirrors a cumulative count kept elsewhere (a store's eviction count):
  // `total` must never decrease.
  void SetTotal(uint64_t total) { value_.store(total, std::memory_order_relaxed); }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

class GaugeMetric {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double d);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Histogram with fixed upper bounds (seconds for latencies). Quantile() gives
// an estimate from the buckets (linear within a bucket).
class HistogramMetric {
 public:
  explicit HistogramMetric(std::vector<double> bounds);
  void Observe(double v);
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  double Quantile(double q) const;
  const std::vector<double>& bounds() const { return bounds_; }
  uint64_t bucket(size_t i) const { return buckets_[i].load(std::memory_order_relaxed); }

  // 1us .. ~30s, exponential: the default for request latencies.
  static std::vector<double> LatencyBounds();

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1 (last: +Inf)
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0};
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // `name` is a Prometheus metric name (e.g. kvring_put_total); `labels` an
  // optional preformatted label set such as `op="put"`. Calling again with
  // the same name and labels returns the same metric.
  CounterMetric* Counter(const std::string& name, const std::string& help, const std::string& labels = "");
  GaugeMetric* Gauge(const std::string& name, const std::string& help, const std::string& labels = "");
  HistogramMetric* Histogram(const std::string& name, const std::string& help, const std::string& labels = "",
                             std::vector<double> bounds = HistogramMetric::LatencyBounds());

  // Prometheus text format (version 0.0.4): each family once (HELP, TYPE,
  // then every labelled series of it), families in registration order.
  std::string Render() const;
  static constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

 private:
  enum class Kind { kCounter, kGauge, kHistogram };
  struct Entry {
    std::string name, help, labels;
    Kind kind;
    std::unique_ptr<CounterMetric> counter;
    std::unique_ptr<GaugeMetric> gauge;
    std::unique_ptr<HistogramMetric> histogram;
  };
  Entry* FindLocked(const std::string& name, const std::string& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inserts `e` after the last series of its family (so that Render() meets
  // each family's series together), or at the end for a new family.
  void AddLocked(std::unique_ptr<Entry> e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring

#include "kvring/common/metrics.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvring {

void GaugeMetric::Add(double d) {
  double cur = value_.load(std::memory_order_relaxed);
  while (!value_.compare_exchange_weak(cur, cur + d, std::memory_order_relaxed)) {
  }
}

HistogramMetric::HistogramMetric(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

std::vector<double> HistogramMetric::LatencyBounds() {
  std::vector<double> b;
  for (double v = 1e-6; v < 40.0; v *= 1.5) b.push_back(v);
  return b;
}

void HistogramMetric::Observe(double v) {
  size_t lo = 0, hi = bounds_.size();
  while (lo < hi) {  // first bound >= v
    size_t mid = (lo + hi) / 2;
    if (bounds_[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  buckets_[lo].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  double cur = sum_.load(std::memory_order_relaxed);
  while (!sum_.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

double HistogramMetric::Quantile(double q) const {
  const uint64_t n = count();
  if (n == 0) return 0;
  const double target = q * static_cast<double>(n);
  uint64_t seen = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    const uint64_t c = bucket(i);
    if (c > 0 && static_cast<double>(seen + c) >= target) {
      const double lo = i == 0 ? 0 : bounds_[i - 1];
      const double hi = i < bounds_.size() ? bounds_[i] : bounds_.back();
      const double frac = (target - static_cast<double>(seen)) / static_cast<double>(c);
      return lo + (hi - lo) * std::clamp(frac, 0.0, 1.0);
    }
    seen += c;
  }
  return bounds_.back();
}

MetricsRegistry::Entry* MetricsRegistry::FindLocked(const std::string& name, const std::string& labels) {
  for (auto& e : entries_) {
    if (e->name == name && e->labels == labels) return e.get();
  }
  return nullptr;
}

void MetricsRegistry::AddLocked(std::unique_ptr<Entry> e) {
  auto last = std::find_if(entries_.rbegin(), entries_.rend(), [&](const auto& x) { return x->name == e->name; });
  entries_.insert(last == entries_.rend() ? entries_.end() : last.base(), std::move(e));
}

CounterMetric* MetricsRegistry::Counter(const std::string& name, const std::string& help, const std::string& labels) {
  absl::MutexLock lock(&mu_);
  if (Entry* e = FindLocked(name, labels)) return e->counter.get();
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = labels;
  e->kind = Kind::kCounter;
  e->counter = std::make_unique<CounterMetric>();
  CounterMetric* out = e->counter.get();
  AddLocked(std::move(e));
  return out;
}

GaugeMetric* MetricsRegistry::Gauge(const std::string& name, const std::string& help, const std::string& labels) {
  absl::MutexLock lock(&mu_);
  if (Entry* e = FindLocked(name, labels)) return e->gauge.get();
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = labels;
  e->kind = Kind::kGauge;
  e->gauge = std::make_unique<GaugeMetric>();
  GaugeMetric* out = e->gauge.get();
  AddLocked(std::move(e));
  return out;
}

HistogramMetric* MetricsRegistry::Histogram(const std::string& name, const std::string& help, const std::string& labels,
                                            std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  if (Entry* e = FindLocked(name, labels)) return e->histogram.get();
  auto e = std::make_unique<Entry>();
  e->name = name;
  e->help = help;
  e->labels = labels;
  e->kind = Kind::kHistogram;
  e->histogram = std::make_unique<HistogramMetric>(std::move(bounds));
  HistogramMetric* out = e->histogram.get();
  AddLocked(std::move(e));
  return out;
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  std::string last_name;
  for (const auto& e : entries_) {  // a family's series are adjacent (AddLocked)
    if (e->name != last_name) {
      const char* type = e->kind == Kind::kCounter ? "counter" : e->kind == Kind::kGauge ? "gauge" : "histogram";
      absl::StrAppend(&out, "# HELP ", e->name, " ", e->help, "\n# TYPE ", e->name, " ", type, "\n");
      last_name = e->name;
    }
    const std::string lbl = e->labels.empty() ? "" : absl::StrCat("{", e->labels, "}");
    switch (e->kind) {
      case Kind::kCounter:
        absl::StrAppend(&out, e->name, lbl, " ", e->counter->value(), "\n");
        break;
      case Kind::kGauge:
        absl::StrAppend(&out, e->name, lbl, " ", absl::StrFormat("%.17g", e->gauge->value()), "\n");
        break;
      case Kind::kHistogram: {
        const HistogramMetric& h = *e->histogram;
        const std::string sep = e->labels.empty() ? "" : absl::StrCat(e->labels, ",");
        uint64_t cum = 0;
        for (size_t i = 0; i < h.bounds().size(); ++i) {
          cum += h.bucket(i);
          absl::StrAppend(&out, e->name, "_bucket{", sep, "le=\"", absl::StrFormat("%.6g", h.bounds()[i]), "\"} ", cum,
                          "\n");
        }
        cum += h.bucket(h.bounds().size());
        absl::StrAppend(&out, e->name, "_bucket{", sep, "le=\"+Inf\"} ", cum, "\n");
        absl::StrAppend(&out, e->name, "_sum", lbl, " ", absl::StrFormat("%.9g", h.sum()), "\n");
        absl::StrAppend(&out, e->name, "_count", lbl, " ", h.count(), "\n");
        break;
      }
    }
  }
  return out;
}

}  // namespace kvring

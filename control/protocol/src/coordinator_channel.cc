#include "kvring/protocol/coordinator_channel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpcpp/create_channel.h"
#include "kvring/protocol/wire.h"

namespace kvring {

absl::StatusOr<std::unique_ptr<CoordinatorChannel>> CoordinatorChannel::Create(
    const std::string& addresses, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  std::unique_ptr<CoordinatorChannel> c(new CoordinatorChannel());
  c->addresses_ = addresses;
  if (!credentials) credentials = grpc::InsecureChannelCredentials();
  for (absl::string_view a : absl::StrSplit(addresses, ',', absl::SkipWhitespace())) {
    a = absl::StripAsciiWhitespace(a);
    const size_t colon = a.rfind(':');
    if (colon == absl::string_view::npos || colon == 0 || colon + 1 == a.size()) {
      return absl::InvalidArgumentError(absl::StrCat("coordinator address '", a, "' is not host:port"));
    }
    if (std::find(c->names_.begin(), c->names_.end(), a) != c->names_.end()) continue;
    c->names_.emplace_back(a);
    c->channels_.push_back(std::make_unique<RenewableChannel>(std::string(a), credentials));
  }
  if (c->names_.empty()) return absl::InvalidArgumentError("no coordinator address given");
  return c;
}

std::string CoordinatorChannel::current() const { return names_[preferred_.load() % names_.size()]; }

absl::Status CoordinatorChannel::Call(const std::function<std::unique_ptr<grpc::ClientContext>()>& context,
                                      const Rpc& rpc) {
  const size_t n = names_.size();
  size_t next = preferred_.load(std::memory_order_relaxed) % n;
  std::vector<bool> tried(n, false);
  std::vector<std::string> said;
  grpc::Status last;
  for (size_t attempt = 0; attempt < n; ++attempt) {
    if (tried[next]) {  // (a named leader already tried: the first one not tried)
      next = std::find(tried.begin(), tried.end(), false) - tried.begin();
    }
    const size_t m = next;
    tried[m] = true;
    auto ctx = context();
    std::shared_ptr<grpc::Channel> channel = channels_[m]->Get();
    auto stub = v1::Coordinator::NewStub(channel);
    last = rpc(*stub, ctx.get());
    if (last.error_code() == grpc::StatusCode::UNAVAILABLE && ctx->GetServerTrailingMetadata().empty())
      channels_[m]->Renew(channel);  // (unreachable, not a standby's answer)
    if (last.ok() || (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
                      last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED)) {
      if (last.ok()) preferred_.store(m, std::memory_order_relaxed);
      if (last.ok() || n == 1) return FromGrpc(last);
      return absl::Status(FromGrpc(last).code(), absl::StrCat("coordinator ", names_[m], ": ", last.error_message()));
    }
    said.push_back(absl::StrCat(names_[m], ": ", last.error_message()));
    next = (m + 1) % n;
    const auto& trailers = ctx->GetServerTrailingMetadata();
    if (auto it = trailers.find("kvring-leader"); it != trailers.end()) {
      const std::string leader(it->second.data(), it->second.size());
      if (auto f = std::find(names_.begin(), names_.end(), leader); f != names_.end() && !tried[f - names_.begin()])
        next = f - names_.begin();
    }
  }
  if (n == 1) return FromGrpc(last);
  return absl::UnavailableError(absl::StrCat("no coordinator answered (", absl::StrJoin(said, "; "), ")"));
}

}  // namespace kvring

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
  c->creds_ = credentials;
  for (absl::string_view a : absl::StrSplit(addresses, ',', absl::SkipWhitespace())) {
    a = absl::StripAsciiWhitespace(a);
    const size_t colon = a.rfind(':');
    if (colon == absl::string_view::npos || colon == 0 || colon + 1 == a.size()) {
      return absl::InvalidArgumentError(absl::StrCat("coordinator address '", a, "' is not host:port"));
    }
    if (std::any_of(c->channels_.begin(), c->channels_.end(), [&](const auto& x) { return x->address() == a; }))
      continue;
    c->channels_.push_back(std::make_shared<RenewableChannel>(std::string(a), credentials));
  }
  if (c->channels_.empty()) return absl::InvalidArgumentError("no coordinator address given");
  {
    absl::MutexLock l(&c->mu_);
    c->preferred_ = c->channels_[0]->address();
  }
  return c;
}

std::string CoordinatorChannel::current() {
  absl::MutexLock l(&mu_);
  return preferred_;
}

std::shared_ptr<RenewableChannel> CoordinatorChannel::Learned(const std::string& leader) {
  absl::MutexLock l(&mu_);
  if (learned_ == nullptr || learned_->address() != leader)
    learned_ = std::make_shared<RenewableChannel>(leader, creds_);
  return learned_;
}

absl::Status CoordinatorChannel::Call(const std::function<std::unique_ptr<grpc::ClientContext>()>& context,
                                      const Rpc& rpc) {
  // This call's targets: the one that answered last first, then the list,
  // then a leader a standby named (learned, when it is not on the list).
  std::vector<std::shared_ptr<RenewableChannel>> targets;
  {
    absl::MutexLock l(&mu_);
    for (const auto& c : channels_)
      if (c->address() == preferred_) targets.push_back(c);
    if (learned_ != nullptr && learned_->address() == preferred_) targets.push_back(learned_);
    for (const auto& c : channels_)
      if (c->address() != preferred_) targets.push_back(c);
  }
  std::vector<std::string> said;
  grpc::Status last;
  for (size_t m = 0; m < targets.size(); ++m) {
    RenewableChannel& target = *targets[m];
    auto ctx = context();
    std::shared_ptr<grpc::Channel> channel = target.Get();
    last = rpc(*v1::Coordinator::NewStub(channel), ctx.get());
    const auto& trailers = ctx->GetServerTrailingMetadata();
    if (last.error_code() == grpc::StatusCode::UNAVAILABLE && trailers.empty())
      target.Renew(channel);  // (unreachable, not a standby's answer)
    if (last.ok() || (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
                      last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED)) {
      if (last.ok()) {
        absl::MutexLock l(&mu_);
        preferred_ = target.address();
      }
      if (last.ok() || targets.size() == 1) return FromGrpc(last);
      return absl::Status(FromGrpc(last).code(),
                          absl::StrCat("coordinator ", target.address(), ": ", last.error_message()));
    }
    said.push_back(absl::StrCat(target.address(), ": ", last.error_message()));
    if (auto it = trailers.find("kvring-leader"); it != trailers.end()) {
      // A standby named the leader: it is tried next (moved up, or added).
      const std::string leader(it->second.data(), it->second.size());
      auto f =
          std::find_if(targets.begin() + m + 1, targets.end(), [&](const auto& t) { return t->address() == leader; });
      const bool tried =
          std::any_of(targets.begin(), targets.begin() + m + 1, [&](const auto& t) { return t->address() == leader; });
      if (f != targets.end()) {
        std::rotate(targets.begin() + m + 1, f, f + 1);
      } else if (!tried) {
        targets.insert(targets.begin() + m + 1, Learned(leader));
      }
    }
  }
  if (targets.size() == 1) return FromGrpc(last);
  return absl::UnavailableError(absl::StrCat("no coordinator answered (", absl::StrJoin(said, "; "), ")"));
}

}  // namespace kvring

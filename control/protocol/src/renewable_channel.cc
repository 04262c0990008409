#include "kvring/protocol/renewable_channel.h"

#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvring {

RenewableChannel::RenewableChannel(std::string address, std::shared_ptr<grpc::ChannelCredentials> credentials)
    : address_(std::move(address)),
      credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()) {
  channel_ = Make();
  made_ = absl::Now();
}

std::shared_ptr<grpc::Channel> RenewableChannel::Make() const {
  grpc::ChannelArguments args;
  // Its own connections, not gRPC's process-wide pool (where another
  // channel's failed connection in backoff would hold this one's calls).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return grpc::CreateCustomChannel(address_, credentials_, args);
}

std::shared_ptr<grpc::Channel> RenewableChannel::Get() {
  absl::MutexLock l(&mu_);
  return channel_;
}

void RenewableChannel::Renew(const std::shared_ptr<grpc::Channel>& used) {
  absl::MutexLock l(&mu_);
  if (used != channel_ || absl::Now() - made_ < absl::Seconds(1)) return;
  channel_ = Make();
  made_ = absl::Now();
}

}  // namespace kvring

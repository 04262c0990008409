#include "kvring/control/etcd_client.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvring/protocol/wire.h"

namespace kvring {

absl::StatusOr<std::vector<std::string>> EtcdClient::ParseEndpoints(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    e = absl::StripAsciiWhitespace(e);
    if (!absl::ConsumePrefix(&e, "http://")) absl::ConsumePrefix(&e, "https://");
    const size_t colon = e.rfind(':');
    if (colon == absl::string_view::npos || colon == 0 || colon + 1 == e.size()) {
      return absl::InvalidArgumentError(absl::StrCat("etcd endpoint '", e, "' is not host:port"));
    }
    out.emplace_back(e);
  }
  if (out.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  return out;
}

std::string EtcdClient::PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's convention)
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  std::vector<std::string> cleaned;
  for (const auto& e : options.endpoints) {
    auto one = ParseEndpoints(e);
    if (!one.ok()) return one.status();
    cleaned.insert(cleaned.end(), one->begin(), one->end());
  }
  options.endpoints = cleaned;
  auto creds = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  std::unique_ptr<EtcdClient> c(new EtcdClient(std::move(options)));
  for (const auto& e : c->options_.endpoints) c->members_.push_back(std::make_unique<RenewableChannel>(e, creds));
  return c;
}

std::unique_ptr<grpc::ClientContext> EtcdClient::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options_.rpc_timeout));
  return ctx;
}

template <typename Rpc>
absl::Status EtcdClient::OnAnyMember(const char* what, Rpc&& rpc) {
  const size_t n = members_.size();
  const size_t first = preferred_.load(std::memory_order_relaxed) % n;
  std::vector<std::string> tried;
  for (size_t i = 0; i < n; ++i) {
    const size_t m = (first + i) % n;
    std::shared_ptr<grpc::Channel> channel = members_[m]->Get();
    grpc::Status s = rpc(*channel);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) members_[m]->Renew(channel);
    if (s.ok()) {
      preferred_.store(m, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    const grpc::StatusCode code = s.error_code();
    if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::DEADLINE_EXCEEDED) {
      // etcd answered: the request itself was refused. Another member would
      // say the same.
      return absl::Status(FromGrpc(s).code(),
                          absl::StrCat("etcd ", what, " at ", members_[m]->address(), ": ", s.error_message()));
    }
    tried.push_back(absl::StrCat(members_[m]->address(), " (", s.error_message(), ")"));
  }
  return absl::UnavailableError(absl::StrCat("etcd ", what, ": no member answered: ", absl::StrJoin(tried, "; ")));
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(const etcdserverpb::RangeRequest& req) {
  etcdserverpb::RangeResponse resp;
  absl::Status s = OnAnyMember("range", [&](grpc::Channel& ch) {
    resp.Clear();
    return etcdserverpb::KV::NewStub(ch.shared_from_this())->Range(Context().get(), req, &resp);
  });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& req) {
  etcdserverpb::TxnResponse resp;
  absl::Status s = OnAnyMember("txn", [&](grpc::Channel& ch) {
    resp.Clear();
    return etcdserverpb::KV::NewStub(ch.shared_from_this())->Txn(Context().get(), req, &resp);
  });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::LeaseGrantResponse> EtcdClient::LeaseGrant(absl::Duration ttl) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)))));
  etcdserverpb::LeaseGrantResponse resp;
  absl::Status s = OnAnyMember("lease grant", [&](grpc::Channel& ch) {
    resp.Clear();
    return etcdserverpb::Lease::NewStub(ch.shared_from_this())->LeaseGrant(Context().get(), req, &resp);
  });
  if (!s.ok()) return s;
  if (!resp.error().empty()) return absl::UnavailableError(absl::StrCat("etcd lease grant: ", resp.error()));
  return resp;
}

absl::Status EtcdClient::LeaseRevoke(int64_t id) {
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(id);
  etcdserverpb::LeaseRevokeResponse resp;
  return OnAnyMember("lease revoke", [&](grpc::Channel& ch) {
    return etcdserverpb::Lease::NewStub(ch.shared_from_this())->LeaseRevoke(Context().get(), req, &resp);
  });
}

absl::StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t id) {
  int64_t ttl = 0;
  absl::Status s = OnAnyMember("lease keep-alive", [&](grpc::Channel& ch) {
    auto ctx = Context();
    auto stub = etcdserverpb::Lease::NewStub(ch.shared_from_this());
    auto stream = stub->LeaseKeepAlive(ctx.get());
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(id);
    etcdserverpb::LeaseKeepAliveResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      stream->WritesDone();
      grpc::Status f = stream->Finish();
      return f.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream closed") : f;
    }
    stream->WritesDone();
    ttl = resp.ttl();
    ctx->TryCancel();  // the stream has nothing more to say
    stream->Finish();
    return grpc::Status::OK;
  });
  if (!s.ok()) return s;
  return ttl;
}

}  // namespace kvring

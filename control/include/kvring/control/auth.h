// Authentication: bearer tokens, their SHA-256 digests, and the tenant
// directory a daemon (or the coordinator) checks them against.
//
// Only digests are stored or sent between nodes; a token is shown once, when
// its tenant is created. TenantDirectory is thread-safe.
#pragma once

#include <functional>

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "kvring.pb.h"
#include "kvring/cache/block_key.h"
#include "kvring/protocol/wire.h"

namespace kvring {

std::string Sha256(std::string_view data);
// 32 random bytes (OpenSSL RAND_bytes), hex-encoded: 64 characters.
absl::StatusOr<std::string> GenerateToken();
// The token of "authorization: Bearer <token>"; UNAUTHENTICATED if absent.
absl::StatusOr<std::string> BearerToken(const grpc::ServerContext& ctx);

class TenantDirectory {
 public:
  // Replaces the table when `table` is newer than the one held.
  void Update(const v1::TenantTable& table) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t version() const ABSL_LOCKS_EXCLUDED(mu_);
  // UNAUTHENTICATED for a missing or unknown token.
  absl::StatusOr<v1::Tenant> Authenticate(const grpc::ServerContext& ctx) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::Tenant> ByToken(const std::string& token) const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<v1::Tenant> tenants() const ABSL_LOCKS_EXCLUDED(mu_);
  // Ids of deleted tenants, as of the table held (their namespaces are to be
  // reclaimed).
  std::vector<uint32_t> deleted_tenant_ids() const ABSL_LOCKS_EXCLUDED(mu_);
  // A token not in the table is looked up again in a table fetched after the
  // miss (`refresh` fetches it and calls Update()) before it is refused, so a
  // tenant created a moment ago works at once. Refreshes run at most once per
  // `min_interval`: a miss waits for the next one (at most about
  // `min_interval` plus one fetch), and one refresh answers every miss that
  // came before it, so a flood of bad tokens costs the coordinator one call
  // per interval. Call before serving; `refresh` runs on an authenticating
  // thread.
  void SetMissHandler(std::function<void()> refresh, absl::Duration min_interval) ABSL_LOCKS_EXCLUDED(refresh_mu_);

 private:
  absl::StatusOr<v1::Tenant> Find(const std::string& digest) const ABSL_LOCKS_EXCLUDED(mu_);
  mutable absl::Mutex refresh_mu_;  // held while a miss refresh runs
  std::function<void()> refresh_ ABSL_GUARDED_BY(refresh_mu_);
  absl::Duration refresh_interval_ ABSL_GUARDED_BY(refresh_mu_);
  mutable absl::Time last_refresh_ ABSL_GUARDED_BY(refresh_mu_) = absl::InfinitePast();  // when the last one began
  mutable absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, v1::Tenant> by_digest_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> deleted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvring

#include "kvring/control/auth.h"

#include <openssl/evp.h>
#include <openssl/rand.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvring {

std::string Sha256(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<char*>(md), len);
}

absl::StatusOr<std::string> GenerateToken() {
  unsigned char b[32];
  if (RAND_bytes(b, sizeof(b)) != 1) return absl::InternalError("RAND_bytes failed");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 0xf]);
  }
  return out;
}

absl::StatusOr<std::string> BearerToken(const grpc::ServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  std::string v(it->second.data(), it->second.size());
  if (!absl::StartsWith(v, "Bearer ") || v.size() <= 7) {
    return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
  }
  return v.substr(7);
}

void TenantDirectory::Update(const v1::TenantTable& table) {
  absl::MutexLock l(&mu_);
  if (table.tenants_version() < version_) return;
  by_digest_.clear();
  for (const auto& e : table.entries()) by_digest_[e.token_sha256()] = e.tenant();
  deleted_.assign(table.deleted_tenant_ids().begin(), table.deleted_tenant_ids().end());
  version_ = table.tenants_version();
}

uint64_t TenantDirectory::version() const {
  absl::MutexLock l(&mu_);
  return version_;
}

absl::StatusOr<v1::Tenant> TenantDirectory::Find(const std::string& digest) const {
  absl::MutexLock l(&mu_);
  auto it = by_digest_.find(digest);
  if (it == by_digest_.end()) return absl::UnauthenticatedError("unknown tenant token");
  return it->second;
}

void TenantDirectory::SetMissHandler(std::function<void()> refresh, absl::Duration min_interval) {
  absl::MutexLock l(&refresh_mu_);
  refresh_ = std::move(refresh);
  refresh_interval_ = min_interval;
}

absl::StatusOr<v1::Tenant> TenantDirectory::ByToken(const std::string& token) const {
  const std::string d = Sha256(token);
  absl::StatusOr<v1::Tenant> t = Find(d);
  if (t.ok()) return t;
  const absl::Time miss = absl::Now();
  refresh_mu_.Lock();
  bool answered = !refresh_;
  while (!answered) {
    // A refresh that began after the miss has answered it.
    if (last_refresh_ >= miss) {
      answered = true;
      break;
    }
    const absl::Duration wait = refresh_interval_ - (absl::Now() - last_refresh_);
    if (wait <= absl::ZeroDuration()) break;
    refresh_mu_.Unlock();  // others queue up behind the same next refresh
    absl::SleepFor(wait);
    refresh_mu_.Lock();
  }
  if (!answered) {
    last_refresh_ = absl::Now();
    refresh_();
  }
  refresh_mu_.Unlock();
  return Find(d);
}

absl::StatusOr<v1::Tenant> TenantDirectory::Authenticate(const grpc::ServerContext& ctx) const {
  absl::StatusOr<std::string> tok = BearerToken(ctx);
  if (!tok.ok()) return tok.status();
  return ByToken(*tok);
}

std::vector<uint32_t> TenantDirectory::deleted_tenant_ids() const {
  absl::MutexLock l(&mu_);
  return deleted_;
}

std::vector<v1::Tenant> TenantDirectory::tenants() const {
  absl::MutexLock l(&mu_);
  std::vector<v1::Tenant> out;
  for (const auto& [d, t] : by_digest_) out.push_back(t);
  return out;
}

}  // namespace kvring

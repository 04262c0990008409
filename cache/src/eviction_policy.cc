#include "kvring/cache/eviction_policy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvring/cache/lru_policy.h"
#include "kvring/cache/policies.h"
#include "kvring/common/quote.h"

namespace kvring {

std::vector<std::string> EvictionPolicyNames() { return {"lru", "s3fifo", "arc", "leaf-lru"}; }

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name, size_t num_slots) {
  if (name == "lru") return std::make_unique<LruPolicy>(num_slots);
  if (name == "s3fifo") return std::make_unique<S3FifoPolicy>(num_slots);
  if (name == "arc") return std::make_unique<ArcPolicy>(num_slots);
  if (name == "leaf-lru") return std::make_unique<LeafLruPolicy>(num_slots);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown eviction policy ", Quote(name), "; known: ", absl::StrJoin(EvictionPolicyNames(), ", ")));
}

}  // namespace kvring

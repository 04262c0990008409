#include "kvring/cache/eviction_policy.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvring/cache/lru_policy.h"

namespace kvring {

std::vector<std::string> EvictionPolicyNames() { return {"lru"}; }

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view name, size_t num_slots) {
  if (name == "lru") return std::make_unique<LruPolicy>(num_slots);
  return absl::InvalidArgumentError(absl::StrCat("unknown eviction policy '", std::string(name),
                                                 "'; known: ", absl::StrJoin(EvictionPolicyNames(), ", ")));
}

}  // namespace kvring

#include "kvring/cache/lru_policy.h"

#include "gtest/gtest.h"

namespace kvring {
namespace {

TEST(LruPolicyTest, EvictsLeastRecentlyUsedFirst) {
  LruPolicy p(8);
  for (SlotId s : {0, 1, 2, 3}) p.Admit(s, {});
  EXPECT_EQ(*p.Victim(), 0u);
  p.Touch(0);
  EXPECT_EQ(*p.Victim(), 1u);
  p.Remove(1, true);
  EXPECT_EQ(*p.Victim(), 2u);
}

TEST(LruPolicyTest, PinnedSlotsAreNeverVictims) {
  LruPolicy p(4);
  p.Admit(0, {});
  p.Admit(1, {});
  p.Pin(0);
  p.Pin(1);
  EXPECT_FALSE(p.Victim().has_value());
  p.Touch(0);  // touching a pinned slot must not make it evictable
  EXPECT_FALSE(p.Victim().has_value());
  p.Unpin(1);
  EXPECT_EQ(*p.Victim(), 1u);
}

TEST(LruPolicyTest, FactoryKnowsLruAndRejectsUnknownNames) {
  EXPECT_TRUE(MakeEvictionPolicy("lru", 4).ok());
  auto bad = MakeEvictionPolicy("mru", 4);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("lru"), std::string::npos);
}

}  // namespace
}  // namespace kvring

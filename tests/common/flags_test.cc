#include "kvring/common/flags.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"
#include "kvring/common/process.h"

namespace kvring {
namespace {

struct Args {
  std::vector<std::string> storage;
  std::vector<char*> argv;
  explicit Args(std::vector<std::string> a) : storage(std::move(a)) {
    for (auto& s : storage) argv.push_back(s.data());
  }
  int argc() { return static_cast<int>(argv.size()); }
};

TEST(FlagSetTest, ParsesEveryKindOfValue) {
  std::string s = "a";
  int64_t i = 1;
  uint64_t u = 2, bytes = 0;
  double d = 0.5;
  bool b = false, nb = true;
  absl::Duration dur = absl::Seconds(1);
  FlagSet f("prog", "test");
  f.AddString("s", &s, "");
  f.AddInt("i", &i, "");
  f.AddUint("u", &u, "");
  f.AddDouble("d", &d, "");
  f.AddBool("b", &b, "");
  f.AddBool("nb", &nb, "");
  f.AddDuration("dur", &dur, "");
  f.AddBytes("bytes", &bytes, "");
  Args a({"prog", "--s=hello", "--i", "-7", "--u=9", "--d=2.5", "--b", "--nonb", "--dur=250ms", "--bytes=64M"});
  ASSERT_TRUE(f.Parse(a.argc(), a.argv.data()).ok());
  EXPECT_EQ(s, "hello");
  EXPECT_EQ(i, -7);
  EXPECT_EQ(u, 9u);
  EXPECT_DOUBLE_EQ(d, 2.5);
  EXPECT_TRUE(b);
  EXPECT_FALSE(nb);
  EXPECT_EQ(dur, absl::Milliseconds(250));
  EXPECT_EQ(bytes, 64ull << 20);
}

TEST(FlagSetTest, UnknownFlagAndBadValueAreErrorsNamingTheFlag) {
  int64_t i = 0;
  FlagSet f("prog", "test");
  f.AddInt("port", &i, "");
  Args a({"prog", "--prot=1"});
  absl::Status s = f.Parse(a.argc(), a.argv.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prot"), std::string::npos);
  Args b({"prog", "--port=abc"});
  s = f.Parse(b.argc(), b.argv.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("port"), std::string::npos);
}

TEST(FlagSetTest, ConfigFileIsOverriddenByCommandLine) {
  const std::string path = ::testing::TempDir() + "/flags_test.conf";
  {
    std::ofstream out(path);
    out << "# comment\nport = 7000\nname = \"from file\"\n\n";
  }
  int64_t port = 0;
  std::string name;
  FlagSet f("prog", "test");
  f.AddInt("port", &port, "");
  f.AddString("name", &name, "");
  Args a({"prog", "--config", path, "--port=8000"});
  ASSERT_TRUE(f.Parse(a.argc(), a.argv.data()).ok());
  EXPECT_EQ(port, 8000);
  EXPECT_EQ(name, "from file");
  std::remove(path.c_str());
}

TEST(FlagSetTest, HelpListsFlagsWithDefaults) {
  int64_t port = 7000;
  FlagSet f("kvringd", "the node daemon");
  f.AddInt("port", &port, "gRPC port");
  Args a({"prog", "--help"});
  ASSERT_TRUE(f.Parse(a.argc(), a.argv.data()).ok());
  EXPECT_TRUE(f.help_requested());
  const std::string u = f.Usage();
  EXPECT_NE(u.find("--port=VALUE  (default: 7000)"), std::string::npos) << u;
  EXPECT_NE(u.find("gRPC port"), std::string::npos);
}

TEST(FlagSetTest, PositionalArgumentsOnlyWhenAccepted) {
  FlagSet f("prog", "test");
  Args a({"prog", "put", "x"});
  EXPECT_FALSE(f.Parse(a.argc(), a.argv.data()).ok());
  std::vector<std::string> pos;
  ASSERT_TRUE(f.Parse(a.argc(), a.argv.data(), &pos).ok());
  EXPECT_EQ(pos, (std::vector<std::string>{"put", "x"}));
}

TEST(ByteSizeTest, ParsesSuffixesAndRejectsGarbage) {
  uint64_t v;
  ASSERT_TRUE(ParseByteSize("4096", &v).ok());
  EXPECT_EQ(v, 4096u);
  ASSERT_TRUE(ParseByteSize("2G", &v).ok());
  EXPECT_EQ(v, 2ull << 30);
  EXPECT_FALSE(ParseByteSize("12Q", &v).ok());
  EXPECT_FALSE(ParseByteSize("", &v).ok());
  EXPECT_FALSE(ParseByteSize("99999999999999999999T", &v).ok());
}

// A token from --<flag> or --<flag>_file: the file wins, one is required,
// --check_config reads no file, and errors name the flag.
TEST(TokenFromFlagsTest, TheFileWinsOneIsRequiredAndCheckConfigReadsNoFile) {
  const std::string path = ::testing::TempDir() + "/token_from_flags";
  std::ofstream(path) << "  from-file \n";
  EXPECT_EQ(*TokenFromFlags("from-flag", "", "admin_token", false), "from-flag");
  EXPECT_EQ(*TokenFromFlags("from-flag", path, "admin_token", false), "from-file");
  EXPECT_EQ(*TokenFromFlags("", path, "admin_token", /*check_config=*/true), "");
  absl::StatusOr<std::string> none = TokenFromFlags("", "", "admin_token", false);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().message(), "--admin_token or --admin_token_file is required");
  absl::StatusOr<std::string> missing = TokenFromFlags("", path + ".absent", "cluster_token", false);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_EQ(missing.status().message().rfind("--cluster_token_file: ", 0), 0u) << missing.status();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvring

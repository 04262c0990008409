// What an outside black-box probe broke (tenancy, bad input, faults,
// metrics), each against real processes: a coordinator and kvringd daemons,
// the kvring CLI, and promtool where it is installed.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cluster_fixture.h"

namespace kvring::testing {
namespace {

grpc::Status DeleteTenant(Cluster& cl, const std::string& name) {
  auto stub = cl.CoordinatorStub();
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + cl.admin_token());
  v1::DeleteTenantRequest req;
  req.set_version(1);
  req.set_name(name);
  v1::DeleteTenantResponse resp;
  return stub->DeleteTenant(&ctx, req, &resp);
}

// CreateTenant through the client library, with no wait afterwards.
absl::StatusOr<std::string> CreateTenantNow(Cluster& cl, const std::string& name) {
  TenantSpec spec;
  spec.name = name;
  absl::StatusOr<CreatedTenant> t = CreateTenant(cl.coordinator_address(), cl.admin_token(), spec);
  if (!t.ok()) return t.status();
  return t->token;
}

uint64_t NodeBlocks(Client& c) {
  uint64_t n = 0;
  for (const NodeStats& s : c.Stats()) n += s.blocks;
  return n;
}

// Waits until `pred` holds (polling), or the timeout.
template <typename Pred>
bool Eventually(Pred pred, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (pred()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return pred();
}

// Runs a program; returns its exit code (or 128 + signal) and its output.
int RunProgram(const std::vector<std::string>& argv, std::string* output) {
  std::string cmd;
  for (const auto& a : argv) absl::StrAppend(&cmd, "'", a, "' ");
  cmd += "2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  output->clear();
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int st = pclose(p);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return WEXITSTATUS(st);
}

// A deleted name created again is a new tenant: it sees nothing of the old
// one. The old one's blocks are reclaimed in the background on a running
// daemon, and on a daemon that was down during the delete once it restarts
// (its cold tier brings them back first). The old tenant's live client gets
// an error, not a miss.
TEST(ProbeTest, ARecreatedTenantInheritsNothingAndDeletedBlocksAreReclaimed) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .write_through = true});
  ASSERT_TRUE(cl.Start());
  auto observer_token = cl.CreateTenant("observer");
  auto bob_token = cl.CreateTenant("bob");
  ASSERT_TRUE(observer_token.ok() && bob_token.ok());
  auto observer = cl.Connect(*observer_token);
  auto bob = cl.Connect(*bob_token);
  ASSERT_TRUE(observer.ok() && bob.ok());
  Blocks old = MakeChain(**bob, SmallLayout(), "m", 5, 12);
  ASSERT_TRUE((*bob)->Put(old.data).ok());
  // A sequence over the same blocks: stored under the same keys, so 12 blocks.
  ASSERT_TRUE((*bob)->PutSequence("bob-seq", 0, absl::MakeConstSpan(old.data).subspan(0, 4)).ok());
  EXPECT_EQ(NodeBlocks(**observer), 12u);

  ASSERT_TRUE(DeleteTenant(cl, "bob").ok());
  // The old client's lookup is an error that says why, not "0 blocks held".
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<size_t> n = (*bob)->LookupPrefix(old.keys);
    return !n.ok() && absl::IsUnauthenticated(n.status());
  })) << (*bob)->LookupPrefix(old.keys).status();
  EXPECT_TRUE(Eventually([&] { return NodeBlocks(**observer) == 0; })) << NodeBlocks(**observer);
  EXPECT_NE(cl.Log("node0.log").find("reclaimed 12 blocks and 1 sequences of 1 deleted tenant"), std::string::npos)
      << cl.Log("node0.log");

  auto bob2_token = cl.CreateTenant("bob");
  ASSERT_TRUE(bob2_token.ok());
  auto bob2 = cl.Connect(*bob2_token);
  ASSERT_TRUE(bob2.ok());
  EXPECT_NE((*bob2)->namespace_name(), (*bob)->namespace_name());
  EXPECT_EQ(*(*bob2)->LookupPrefix(old.keys), 0u);              // the exact old keys
  Blocks again = MakeChain(**bob2, SmallLayout(), "m", 5, 12);  // the same tokens
  EXPECT_EQ(*(*bob2)->LookupPrefix(again.keys), 0u);

  // Deleted while the daemon is down: reclaimed when it comes back.
  ASSERT_TRUE((*bob2)->Put(again.data).ok());
  EXPECT_EQ(NodeBlocks(**observer), 12u);
  cl.StopDaemon(0);
  ASSERT_TRUE(DeleteTenant(cl, "bob").ok());
  ASSERT_TRUE(cl.StartDaemon(0));
  ASSERT_TRUE(cl.WaitForNodesUp(1));
  auto observer2 = cl.Connect(*observer_token);
  ASSERT_TRUE(observer2.ok());
  EXPECT_TRUE(Eventually([&] { return NodeBlocks(**observer2) == 0; })) << NodeBlocks(**observer2);
  EXPECT_NE(cl.Log("node0.log").find("recovered 12 blocks"), std::string::npos) << cl.Log("node0.log");
}

// A tenant works the moment CreateTenant returns: the daemons ask the
// coordinator about a token they do not know before refusing it.
TEST(ProbeTest, ANewTenantIsServedTheMomentItIsCreated) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 2});
  ASSERT_TRUE(cl.Start());
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<std::string> token = CreateTenantNow(cl, "fresh" + std::to_string(i));
    ASSERT_TRUE(token.ok()) << token.status();
    auto c = cl.Connect(*token);
    ASSERT_TRUE(c.ok()) << c.status();
    Blocks b = MakeChain(**c, SmallLayout(), "m", 70 + i, 3);
    absl::StatusOr<PutReport> r = (*c)->Put(b.data);
    ASSERT_TRUE(r.ok()) << "tenant " << i << ": " << r.status();
    EXPECT_EQ(r->replicas_written, 6u);
  }
  // A bad token is still refused, promptly.
  auto bad = cl.Connect("no-such-token-0123456789abcdef0123456789");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << bad.status();
}

// A tenant table of several pages (~1.3 MB: 150 tenants with 64 long
// shared namespaces each) reaches every daemon: a tenant created after them
// works at once, and one of the first ones still does.
TEST(ProbeTest, DaemonsLearnATenantTableOfManyPages) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 2});
  ASSERT_TRUE(cl.Start());
  TenantSpec spec;
  for (int i = 0; i < 64; ++i)
    spec.shared_namespaces.push_back("shared/" + std::string(100, 'a' + i % 26) + std::to_string(i));
  std::string first_token;
  for (int t = 0; t < 150; ++t) {
    spec.name = "bulk" + std::to_string(t);
    absl::StatusOr<CreatedTenant> ct = CreateTenant(cl.coordinator_address(), cl.admin_token(), spec);
    ASSERT_TRUE(ct.ok()) << t << ": " << ct.status();
    if (t == 0) first_token = ct->token;
  }
  for (const std::string& name : {std::string("late"), std::string()}) {
    std::string token = first_token;
    if (!name.empty()) {
      absl::StatusOr<std::string> t = CreateTenantNow(cl, name);
      ASSERT_TRUE(t.ok()) << t.status();
      token = *t;
    }
    auto c = cl.Connect(token);
    ASSERT_TRUE(c.ok()) << c.status();
    Blocks b = MakeChain(**c, SmallLayout(), "m", 12, 2);
    absl::StatusOr<PutReport> r = (*c)->Put(b.data);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->replicas_written, 4u);
  }
  EXPECT_EQ(cl.Log("node0.log").find("Received message larger than max"), std::string::npos);
}

// A pinned put refused on some replica by the tenant's quota leaves no pins
// anywhere: the failed put's pins are taken back.
TEST(ProbeTest, AFailedPinnedPutLeavesNoPins) {
  Cluster cl(ClusterOptions{.nodes = 3, .replication = 2});
  ASSERT_TRUE(cl.Start());
  const uint64_t block = SmallLayout().bytes();
  auto token = cl.CreateTenant("pinner", {}, /*quota=*/3 * block);
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 9, 24);
  size_t ok_puts = 0, failed = 0;
  for (size_t i = 0; i < b.data.size(); ++i) {
    BlockData d = b.data[i];
    d.pin = true;
    absl::StatusOr<PutReport> r = (*c)->Put(absl::MakeConstSpan(&d, 1));
    if (r.ok()) {
      ++ok_puts;
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      ++failed;
    }
  }
  ASSERT_GT(failed, 0u);
  ASSERT_GT(ok_puts, 0u);
  uint64_t pinned = 0;
  for (const NodeStats& s : (*c)->Stats()) pinned += s.pinned_blocks;
  EXPECT_EQ(pinned, 2 * ok_puts) << ok_puts << " puts succeeded, " << failed << " failed";
}

// Attend over absurd lengths: a clear error, never zero chunks or a
// bad_alloc; a sequence attended beyond what it holds names its first block
// missing (block 4 of a 4-block sequence).
TEST(ProbeTest, AttendOverHugeLengthsIsAnError) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 1});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("huge");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 4, 4);
  ASSERT_TRUE((*c)->PutSequence("s", 0, b.data).ok());
  std::vector<uint16_t> q(4 * 64, FloatToBf16(0.5f));
  std::vector<int64_t> pos = {10};
  QueryTensor qt{q.data(), DType::kBF16, 1, 4, 64, pos.data(), nullptr};
  for (uint64_t tokens : {~uint64_t{0}, uint64_t{1} << 40}) {
    auto out = (*c)->Attend("s", SmallLayout(), tokens, qt, {});
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << tokens << ": " << out.status();
  }
  // Appending one token to a context of 2^64 - 1 tokens must not wrap around.
  std::vector<uint16_t> kv(2 * 64, FloatToBf16(0.25f));
  AttendSequence seq;
  seq.sequence_id = "s";
  seq.context_tokens = ~uint64_t{0};
  seq.rows = 1;
  seq.append_tokens = 1;
  AttendStep step;
  step.layout = SmallLayout();
  step.sequences = {seq};
  step.q = qt;
  step.new_k = kv.data();
  step.new_v = kv.data();
  std::vector<float> o(4 * 64), lse(4);
  absl::Status st = (*c)->StepInto(step, PartialOutput{o.data(), lse.data()});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // 8 blocks asked of a sequence that holds 4.
  auto more = (*c)->Attend("s", SmallLayout(), 8 * 16, qt, {});
  EXPECT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("block 4 is not on this node"), std::string::npos) << more.status();
}

// A step's output in the model's dtype (AttendStep::out_cast) is written on
// the device by the merge: asked of a step on host buffers, the step is
// refused before anything is sent, naming the field, and the sequence is
// untouched. (Other dtypes: test_api_fuzz.py, at the C ABI.)
TEST(ProbeTest, ACastOutputIsRefusedOffTheDevice) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("cast");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  std::vector<uint16_t> q(4 * 64, FloatToBf16(0.5f)), kv(2 * 64, FloatToBf16(0.25f)), cast(4 * 64);
  std::vector<int64_t> pos = {0};
  AttendStep step;
  step.layout = SmallLayout();
  step.sequences = {AttendSequence{"s", 0, 1, 1}};
  step.q = QueryTensor{q.data(), DType::kBF16, 1, 4, 64, pos.data(), nullptr};
  step.new_k = kv.data();
  step.new_v = kv.data();
  step.out_cast = cast.data();
  std::vector<float> o(4 * 64), lse(4);
  absl::Status st = (*c)->StepInto(step, PartialOutput{o.data(), lse.data()});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("out_cast is for steps on device buffers"), std::string::npos) << st;
  // Nothing was appended: the same step without the cast output starts the sequence.
  step.out_cast = nullptr;
  ASSERT_TRUE((*c)->StepInto(step, PartialOutput{o.data(), lse.data()}).ok());
}

// One Get of 120 cold blocks from a node with 8 host pages, over UCX (which
// holds the blocks it replies with): every block comes back right.
TEST(ProbeTest, AGetOfMoreColdBlocksThanHostPagesSucceeds) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1, .host_bytes = "16M", .write_through = true});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("reader");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 3, 120);
  for (size_t i = 0; i < b.data.size(); i += 4) {
    ASSERT_TRUE((*c)->Put(absl::MakeConstSpan(b.data).subspan(i, 4)).ok());
  }
  std::vector<GetResult> got = (*c)->Get(b.keys);
  ASSERT_EQ(got.size(), 120u);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << "block " << i << ": " << got[i].status;
    EXPECT_EQ(got[i].payload, b.payloads[i]) << "block " << i;
  }
}

// The UCX data plane listens only on the interface of --ucx_listen: every
// TCP listener of a daemon bound to 127.0.0.1 is on 127.0.0.1.
TEST(ProbeTest, TheDaemonListensOnlyWhereItWasTold) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  // The daemon's socket inodes.
  std::set<std::string> inodes;
  const std::string fd_dir = absl::StrCat("/proc/", cl.daemon(0).pid(), "/fd");
  DIR* d = opendir(fd_dir.c_str());
  ASSERT_NE(d, nullptr);
  for (dirent* e; (e = readdir(d)) != nullptr;) {
    char target[256];
    const ssize_t n = readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = 0;
    std::cmatch m;
    if (std::regex_match(target, m, std::regex("socket:\\[(\\d+)\\]"))) inodes.insert(m[1]);
  }
  closedir(d);
  // Its listening TCP sockets (state 0A) and their local addresses.
  int listeners = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A" || !inodes.count(f[9])) continue;
      ++listeners;
      const std::string addr = f[1].substr(0, f[1].find(':'));
      // 0100007F: 127.0.0.1 (little-endian hex); ::1 and ::ffff:127.0.0.1 likewise.
      EXPECT_TRUE(addr == "0100007F" || addr == "00000000000000000000000001000000" ||
                  addr == "0000000000000000FFFF00000100007F")
          << "the daemon listens on " << f[1] << " (" << table << ")";
    }
  }
  EXPECT_GE(listeners, 2);  // gRPC and at least one UCX listener
}

// The fixture's liveness check, which the crash tests rely on: a child
// that exited is not alive, reaped or not.
TEST(ProcessTest, AChildThatExitedIsNotAliveBeforeItIsReaped) {
  const std::string log = (std::filesystem::path(::testing::TempDir()) / "kvring_process_test.log").string();
  Process quits, runs;
  ASSERT_TRUE(quits.Start({"/bin/sh", "-c", "exit 3"}, log));
  ASSERT_TRUE(runs.Start({"/bin/sleep", "30"}, log));
  EXPECT_TRUE(Eventually([&] { return !quits.alive(); }));
  EXPECT_TRUE(runs.alive());
  runs.Kill9();
  EXPECT_FALSE(runs.alive());
}

// A coordinator or daemon told to listen where another process listens
// fails to start and says so; it never shares the port (gRPC's default
// SO_REUSEPORT would have the kernel split the connections between them).
TEST(ProbeTest, ADaemonOnAPortInUseFailsToStartAndSaysWhy) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  const std::string taken = cl.coordinator_address();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("kvring_port_", getpid());
  std::filesystem::create_directories(dir);
  std::string out;
  // (under `timeout`: one that started anyway would serve until killed, 124)
  EXPECT_EQ(RunProgram({"timeout", "20", Cluster::Bin("control/kvring-coordinator"), "--listen=" + taken,
                        "--data_dir=" + (dir / "c").string(), "--admin_token=admin-token-0123456789abcdef",
                        "--cluster_token=cluster-token-0123456789abcdef", "--metrics_listen="},
                       &out),
            1)
      << out;
  EXPECT_NE(out.find("cannot listen on: " + taken + " (in use by another process"), std::string::npos) << out;
  EXPECT_EQ(RunProgram({"timeout", "20", Cluster::Bin("control/kvringd"), "--listen=" + taken, "--coordinator=" + taken,
                        "--cluster_token=cluster-token-0123456789abcdef", "--data_dir=" + (dir / "n").string(),
                        "--node_id=intruder", "--host_bytes=16M", "--page_bytes=1M", "--metrics_listen="},
                       &out),
            1)
      << out;
  EXPECT_NE(out.find("cannot listen on " + taken), std::string::npos) << out;
  // The cluster's coordinator alone answers on its port.
  auto token = cl.CreateTenant("after");
  EXPECT_TRUE(token.ok()) << token.status();
  std::filesystem::remove_all(dir);
}

// The CLI refuses bad flags with a message and exit code 2, before it
// builds or sends anything (no crash, no hang, no silent success).
TEST(ProbeTest, TheCliRefusesBadFlagsWithExitCodeTwo) {
  const std::string cli = Cluster::Bin("clients/kvring");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--block_tokens=0", "put"}, "block_tokens"},
      {{"--tokens=-5", "put"}, "tokens"},
      {{"--tokens=7", "put"}, "tokens"},
      {{"--sequences=0", "put"}, "sequences"},
      {{"--layers=100000", "put"}, "layers"},
      {{"--layers=256", "--kv_heads=64", "put"}, "64 MiB"},
      {{"--dtype=int4", "put"}, "dtype"},
      {{"--blocks=0", "bench"}, "blocks"},
      {{"--threads=0", "bench"}, "threads"},
      {{"--block_bytes=1T", "bench"}, "block_bytes"},
      {{"--block_bytes=1", "bench"}, "block_bytes"},
      {{"--op=delete", "bench"}, "op"},
      {{"--quantize=int4", "put"}, "quantize"},
      {{"tenant-create"}, "--name"},
      {{"--rpc_timeout=0s", "put"}, "rpc_timeout"},
      {{"--rpc_timeout=-1s", "put"}, "rpc_timeout"},
  };
  for (const auto& [args, want] : cases) {
    std::vector<std::string> argv = {cli, "--coordinator=127.0.0.1:1"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string out;
    const int rc = RunProgram(argv, &out);
    EXPECT_EQ(rc, 2) << absl::StrJoin(args, " ") << ": " << out;
    EXPECT_NE(out.find(want), std::string::npos) << absl::StrJoin(args, " ") << ": " << out;
  }
}

// A daemon's attached System V shared-memory segments and open fds.
std::pair<int, int> ShmAndFds(pid_t pid) {
  int shm = 0, fds = 0;
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  for (std::string line; std::getline(maps, line);) shm += line.find("/SYSV") != std::string::npos;
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    for (dirent* e; (e = readdir(d)) != nullptr;) fds += e->d_name[0] != '.';
    closedir(d);
  }
  return {shm, fds};
}

// Blocks of 1 MiB for the tests below (keys random, payloads a pattern).
std::vector<BlockData> OneMiBBlocks(int n, uint64_t seed, std::vector<std::vector<uint8_t>>* keep) {
  const BlockLayout l{16, 4, 8, 128, DType::kBF16};  // 16*4*2*8*128*2 = 1 MiB
  std::vector<BlockData> out;
  keep->resize(n);
  for (int i = 0; i < n; ++i) {
    (*keep)[i].assign(l.bytes(), static_cast<uint8_t>(seed + i));
    BlockData b;
    b.key = BlockKey{seed * 1000 + i + 1, (seed << 32) ^ (0x9e3779b97f4a7c15ull * (i + 1))};
    b.layout = l;
    b.payload = (*keep)[i];
    out.push_back(b);
  }
  return out;
}

// The probe's finding: every client that connected and left kept ~2 shared
// memory segments attached in each daemon it used (100 clients: 4 -> 204;
// the host's 4,096-segment limit then failed every new UCX worker). Here 500
// clients come, read over UCX and go: the daemon's segments and fds are
// back at their baseline.
TEST(ProbeTest, ClientsThatComeAndGoLeaveNoSharedMemoryOrFdsBehind) {
  Cluster cl(ClusterOptions{.nodes = 1, .replication = 1});
  ASSERT_TRUE(cl.Start());
  absl::StatusOr<std::string> tok = cl.CreateTenant("t");
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::vector<std::vector<uint8_t>> keep;
  std::vector<BlockData> blocks = OneMiBBlocks(2, 1, &keep);
  {
    auto c = cl.Connect(*tok);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Put(blocks).ok());
  }
  const pid_t pid = cl.daemon(0).pid();
  ASSERT_TRUE(Eventually([&] { return ShmAndFds(pid).first <= 4; }));
  const std::pair<int, int> base = ShmAndFds(pid);
  const int shm0 = base.first, fds0 = base.second;
  for (int i = 0; i < 500; ++i) {
    auto c = cl.Connect(*tok);
    ASSERT_TRUE(c.ok()) << i << ": " << c.status();
    std::vector<GetResult> got = (*c)->Get({blocks[i % 2].key});
    ASSERT_TRUE(got[0].status.ok()) << i << ": " << got[0].status;
    ASSERT_EQ(got[0].payload, keep[i % 2]);
  }
  EXPECT_TRUE(Eventually([&] {
    const std::pair<int, int> now = ShmAndFds(pid);
    return now.first <= shm0 && now.second <= fds0 + 4;
  })) << "baseline "
      << shm0 << " segments, " << fds0 << " fds; now " << ShmAndFds(pid).first << ", " << ShmAndFds(pid).second;
  EXPECT_TRUE(cl.daemon(0).alive());
}

// The probe's crash: `kvring --rpc_timeout=0s put` run a few times aborted
// daemons on a UCX assertion (a client closing endpoints mid-connection).
// Clients with tiny timeouts abandon puts and gets at every stage; every
// daemon stays up and serves a normal client exactly.
TEST(ProbeTest, ClientsThatAbandonCallsNeverTakeADaemonDown) {
  Cluster cl(ClusterOptions{.nodes = 2, .replication = 2});
  ASSERT_TRUE(cl.Start());
  absl::StatusOr<std::string> tok = cl.CreateTenant("t");
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::vector<std::vector<uint8_t>> keep;
  for (absl::Duration timeout : {absl::Nanoseconds(1), absl::Microseconds(50), absl::Microseconds(500),
                                 absl::Milliseconds(2), absl::Milliseconds(8)}) {
    for (int i = 0; i < 6; ++i) {
      ClientOptions co;
      co.coordinator = cl.coordinator_address();
      co.token = *tok;
      co.rpc_timeout = timeout;
      auto c = Client::Connect(co);
      if (!c.ok()) continue;  // the coordinator call itself may time out
      std::vector<BlockData> blocks = OneMiBBlocks(4, 100 + i, &keep);
      (void)(*c)->Put(blocks);
      std::vector<BlockKey> keys;
      for (const BlockData& b : blocks) keys.push_back(b.key);
      (void)(*c)->Get(keys);
    }
  }
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(cl.daemon(i).alive()) << "daemon " << i << " died:\n" << cl.Log("node" + std::to_string(i) + ".log");
  auto c = cl.Connect(*tok);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<BlockData> blocks = OneMiBBlocks(8, 7, &keep);
  ASSERT_TRUE((*c)->Put(blocks).ok());
  std::vector<BlockKey> keys;
  for (const BlockData& b : blocks) keys.push_back(b.key);
  std::vector<GetResult> got = (*c)->Get(keys);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status;
    EXPECT_EQ(got[i].payload, keep[i]);
  }
}

std::string MetricsPort(const std::string& log, const std::string& pattern) {
  std::smatch m;
  if (std::regex_search(log, m, std::regex(pattern))) return m[1];
  return "";
}

// Both /metrics endpoints pass promtool's checks (one HELP and TYPE per
// family, counters named *_total, every metric documented) and say the
// exposition format version. Skips where promtool is not installed
// (deploy/setup.sh installs it).
TEST(ProbeTest, MetricsPassPromtool) {
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_SKIP() << "promtool not installed";
  ClusterOptions o{.nodes = 1, .replication = 1};
  o.extra_daemon_flags = {"--metrics_listen=127.0.0.1:0"};
  o.extra_coordinator_flags = {"--metrics_listen=127.0.0.1:0"};
  Cluster cl(o);
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("metrics");
  ASSERT_TRUE(token.ok());
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok());
  Blocks b = MakeChain(**c, SmallLayout(), "m", 1, 8);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  (void)(*c)->Get(b.keys);
  (void)(*c)->LookupPrefix(b.keys);
  const std::string dport = MetricsPort(cl.Log("node0.log"), "metrics=(\\d+)");
  const std::string cport = MetricsPort(cl.Log("coordinator.log"), "metrics on port (\\d+)");
  ASSERT_FALSE(dport.empty()) << cl.Log("node0.log");
  ASSERT_FALSE(cport.empty()) << cl.Log("coordinator.log");
  for (const std::string& port : {dport, cport}) {
    const std::string file = (cl.dir() / ("metrics-" + port + ".txt")).string();
    const std::string headers = file + ".headers";
    std::string out;
    // A plain HTTP/1.0 GET with bash's /dev/tcp: no curl needed.
    const std::string get = absl::StrCat("exec 3<>/dev/tcp/127.0.0.1/", port,
                                         "; printf \"GET /metrics HTTP/1.0\\r\\n\\r\\n\" >&3; cat <&3 > ", file);
    ASSERT_EQ(RunProgram({"/bin/bash", "-c", get}, &out), 0) << out;
    std::ifstream in(file);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t body = all.find("\r\n\r\n");
    ASSERT_NE(body, std::string::npos) << all;
    EXPECT_NE(all.substr(0, body).find("version=0.0.4"), std::string::npos) << all.substr(0, body);
    std::ofstream(file) << all.substr(body + 4);
    const int rc = RunProgram({"/bin/bash", "-c", "promtool check metrics < " + file}, &out);
    EXPECT_EQ(rc, 0) << "port " << port << ": " << out << "\n" << all.substr(body + 4, 3000);
  }
}

}  // namespace
}  // namespace kvring::testing

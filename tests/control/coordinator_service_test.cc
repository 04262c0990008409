#include "kvring/control/coordinator_service.h"

#include <filesystem>
#include <set>

#include "gtest/gtest.h"

namespace kvring {
namespace {

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvring_coord_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    Open();
  }
  void TearDown() override {
    svc_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open() {
    svc_.reset();
    auto store = MetadataStore::Open(dir_);
    ASSERT_TRUE(store.ok());
    CoordinatorOptions o;
    o.admin_token = "admin-secret";
    o.cluster_token = "cluster-secret";
    o.heartbeat_interval = absl::Milliseconds(100);
    o.heartbeat_timeout = absl::Seconds(1);
    auto s = CoordinatorService::Create(o, std::move(*store), &clock_);
    ASSERT_TRUE(s.ok()) << s.status();
    svc_ = std::move(*s);
  }
  std::string dir_;
  FakeClock clock_;
  std::unique_ptr<CoordinatorService> svc_;
};

}  // namespace
}  // namespace kvring

#include "grpcpp/create_channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace kvring {
namespace {

// A real in-process gRPC server around the service: the tests speak to it
// through a stub, so tokens travel as metadata as in production.
class CoordinatorRpcTest : public CoordinatorServiceTest {
 protected:
  void SetUp() override {
    CoordinatorServiceTest::SetUp();
    Serve();
  }
  void TearDown() override {
    server_->Shutdown();
    CoordinatorServiceTest::TearDown();
  }
  void Serve() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(svc_.get());
    server_ = b.BuildAndStart();
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port_), grpc::InsecureChannelCredentials()));
  }
  void Restart() {
    server_->Shutdown();
    server_.reset();
    Open();
    Serve();
  }
  std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token) {
    auto c = std::make_unique<grpc::ClientContext>();
    if (!token.empty()) c->AddMetadata("authorization", "Bearer " + token);
    return c;
  }
  grpc::Status RegisterNode(const std::string& id, const std::string& token, v1::RegisterNodeResponse* r) {
    v1::RegisterNodeRequest req;
    req.set_version(1);
    req.mutable_node()->set_node_id(id);
    req.mutable_node()->set_grpc_address("127.0.0.1:1");
    return stub_->RegisterNode(Ctx(token).get(), req, r);
  }
  v1::ShardMap Map() {
    v1::GetShardMapRequest req;
    req.set_version(1);
    v1::ShardMap m;
    EXPECT_TRUE(stub_->GetShardMap(Ctx("admin-secret").get(), req, &m).ok());
    return m;
  }
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorRpcTest, NodesRegisterWithTheClusterTokenOnly) {
  v1::RegisterNodeResponse r;
  EXPECT_EQ(RegisterNode("n1", "", &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(RegisterNode("n1", "admin-secret", &r).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(RegisterNode("bad id!", "cluster-secret", &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(RegisterNode("n1", "cluster-secret", &r).ok());
  EXPECT_EQ(r.incarnation(), 1u);
  ASSERT_TRUE(RegisterNode("n1", "cluster-secret", &r).ok());
  EXPECT_EQ(r.incarnation(), 2u);
}

TEST_F(CoordinatorRpcTest, SilentNodesGoDownAndComeBackWithTheMapVersionMoving) {
  v1::RegisterNodeResponse r;
  ASSERT_TRUE(RegisterNode("n1", "cluster-secret", &r).ok());
  ASSERT_TRUE(RegisterNode("n2", "cluster-secret", &r).ok());
  const uint64_t v0 = Map().version();
  clock_.Advance(absl::Milliseconds(900));
  svc_->Tick();
  EXPECT_EQ(Map().version(), v0);  // within the timeout
  // n2 heartbeats, n1 stays silent.
  v1::HeartbeatRequest hb;
  hb.set_version(1);
  hb.set_node_id("n2");
  hb.set_incarnation(1);
  v1::HeartbeatResponse hr;
  ASSERT_TRUE(stub_->Heartbeat(Ctx("cluster-secret").get(), hb, &hr).ok());
  EXPECT_FALSE(hr.reregister());
  clock_.Advance(absl::Milliseconds(300));
  svc_->Tick();
  v1::ShardMap m = Map();
  EXPECT_GT(m.version(), v0);
  std::map<std::string, v1::NodeInfo::State> st;
  for (const auto& n : m.nodes()) st[n.node_id()] = n.state();
  EXPECT_EQ(st["n1"], v1::NodeInfo::DOWN);
  EXPECT_EQ(st["n2"], v1::NodeInfo::UP);
  // A heartbeat with a stale incarnation is told to re-register.
  hb.set_node_id("n1");
  hb.set_incarnation(99);
  ASSERT_TRUE(stub_->Heartbeat(Ctx("cluster-secret").get(), hb, &hr).ok());
  EXPECT_TRUE(hr.reregister());
  hb.set_incarnation(1);
  ASSERT_TRUE(stub_->Heartbeat(Ctx("cluster-secret").get(), hb, &hr).ok());
  EXPECT_GT(hr.map_version(), m.version());  // UP again
}

TEST_F(CoordinatorRpcTest, TenantsAndMembershipSurviveARestart) {
  v1::CreateTenantRequest req;
  req.set_version(1);
  req.set_name("acme");
  req.add_shared_namespaces("shared/sys");
  v1::CreateTenantResponse resp;
  EXPECT_EQ(stub_->CreateTenant(Ctx("cluster-secret").get(), req, &resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).ok());
  EXPECT_EQ(resp.token().size(), 64u);
  EXPECT_EQ(resp.tenant().namespace_(), "tenant/" + std::to_string(resp.tenant().id()));
  EXPECT_EQ(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  req.set_name("bad");
  req.clear_shared_namespaces();
  req.add_shared_namespaces("tenant/acme");  // not a shared namespace
  EXPECT_EQ(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::RegisterNodeResponse r;
  ASSERT_TRUE(RegisterNode("n1", "cluster-secret", &r).ok());
  const uint64_t v_before = Map().version();
  v1::CreateTenantRequest again;
  again.set_version(1);
  again.set_name("zeta");
  v1::CreateTenantResponse zr;
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), again, &zr).ok());

  Restart();
  v1::WhoAmIRequest who;
  who.set_version(1);
  v1::Tenant t;
  ASSERT_TRUE(stub_->WhoAmI(Ctx(zr.token()).get(), who, &t).ok());
  EXPECT_EQ(t.name(), "zeta");
  EXPECT_EQ(stub_->WhoAmI(Ctx("wrong").get(), who, &t).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  v1::ShardMap m = Map();
  EXPECT_GT(m.version(), v_before);
  ASSERT_EQ(m.nodes_size(), 1);
  EXPECT_EQ(m.nodes(0).node_id(), "n1");
  v1::TenantTableRequest tr;
  tr.set_version(1);
  v1::TenantTable table;
  ASSERT_TRUE(stub_->GetTenantTable(Ctx("cluster-secret").get(), tr, &table).ok());
  EXPECT_EQ(table.entries_size(), 2);
  for (const auto& e : table.entries()) EXPECT_EQ(e.token_sha256().size(), 32u);  // digests, never tokens
}

// A name is a label: the same name deleted and created again is a new tenant
// (new id, new namespace), and the old id stays listed as deleted so daemons
// reclaim its blocks, across a restart too.
TEST_F(CoordinatorRpcTest, ARecreatedNameIsANewTenantAndTheOldIdIsATombstone) {
  v1::CreateTenantRequest req;
  req.set_version(1);
  req.set_name("bob");
  v1::CreateTenantResponse first, second;
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &first).ok());
  v1::DeleteTenantRequest del;
  del.set_version(1);
  del.set_name("bob");
  v1::DeleteTenantResponse dr;
  ASSERT_TRUE(stub_->DeleteTenant(Ctx("admin-secret").get(), del, &dr).ok());
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &second).ok());
  EXPECT_NE(first.tenant().id(), second.tenant().id());
  EXPECT_NE(first.tenant().namespace_(), second.tenant().namespace_());
  EXPECT_NE(first.token(), second.token());
  Restart();
  v1::TenantTableRequest tr;
  tr.set_version(1);
  v1::TenantTable table;
  ASSERT_TRUE(stub_->GetTenantTable(Ctx("cluster-secret").get(), tr, &table).ok());
  ASSERT_EQ(table.deleted_tenant_ids_size(), 1);
  EXPECT_EQ(table.deleted_tenant_ids(0), first.tenant().id());
  ASSERT_EQ(table.entries_size(), 1);
  EXPECT_EQ(table.entries(0).tenant().id(), second.tenant().id());
  // The old token is dead; a new tenant after the restart still gets a fresh id.
  v1::WhoAmIRequest who;
  who.set_version(1);
  v1::Tenant t;
  EXPECT_EQ(stub_->WhoAmI(Ctx(first.token()).get(), who, &t).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  req.set_name("carol");
  v1::CreateTenantResponse third;
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &third).ok());
  EXPECT_GT(third.tenant().id(), second.tenant().id());
}

TEST_F(CoordinatorRpcTest, ATenantTokenIsNeverAPrivilegedToken) {
  v1::CreateTenantRequest req;
  req.set_version(1);
  req.set_name("mallory");
  v1::CreateTenantResponse resp;
  for (const char* privileged : {"admin-secret", "cluster-secret"}) {
    req.set_token(privileged);
    grpc::Status s = stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("admin or the cluster token"), std::string::npos) << s.error_message();
  }
  req.set_token("short-but-not-privileged");
  EXPECT_EQ(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  req.set_token(std::string(40, 'q'));
  ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).ok());
  req.set_name("mallory2");  // the same token twice
  EXPECT_EQ(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

// 150 tenants with 64 long shared namespaces each (~1.3 MB of table): the
// table comes in pages of at most 1 MiB that together hold every tenant;
// a 65th shared namespace is refused; errors quote input boundedly.
TEST_F(CoordinatorRpcTest, TheTenantTableComesInBoundedPages) {
  v1::CreateTenantRequest req;
  req.set_version(1);
  for (int i = 0; i < 64; ++i)
    req.add_shared_namespaces("shared/" + std::string(100, 'a' + i % 26) + std::to_string(i));
  v1::CreateTenantResponse resp;
  for (int t = 0; t < 150; ++t) {
    req.set_name("t" + std::to_string(1000 + t));
    ASSERT_TRUE(stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp).ok()) << t;
  }
  req.set_name("too-many");
  req.add_shared_namespaces("shared/one-more");
  grpc::Status s = stub_->CreateTenant(Ctx("admin-secret").get(), req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("at most 64"), std::string::npos) << s.error_message();
  std::set<std::string> names;
  std::string after;
  int pages = 0;
  uint64_t version = 0;
  do {
    v1::TenantTableRequest tr;
    tr.set_version(1);
    tr.set_page_after(after);
    v1::TenantTable page;
    ASSERT_TRUE(stub_->GetTenantTable(Ctx("cluster-secret").get(), tr, &page).ok());
    EXPECT_LE(page.ByteSizeLong(), (1u << 20) + 16384);
    if (pages == 0) version = page.tenants_version();
    EXPECT_EQ(page.tenants_version(), version);
    for (const auto& e : page.entries())
      EXPECT_TRUE(names.insert(e.tenant().name()).second) << "twice: " << e.tenant().name();
    after = page.next_page_after();
    ++pages;
  } while (!after.empty() && pages < 100);
  EXPECT_GE(pages, 2);
  EXPECT_EQ(names.size(), 150u);
  // An error quoting a 100 KB input quotes a bounded prefix of it.
  v1::CreateTenantRequest big;
  big.set_version(1);
  big.set_name("big");
  big.set_kv_encoding(std::string(100000, 'x'));
  s = stub_->CreateTenant(Ctx("admin-secret").get(), big, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size(), 400u) << s.error_message().size();
  EXPECT_NE(s.error_message().find("100000 bytes"), std::string::npos) << s.error_message();
  v1::DeleteTenantRequest del;
  del.set_version(1);
  del.set_name(std::string(100000, 'y'));
  v1::DeleteTenantResponse dr;
  s = stub_->DeleteTenant(Ctx("admin-secret").get(), del, &dr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_LT(s.error_message().size(), 400u);
}

TEST_F(CoordinatorRpcTest, UnsupportedProtocolVersionIsRefusedByName) {
  v1::GetShardMapRequest req;
  req.set_version(2);
  v1::ShardMap m;
  grpc::Status s = stub_->GetShardMap(Ctx("admin-secret").get(), req, &m);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("version 2"), std::string::npos);
}

}  // namespace
}  // namespace kvring

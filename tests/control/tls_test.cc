// TLS for gRPC, with real processes: a CA and a certificate for 127.0.0.1
// are made with the openssl tool, the coordinator and the daemons serve TLS
// (the daemons verify the coordinator with the CA), and the client
// verifies the cluster with the CA. A plaintext client, and a client
// trusting another CA, get nothing. Then mutual TLS: without a client
// certificate the cluster refuses the connection.
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "cluster_fixture.h"
#include "gtest/gtest.h"

namespace kvring {
namespace {

using testing::Blocks;
using testing::Cluster;
using testing::ClusterOptions;
using testing::MakeChain;
using testing::SmallLayout;

// A CA and a cert signed by it for 127.0.0.1 (serverAuth and clientAuth) in dir.
bool MakeCerts(const std::filesystem::path& dir, const std::string& prefix) {
  const std::string d = dir.string() + "/" + prefix;
  const std::string cmd = absl::StrCat(
      "set -e; cd ", dir.string(), "; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvring-test-ca -keyout ", d, "ca.key -out ", d,
      "ca.pem 2>/dev/null; ", "openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout ", d, "node.key -out ",
      d, "node.csr 2>/dev/null; ",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ", d,
      "ext.cnf; ", "openssl x509 -req -in ", d, "node.csr -CA ", d, "ca.pem -CAkey ", d,
      "ca.key -CAcreateserial -days 2 -extfile ", d, "ext.cnf -out ", d, "node.pem 2>/dev/null");
  return std::system(cmd.c_str()) == 0;
}

TEST(TlsTest, ClusterServesTlsAndRefusesPlaintextAndForeignCas) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / absl::StrCat("kvring_tls_", getpid());
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(MakeCerts(dir, "a-")) << "openssl failed";
  ASSERT_TRUE(MakeCerts(dir, "b-"));
  const std::string ca = (dir / "a-ca.pem").string(), cert = (dir / "a-node.pem").string(),
                    key = (dir / "a-node.key").string();
  const std::vector<std::string> server_tls = {"--tls_cert=" + cert, "--tls_key=" + key, "--tls_ca=" + ca};
  Cluster cl(ClusterOptions{.nodes = 2,
                            .replication = 2,
                            .extra_daemon_flags = server_tls,
                            .extra_coordinator_flags = server_tls,
                            .client_tls = TlsConfig{"", "", ca, false}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("secure");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok()) << c.status();
  Blocks b = MakeChain(**c, SmallLayout(), "m", 3, 12);
  auto put = (*c)->Put(b.data);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->replicas_written, 24u);
  auto got = (*c)->Get(b.keys);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << got[i].status;
    EXPECT_EQ(got[i].payload, b.payloads[i]);
  }
  // Plaintext to a TLS cluster: no connection.
  ClientOptions plain;
  plain.coordinator = cl.coordinator_address();
  plain.token = *token;
  plain.rpc_timeout = absl::Seconds(3);
  EXPECT_FALSE(Client::Connect(plain).ok());
  // Trusting another CA: the server's certificate does not verify.
  ClientOptions foreign = plain;
  foreign.tls.ca_file = (dir / "b-ca.pem").string();
  EXPECT_FALSE(Client::Connect(foreign).ok());
  // A CA file that does not exist is a clear error.
  ClientOptions missing = plain;
  missing.tls.ca_file = (dir / "nope.pem").string();
  auto m = Client::Connect(missing);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("nope.pem"), std::string::npos) << m.status();
  std::filesystem::remove_all(dir);
}

TEST(TlsTest, MutualTlsRefusesClientsWithoutACertificate) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / absl::StrCat("kvring_mtls_", getpid());
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(MakeCerts(dir, "a-"));
  const std::string ca = (dir / "a-ca.pem").string(), cert = (dir / "a-node.pem").string(),
                    key = (dir / "a-node.key").string();
  const std::vector<std::string> server_tls = {"--tls_cert=" + cert, "--tls_key=" + key, "--tls_ca=" + ca,
                                               "--tls_require_client_cert"};
  Cluster cl(ClusterOptions{.nodes = 1,
                            .replication = 1,
                            .extra_daemon_flags = server_tls,
                            .extra_coordinator_flags = server_tls,
                            .client_tls = TlsConfig{cert, key, ca, false}});
  ASSERT_TRUE(cl.Start());
  auto token = cl.CreateTenant("mutual");
  ASSERT_TRUE(token.ok()) << token.status();
  auto c = cl.Connect(*token);
  ASSERT_TRUE(c.ok()) << c.status();
  Blocks b = MakeChain(**c, SmallLayout(), "m", 4, 3);
  ASSERT_TRUE((*c)->Put(b.data).ok());
  ClientOptions no_cert;
  no_cert.coordinator = cl.coordinator_address();
  no_cert.token = *token;
  no_cert.tls.ca_file = ca;
  no_cert.rpc_timeout = absl::Seconds(3);
  EXPECT_FALSE(Client::Connect(no_cert).ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvring

#include "kvring/protocol/tls.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace kvring {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read the TLS ", what, " file '", path, "'"));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (s.find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("the TLS ", what, " file '", path, "' is not PEM"));
  }
  return s;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("a TLS server needs both --tls_cert and --tls_key");
  }
  grpc::SslServerCredentialsOptions o;
  auto cert = ReadPem(tls.cert_file, "certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(tls.key_file, "key");
  if (!key.ok()) return key.status();
  o.pem_key_cert_pairs.push_back({*key, *cert});
  if (tls.require_client_cert) {
    if (tls.ca_file.empty()) return absl::InvalidArgumentError("requiring client certificates needs --tls_ca");
    auto ca = ReadPem(tls.ca_file, "CA");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
    o.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  if (!tls.ca_file.empty()) {
    auto ca = ReadPem(tls.ca_file, "CA");
    if (!ca.ok()) return ca.status();
    o.pem_root_certs = *ca;
  }
  if (!tls.cert_file.empty() || !tls.key_file.empty()) {
    if (tls.cert_file.empty() || tls.key_file.empty()) {
      return absl::InvalidArgumentError("a TLS client certificate needs both the certificate and the key file");
    }
    auto cert = ReadPem(tls.cert_file, "certificate");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(tls.key_file, "key");
    if (!key.ok()) return key.status();
    o.pem_cert_chain = *cert;
    o.pem_private_key = *key;
  }
  return grpc::SslCredentials(o);
}

void AddTlsFlags(FlagSet* flags, TlsConfig* tls, bool server) {
  flags->AddString("tls_cert", &tls->cert_file,
                   server ? "PEM certificate chain: serve gRPC over TLS (with --tls_key)"
                          : "PEM client certificate (mutual TLS, with --tls_key)");
  flags->AddString("tls_key", &tls->key_file, "PEM private key of --tls_cert");
  flags->AddString("tls_ca", &tls->ca_file,
                   server ? "PEM CA: verifies the coordinator (kvringd) and, with --tls_require_client_cert, clients"
                          : "PEM CA that signed the servers' certificates: talk TLS to the cluster");
  if (server) {
    flags->AddBool("tls_require_client_cert", &tls->require_client_cert,
                   "demand client certificates signed by --tls_ca (mutual TLS)");
  }
}

}  // namespace kvring

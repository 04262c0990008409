// gRPC credentials from a TlsConfig (common/tls_config.h): the files are
// read at call time and every problem (missing file, key without cert, a
// server without a certificate) is an INVALID_ARGUMENT naming the file.
// Thread-safe (pure functions).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "kvring/common/flags.h"
#include "kvring/common/tls_config.h"

namespace kvring {

// Plaintext when !tls.enabled(); otherwise TLS with tls.cert_file/key_file,
// verifying client certificates against ca_file when require_client_cert.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsConfig& tls);
// Plaintext when !tls.enabled(); otherwise TLS verifying the server against
// ca_file (the system roots when empty), presenting cert_file/key_file when
// given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsConfig& tls);

// --tls_cert, --tls_key, --tls_ca (and, for servers, --tls_require_client_cert).
void AddTlsFlags(FlagSet* flags, TlsConfig* tls, bool server);

}  // namespace kvring

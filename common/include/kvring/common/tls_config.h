// TlsConfig: where a process finds its TLS material for gRPC (PEM files).
// Servers (kvringd, kvring-coordinator) need cert_file + key_file; clients
// (and kvringd towards the coordinator) verify servers against ca_file. With
// require_client_cert a server also demands a client certificate signed by
// ca_file (mutual TLS); clients then give cert_file + key_file too.
// Empty: plaintext. Plain data; control/tls.h turns it into credentials.
//
// The UCX data plane is not encrypted: clients with TLS configured move
// payloads over gRPC (ClientOptions::use_ucx is ignored) so nothing of a
// tenant's travels in the clear.
#pragma once

#include <string>

namespace kvring {

struct TlsConfig {
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
  bool require_client_cert = false;

  bool enabled() const { return !cert_file.empty() || !ca_file.empty(); }
};

}  // namespace kvring

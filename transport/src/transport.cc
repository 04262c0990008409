#include "kvring/transport/transport.h"

#include "absl/strings/str_cat.h"

namespace kvring {

absl::Status Transport::CheckPeer(int peer) const {
  if (peer < 0 || peer >= size() || peer == rank()) {
    return absl::InvalidArgumentError(absl::StrCat("peer ", peer, " is not another rank of this group of ", size()));
  }
  return absl::OkStatus();
}

absl::Status Transport::Send(int peer, uint64_t tag, absl::Span<const uint8_t> data, absl::Duration timeout) {
  auto req = Isend(peer, tag, data);
  if (!req.ok()) return req.status();
  if (absl::Status f = Flush(); !f.ok()) return f;
  return (*req)->Wait(timeout).status();
}

absl::StatusOr<size_t> Transport::Recv(int peer, uint64_t tag, absl::Span<uint8_t> buffer, absl::Duration timeout) {
  auto req = Irecv(peer, tag, buffer);
  if (!req.ok()) return req.status();
  if (absl::Status f = Flush(); !f.ok()) return f;
  return (*req)->Wait(timeout);
}

}  // namespace kvring

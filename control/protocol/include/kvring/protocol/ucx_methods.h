// The UCX data plane's method ids and payload conventions, shared by the
// daemon (control/ucx_data_plane.h) and the client. A request's meta is the
// serialized protobuf request with its bulk bytes fields left empty; the bulk
// bytes travel as the payload:
//   Put:    the blocks' payloads concatenated in request order;
//           reply: PutResponse, no payload.
//   Get:    no payload; reply: GetResponse (headers) and the payloads of the
//           blocks found, concatenated in order.
//   Attend: queries || new_k || new_v (AttendRequest's bytes fields, in that
//           order and sizes); reply: AttendResponse without out/lse, payload
//           out || lse.
#pragma once

#include <cstdint>

namespace kvring {

inline constexpr uint32_t kUcxMethodPing = 0;
inline constexpr uint32_t kUcxMethodPut = 1;
inline constexpr uint32_t kUcxMethodGet = 2;
inline constexpr uint32_t kUcxMethodAttend = 3;

}  // namespace kvring

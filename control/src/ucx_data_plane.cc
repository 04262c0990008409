#include "kvring/control/ucx_data_plane.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "kvring/control/node_wire.h"

namespace kvring {
namespace {
// Requests the UCX thread authenticated and parsed, then left to the pool.
struct ParsedAttend {
  v1::Tenant tenant;
  v1::AttendRequest request;
};
struct ParsedGet {
  v1::Tenant tenant;
  v1::GetRequest request;
};
}  // namespace

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::Start(NodeCore* core, const UcxDataPlaneOptions& o) {
  std::unique_ptr<UcxDataPlane> p(new UcxDataPlane());
  p->options_ = o;
  p->core_ = core;
  p->pool_ = std::make_unique<ThreadPool>(std::max<size_t>(1, o.threads));
  UcxDataPlane* raw = p.get();
  auto server = UcxRpcServer::Start(
      o.listen, [raw](UcxRequest&& req, UcxReplier reply) { raw->Handle(std::move(req), std::move(reply)); },
      p->pool_.get(), o.max_message_bytes,
      [raw](UcxRequest& req, UcxReplier& reply) { return raw->HandleFast(req, reply); }, o.loop);
  if (!server.ok()) return server.status();
  p->server_ = std::move(*server);
  return p;
}

UcxDataPlane::~UcxDataPlane() {
  server_.reset();  // stops replies before the handler pool goes
  pool_.reset();
}

bool UcxDataPlane::HandleFast(UcxRequest& req, UcxReplier& reply) {
  if (req.method == kUcxMethodPing) {
    reply.Send(absl::OkStatus(), "");
    return true;
  }
  if (req.method == kUcxMethodAttend && options_.inline_attend_rows > 0) {
    absl::StatusOr<v1::Tenant> tenant = core_->Authenticate(req.token);
    if (!tenant.ok()) return false;  // the pool path answers with the error
    auto parsed = std::make_shared<ParsedAttend>();
    if (!parsed->request.ParseFromString(req.meta)) return false;
    uint64_t rows = 0;
    for (const auto& s : parsed->request.sequences()) rows += s.rows();
    if (rows > options_.inline_attend_rows) {
      // Too big for this thread: the pool serves it, without authenticating
      // and parsing it again.
      parsed->tenant = std::move(*tenant);
      req.handler_state = std::move(parsed);
      return false;
    }
    ServeAttend(*tenant, parsed->request, req, reply);
    return true;
  }
  if (req.method != kUcxMethodGet) return false;
  absl::StatusOr<v1::Tenant> tenant = core_->Authenticate(req.token);
  if (!tenant.ok()) return false;  // the pool path answers with the error
  auto parsed = std::make_shared<ParsedGet>();
  if (!parsed->request.ParseFromString(req.meta)) return false;
  // Copies into a caller's GPU memory run on the pool: they take as long as
  // their bytes, and this thread serves everyone's small requests. So do
  // reads from the cold tier.
  if (parsed->request.device_places_size() > 0 || !WireGetStaysInMemory(*core_, *tenant, parsed->request)) {
    parsed->tenant = std::move(*tenant);
    req.handler_state = std::move(parsed);
    return false;
  }
  ServeGet(*tenant, parsed->request, reply);
  return true;
}

void UcxDataPlane::ServeAttend(const v1::Tenant& tenant, const v1::AttendRequest& r, const UcxRequest& req,
                               UcxReplier& reply) {
  // Queries and appended K/V stay in the received payload; the output is
  // written once, into the buffer the reply is sent from.
  const auto t0 = std::chrono::steady_clock::now();
  auto handled = [&t0](v1::AttendResponse& head) {
    head.set_handler_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  absl::StatusOr<AttendBatch> batch = ParseAttendRequest(r, core_->limits(), req.payload);
  if (!batch.ok()) {
    reply.Send(batch.status(), "");
    return;
  }
  v1::AttendResponse head;
  if (r.has_device()) {  // the output lands in the caller's GPU memory: only the header goes back
    absl::Status s = WireAttend(*core_, tenant, r, *batch, &head, PartialOutput{nullptr, nullptr});
    handled(head);
    reply.Send(s, s.ok() ? head.SerializeAsString() : "");
    return;
  }
  const size_t out_n = batch->shape.out_floats(), lse_n = batch->shape.lse_floats();
  auto buf = std::make_shared<std::vector<float>>(out_n + lse_n);
  absl::Status s = WireAttend(*core_, tenant, r, *batch, &head, PartialOutput{buf->data(), buf->data() + out_n});
  if (!s.ok()) {
    reply.Send(s, "");
    return;
  }
  handled(head);
  std::vector<absl::Span<const uint8_t>> parts{
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(buf->data()), buf->size() * sizeof(float))};
  reply.Send(absl::OkStatus(), head.SerializeAsString(), std::move(parts), buf);
}

void UcxDataPlane::ServeGet(const v1::Tenant& tenant, const v1::GetRequest& r, UcxReplier& reply) {
  auto held = std::make_shared<std::vector<PinnedBlock>>();
  v1::GetResponse resp;
  absl::Status s = WireGet(*core_, tenant, r, &resp, held.get());
  std::vector<absl::Span<const uint8_t>> parts;
  for (const PinnedBlock& b : *held) parts.push_back(b.payload());
  reply.Send(s, s.ok() ? resp.SerializeAsString() : "", std::move(parts), held);
}

void UcxDataPlane::Handle(UcxRequest&& req, UcxReplier reply) {
  if (req.method == kUcxMethodPing) {
    reply.Send(absl::OkStatus(), "");
    return;
  }
  if (req.method == kUcxMethodAttend && req.handler_state != nullptr) {
    const auto* parsed = static_cast<const ParsedAttend*>(req.handler_state.get());
    ServeAttend(parsed->tenant, parsed->request, req, reply);
    return;
  }
  if (req.method == kUcxMethodGet && req.handler_state != nullptr) {
    const auto* parsed = static_cast<const ParsedGet*>(req.handler_state.get());
    ServeGet(parsed->tenant, parsed->request, reply);
    return;
  }
  absl::StatusOr<v1::Tenant> tenant = core_->Authenticate(req.token);
  if (!tenant.ok()) {
    reply.Send(tenant.status(), "");
    return;
  }
  switch (req.method) {
    case kUcxMethodPut: {
      v1::PutRequest r;
      if (!r.ParseFromString(req.meta)) {
        reply.Send(absl::InvalidArgumentError("UCX Put: request does not parse"), "");
        return;
      }
      // Cut the payload by the block headers; the sizes are validated again by the core.
      std::vector<absl::Span<const uint8_t>> parts;
      size_t off = 0;
      for (const auto& b : r.blocks()) {
        const size_t n = b.block().payload_bytes();
        if (off + n > req.payload.size()) {
          reply.Send(absl::InvalidArgumentError(absl::StrCat("UCX Put: payload has ", req.payload.size(),
                                                             " bytes, fewer than the blocks' headers declare")),
                     "");
          return;
        }
        parts.push_back(req.payload.subspan(off, n));
        off += n;
      }
      if (off != req.payload.size()) {
        reply.Send(absl::InvalidArgumentError("UCX Put: payload longer than the blocks' headers declare"), "");
        return;
      }
      if (parts.empty()) parts.push_back({});  // "external" even with no blocks
      v1::PutResponse resp;
      absl::Status s =
          WirePut(*core_, *tenant, r,
                  r.blocks_size() ? absl::MakeConstSpan(parts) : absl::Span<const absl::Span<const uint8_t>>(), &resp);
      reply.Send(s, s.ok() ? resp.SerializeAsString() : "");
      return;
    }
    case kUcxMethodGet: {
      v1::GetRequest r;
      if (!r.ParseFromString(req.meta)) {
        reply.Send(absl::InvalidArgumentError("UCX Get: request does not parse"), "");
        return;
      }
      ServeGet(*tenant, r, reply);
      return;
    }
    case kUcxMethodAttend: {
      v1::AttendRequest r;
      if (!r.ParseFromString(req.meta)) {
        reply.Send(absl::InvalidArgumentError("UCX Attend: request does not parse"), "");
        return;
      }
      ServeAttend(*tenant, r, req, reply);
      return;
    }
    default:
      reply.Send(absl::UnimplementedError(absl::StrCat("unknown UCX method ", req.method)), "");
  }
}

}  // namespace kvring

#include "kvring/transport/ucx_rpc.h"

#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <unordered_map>
#include "absl/synchronization/mutex.h"

#include "absl/strings/str_cat.h"
#include "ucx_worker.h"

namespace kvring {
namespace ucx_internal {
namespace {

// Active message ids.
constexpr unsigned kRequestAm = 1;
constexpr unsigned kReplyAm = 2;
constexpr unsigned kHelloAm = 3;
constexpr unsigned kPingAm = 4;  // wires up a sentinel endpoint; ignored on arrival

// flags: the small pieces (token/meta, msg/meta) travel in the AM header, and
// the AM data is exactly the payload, contiguous, so UCX's zero-copy
// rendezvous (CMA on one host, RDMA across) moves it without staging.
constexpr uint32_t kInlinePieces = 1;

struct ReqHeader {
  uint64_t request_id;
  uint64_t client_id;
  uint32_t method, token_len, meta_len, flags;
};
struct RepHeader {
  uint64_t request_id;
  int32_t code;
  uint32_t msg_len, meta_len, flags;
};
struct HelloHeader {
  uint64_t client_id;
  uint32_t same_host;  // the client is on this host: no peer-failure mode (see below)
  uint32_t pad;
};
static_assert(sizeof(ReqHeader) == 32 && sizeof(RepHeader) == 24);

// Message buffers, recycled (the server's receive buffers, the client's
// staged payloads): a fresh multi-megabyte allocation per message costs page
// faults and zeroing every time. Buffers are uninitialized and bucketed by
// power-of-two size; at most `max_per_bucket` are kept per bucket.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  explicit BufferPool(size_t max_per_bucket = 16) : max_per_bucket_(max_per_bucket) {}
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
    size_t capacity = 0;
  };
  std::shared_ptr<Buffer> Get(size_t n) {
    const int b = Bucket(n);
    std::unique_ptr<Buffer> buf;
    {
      absl::MutexLock g(&mu_);
      auto& free = free_[b];
      if (!free.empty()) {
        buf = std::move(free.back());
        free.pop_back();
      }
    }
    if (!buf) {
      buf = std::make_unique<Buffer>();
      buf->capacity = size_t{1} << b;
      buf->data.reset(new uint8_t[buf->capacity]);
    }
    buf->size = n;
    std::weak_ptr<BufferPool> weak = shared_from_this();
    return std::shared_ptr<Buffer>(buf.release(), [weak, b](Buffer* p) {
      if (auto pool = weak.lock()) {
        absl::MutexLock g(&pool->mu_);
        if (pool->free_[b].size() < pool->max_per_bucket_) {
          pool->free_[b].emplace_back(p);
          return;
        }
      }
      delete p;
    });
  }

 private:
  const size_t max_per_bucket_;
  static int Bucket(size_t n) {
    int b = 12;
    while ((size_t{1} << b) < n) ++b;
    return b;
  }
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Buffer>> free_[64] ABSL_GUARDED_BY(mu_);
};

// Everything an in-flight send keeps alive.
struct SendCtx {
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  ucp_ep_h ep = nullptr;
  std::vector<uint8_t> header;
  std::vector<uint8_t> staged;                 // payload parts joined, or pieces + payload
  std::shared_ptr<BufferPool::Buffer> pooled;  // or there, when a pool was given
  std::vector<ucp_dt_iov_t> iov;               // several payload parts sent in place (UCP_DATATYPE_IOV)
  const void* data = nullptr;
  size_t length = 0;  // bytes, or iov entries when `iov` is used
  std::shared_ptr<void> keepalive;
  std::function<void(ucs_status_t)> done;
  std::function<void()> untrack;  // server: drop from the in-flight set
};

// Lays out a message. `fixed` is the header struct (its flags set here by
// the caller through `set_inline`); `pieces` are small strings; `payload` the
// bulk parts. A single payload part is sent in place (zero copy).
template <typename Fixed>
// `stage`: copy a single payload too (the message then owns every byte it
// sends, so the caller's buffer may go away before the send completes).
// `pool`: where a staged payload of 1 MiB or more is copied (else a fresh vector).
SendCtx* BuildMessage(Fixed fixed, std::initializer_list<std::string_view> pieces,
                      const std::vector<absl::Span<const uint8_t>>& payload, size_t max_header, bool stage = false,
                      BufferPool* pool = nullptr) {
  auto* c = new SendCtx();
  size_t piece_bytes = 0, payload_bytes = 0;
  for (auto p : pieces) piece_bytes += p.size();
  for (auto p : payload) payload_bytes += p.size();
  const bool inline_pieces = sizeof(Fixed) + piece_bytes <= max_header;
  if (inline_pieces) fixed.flags |= kInlinePieces;
  c->header.resize(sizeof(Fixed));
  std::memcpy(c->header.data(), &fixed, sizeof(Fixed));
  if (inline_pieces) {
    for (auto p : pieces) c->header.insert(c->header.end(), p.begin(), p.end());
    if (payload.size() == 1 && !stage) {
      c->data = payload[0].data();
      c->length = payload[0].size();
      return c;
    }
    if (payload.size() > 1 && !stage) {
      // The parts in place, as an iov: no joined copy (a Get reply of many
      // blocks goes straight from the store's pages).
      for (auto p : payload) {
        if (p.size() > 0) c->iov.push_back(ucp_dt_iov_t{const_cast<uint8_t*>(p.data()), p.size()});
      }
      c->data = c->iov.data();
      c->length = c->iov.size();
      return c;
    }
  } else {
    for (auto p : pieces) c->staged.insert(c->staged.end(), p.begin(), p.end());
    if (!stage && payload_bytes > 0) {
      // The pieces (too long for the header: a request or reply naming many
      // blocks) lead the data, the payload parts follow in place: copying
      // the payload behind them cost a fresh multi-megabyte buffer (page
      // faults) and a copy per message.
      c->iov.push_back(ucp_dt_iov_t{c->staged.data(), c->staged.size()});
      for (auto p : payload) {
        if (p.size() > 0) c->iov.push_back(ucp_dt_iov_t{const_cast<uint8_t*>(p.data()), p.size()});
      }
      c->data = c->iov.data();
      c->length = c->iov.size();
      return c;
    }
  }
  // The message owns its bytes: the pieces not in the header, then the
  // payload, joined in a pooled buffer (1 MiB and more) or in `staged`.
  const size_t total = c->staged.size() + payload_bytes;
  uint8_t* d;
  if (pool != nullptr && payload_bytes >= (size_t{1} << 20)) {
    c->pooled = pool->Get(total);
    if (!c->staged.empty()) std::memcpy(c->pooled->data.get(), c->staged.data(), c->staged.size());
    c->data = c->pooled->data.get();
    d = c->pooled->data.get() + c->staged.size();
  } else {
    const size_t at = c->staged.size();
    c->staged.resize(total);
    c->data = c->staged.data();
    d = c->staged.data() + at;
  }
  for (auto p : payload) {
    if (p.size() > 0) std::memcpy(d, p.data(), p.size());
    d += p.size();
  }
  c->length = total;
  return c;
}

void OnSendDone(void* request, ucs_status_t status, void* user) {
  auto* ctx = static_cast<SendCtx*>(user);
  if (ctx->done) ctx->done(status);
  if (ctx->untrack) ctx->untrack();
  delete ctx;
  if (request != nullptr) ucp_request_free(request);
}

// Sends an AM; `ctx` is consumed (deleted when the send completes).
void SendAm(ucp_ep_h ep, unsigned id, SendCtx* ctx) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  p.cb.send = OnSendDone;
  p.user_data = ctx;
  p.datatype = ctx->iov.empty() ? ucp_dt_make_contig(1) : ucp_dt_make_iov();
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, ctx->header.data(), ctx->header.size(), ctx->data, ctx->length, &p);
  if (r == nullptr) {
    OnSendDone(nullptr, UCS_OK, ctx);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnSendDone(nullptr, UCS_PTR_STATUS(r), ctx);
  }
}

// Receives an AM's data into `dst` (eager: copied now; rendezvous: fetched,
// then `done` runs on the loop thread). Takes ownership of `done`.
void ReceiveData(ucp_worker_h worker, void* data, size_t length, const ucp_am_recv_param_t* param, uint8_t* dst,
                 std::function<void(ucs_status_t)> done) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    if (length) std::memcpy(dst, data, length);
    done(UCS_OK);
    return;
  }
  auto* fn = new std::function<void(ucs_status_t)>(std::move(done));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  rp.datatype = ucp_dt_make_contig(1);
  rp.user_data = fn;
  rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
    auto* f = static_cast<std::function<void(ucs_status_t)>*>(user);
    (*f)(status);
    delete f;
    if (request != nullptr) ucp_request_free(request);
  };
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, data, dst, length, &rp);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    (*fn)(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
    delete fn;
  }
}

}  // namespace

// ------------------------------------------------------------------ server

struct ServerState : std::enable_shared_from_this<ServerState> {
  std::shared_ptr<BufferPool> buffers = std::make_shared<BufferPool>();
  UcxWorkerLoop* loop = nullptr;
  UcxHandler handler;
  UcxFastHandler fast_handler;  // optional, runs on the loop thread
  ThreadPool* pool = nullptr;
  uint64_t max_bytes = 0;
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::unordered_map<ucp_ep_h, uint64_t> eps;      // loop thread only: ep -> generation
  std::unordered_map<uint64_t, ucp_ep_h> clients;  // loop thread only: client id -> ep back to it
  uint64_t next_generation = 1;                    // loop thread only
  // Replies in flight (loop thread only). On one host the endpoints run
  // without UCX's peer-failure mode (which would rule out shared memory and
  // CMA), so a client that dies mid-transfer is found here instead: a reply
  // older than reply_timeout closes its endpoint, which completes (cancels)
  // everything pending on it and releases the blocks it held.
  std::unordered_map<SendCtx*, ucp_ep_h> inflight;
  std::chrono::milliseconds reply_timeout{30000};
  // Same-host clients also get a sentinel endpoint in peer-failure mode (TCP
  // lanes, no data): its error callback reports the client's death at once.
  std::unordered_map<ucp_ep_h, ucp_ep_h> sentinel_of;  // data ep -> sentinel
  std::unordered_map<ucp_ep_h, ucp_ep_h> data_of;      // sentinel -> data ep

  void DropEndpoint(ucp_ep_h ep) {
    if (!eps.erase(ep)) return;
    for (auto it = clients.begin(); it != clients.end();) {
      it = it->second == ep ? clients.erase(it) : std::next(it);
    }
    CloseEndpoint(loop->worker(), ep);
    auto s = sentinel_of.find(ep);
    if (s != sentinel_of.end()) {
      data_of.erase(s->second);
      CloseEndpoint(loop->worker(), s->second);
      sentinel_of.erase(s);
    }
  }
  void Sweep() {
    const auto now = std::chrono::steady_clock::now();
    std::vector<ucp_ep_h> dead;
    for (auto& [c, ep] : inflight) {
      if (now - c->started > reply_timeout) dead.push_back(ep);
    }
    for (ucp_ep_h ep : dead) DropEndpoint(ep);
  }

  void Dispatch(ucp_ep_h ep, uint64_t gen, const ReqHeader& h, std::string token, std::string meta,
                std::shared_ptr<BufferPool::Buffer> buf, size_t payload_offset) {
    auto req = std::make_shared<UcxRequest>();
    req->method = h.method;
    req->token = std::move(token);
    req->meta = std::move(meta);
    req->payload = absl::MakeConstSpan(buf->data.get() + payload_offset, buf->size - payload_offset);
    req->storage = buf;
    auto rep = std::make_shared<UcxReplier>();
    rep->server_ = shared_from_this();
    rep->ep_ = ep;
    rep->request_id_ = h.request_id;
    rep->ep_generation_ = gen;
    if (fast_handler && fast_handler(*req, *rep)) return;
    UcxHandler* handler_ptr = &handler;
    pool->Submit([handler_ptr, req, rep]() mutable { (*handler_ptr)(std::move(*req), std::move(*rep)); });
  }

  void SendReply(ucp_ep_h ep, uint64_t gen, uint64_t id, const absl::Status& status, std::string meta,
                 std::vector<absl::Span<const uint8_t>> payload, std::shared_ptr<void> keepalive) {
    const std::string msg(status.message());
    RepHeader h{id, static_cast<int32_t>(status.code()), static_cast<uint32_t>(msg.size()),
                static_cast<uint32_t>(meta.size()), 0};
    SendCtx* c = BuildMessage(h, {msg, meta}, payload, loop->max_am_header());
    c->keepalive = std::move(keepalive);
    auto self = shared_from_this();
    loop->Post([self, ep, gen, c] {
      auto it = self->eps.find(ep);
      if (it == self->eps.end() || it->second != gen) {  // the client went away
        delete c;
        return;
      }
      self->inflight[c] = ep;
      ServerState* raw = self.get();
      c->untrack = [raw, c] { raw->inflight.erase(c); };
      SendAm(ep, kReplyAm, c);
    });
  }
};

namespace {

ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param) {
  auto* st = static_cast<ServerState*>(arg);
  if (header_length < sizeof(ReqHeader)) return UCS_OK;
  ReqHeader h;
  std::memcpy(&h, header, sizeof(h));
  auto cit = st->clients.find(h.client_id);
  if (cit == st->clients.end()) return UCS_OK;  // no hello from this client: nowhere to reply
  ucp_ep_h ep = cit->second;
  const uint64_t gen = st->eps[ep];
  const uint64_t pieces = uint64_t{h.token_len} + h.meta_len;
  const bool inline_pieces = h.flags & kInlinePieces;
  const bool sane = inline_pieces ? header_length == sizeof(ReqHeader) + pieces
                                  : header_length == sizeof(ReqHeader) && pieces <= length;
  if (!sane || length > st->max_bytes) {
    st->SendReply(ep, gen, h.request_id,
                  absl::InvalidArgumentError(absl::StrCat("malformed or oversize UCX request (", length, " bytes)")),
                  "", {}, nullptr);
    return UCS_OK;
  }
  std::string token, meta;
  size_t payload_offset = 0;
  if (inline_pieces) {
    const char* p = static_cast<const char*>(header) + sizeof(ReqHeader);
    token.assign(p, h.token_len);
    meta.assign(p + h.token_len, h.meta_len);
  } else {
    payload_offset = pieces;  // split once the data is here
  }
  auto buf = st->buffers->Get(length);
  auto self = st->shared_from_this();
  ReceiveData(st->loop->worker(), data, length, param, buf->data.get(),
              [self, ep, gen, h, token = std::move(token), meta = std::move(meta), buf, payload_offset,
               inline_pieces](ucs_status_t s) mutable {
                if (s != UCS_OK) return;
                if (!inline_pieces) {
                  token.assign(reinterpret_cast<const char*>(buf->data.get()), h.token_len);
                  meta.assign(reinterpret_cast<const char*>(buf->data.get()) + h.token_len, h.meta_len);
                }
                self->Dispatch(ep, gen, h, std::move(token), std::move(meta), buf, payload_offset);
              });
  return UCS_OK;
}

void OnServerEpError(void* arg, ucp_ep_h ep, ucs_status_t) { static_cast<ServerState*>(arg)->DropEndpoint(ep); }
void OnServerSentinelError(void* arg, ucp_ep_h sentinel, ucs_status_t) {
  auto* st = static_cast<ServerState*>(arg);
  auto it = st->data_of.find(sentinel);
  if (it != st->data_of.end()) st->DropEndpoint(it->second);
}
ucs_status_t OnPing(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) { return UCS_OK; }

// Opens a peer-failure-mode endpoint to `address` that carries one ping (to
// complete its wireup) and nothing else.
ucp_ep_h OpenSentinel(ucp_worker_h worker, const void* address, ucp_err_handler_cb_t cb, void* arg) {
  ucp_ep_params_t p{};
  p.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = static_cast<const ucp_address_t*>(address);
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = cb;
  p.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(worker, &p, &ep) != UCS_OK) return nullptr;
  auto* ctx = new SendCtx();
  ctx->header.assign(8, 0);
  SendAm(ep, kPingAm, ctx);
  return ep;
}

// A client introduces itself with its worker address; the server opens an
// endpoint back to it (with peer-failure handling) for the replies.
ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) {
  auto* st = static_cast<ServerState*>(arg);
  if (header_length != sizeof(HelloHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length == 0 ||
      length > 65536) {
    return UCS_OK;
  }
  HelloHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (st->clients.count(h.client_id)) return UCS_OK;
  ucp_ep_params_t p{};
  p.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = static_cast<const ucp_address_t*>(data);
  p.err_mode = h.same_host ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = OnServerEpError;
  p.err_handler.arg = st;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(st->loop->worker(), &p, &ep) != UCS_OK) return UCS_OK;
  const uint64_t gen = st->next_generation++;
  st->eps[ep] = gen;
  st->clients[h.client_id] = ep;
  if (h.same_host) {
    if (ucp_ep_h sen = OpenSentinel(st->loop->worker(), data, OnServerSentinelError, st)) {
      st->sentinel_of[ep] = sen;
      st->data_of[sen] = ep;
    }
  }
  st->SendReply(ep, gen, /*the hello's request id*/ 0, absl::OkStatus(), "", {}, nullptr);
  return UCS_OK;
}

}  // namespace

// ------------------------------------------------------------------ client

struct ClientState {
  struct Pending {
    std::promise<UcxReply> promise;
    absl::Span<uint8_t> buffer;
  };
  UcxWorkerLoop* loop = nullptr;
  ucp_ep_h ep = nullptr;        // loop thread
  ucp_ep_h sentinel = nullptr;  // loop thread: same-host failure detector
  uint64_t client_id = 0;       // set before any send
  // Staged request payloads (same host), kept warm: a few per size.
  std::shared_ptr<BufferPool> staging = std::make_shared<BufferPool>(4);
  absl::Mutex mu;
  bool connected ABSL_GUARDED_BY(mu) = true;
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Pending>> pending ABSL_GUARDED_BY(mu);

  std::shared_ptr<Pending> Take(uint64_t id) {
    absl::MutexLock g(&mu);
    auto it = pending.find(id);
    if (it == pending.end()) return nullptr;
    auto p = it->second;
    pending.erase(it);
    return p;
  }
  void FailAll(const absl::Status& s) {
    std::unordered_map<uint64_t, std::shared_ptr<Pending>> all;
    {
      absl::MutexLock g(&mu);
      connected = false;
      all.swap(pending);
    }
    for (auto& [id, p] : all) {
      UcxReply r;
      r.status = s;
      p->promise.set_value(std::move(r));
    }
  }
};

namespace {

ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) {
  auto* st = static_cast<ClientState*>(arg);
  if (header_length < sizeof(RepHeader)) return UCS_OK;
  RepHeader h;
  std::memcpy(&h, header, sizeof(h));
  const uint64_t pieces = uint64_t{h.msg_len} + h.meta_len;
  const bool inline_pieces = h.flags & kInlinePieces;
  if (inline_pieces ? header_length != sizeof(RepHeader) + pieces : pieces > length) return UCS_OK;
  auto p = st->Take(h.request_id);
  if (p == nullptr) return UCS_OK;  // timed out: drop
  auto reply = std::make_shared<UcxReply>();
  std::string msg, meta;
  if (inline_pieces) {
    const char* q = static_cast<const char*>(header) + sizeof(RepHeader);
    msg.assign(q, h.msg_len);
    meta.assign(q + h.msg_len, h.meta_len);
  }
  // With the pieces inline, the data is the payload: straight into the
  // caller's buffer when it fits.
  auto staging = std::make_shared<std::vector<uint8_t>>();
  uint8_t* dst;
  if (inline_pieces && length <= p->buffer.size() && p->buffer.data() != nullptr) {
    reply->payload_in_buffer = true;
    dst = p->buffer.data();
  } else if (inline_pieces) {
    reply->payload.resize(length);
    dst = reply->payload.data();
  } else {
    staging->resize(length);
    dst = staging->data();
  }
  ReceiveData(st->loop->worker(), data, length, param, dst,
              [p, reply, h, msg = std::move(msg), meta = std::move(meta), staging, inline_pieces,
               length](ucs_status_t s) mutable {
                if (s != UCS_OK) {
                  reply->status = UcsError(s, "receiving a UCX reply");
                } else {
                  if (!inline_pieces) {
                    const char* d = reinterpret_cast<const char*>(staging->data());
                    msg.assign(d, h.msg_len);
                    meta.assign(d + h.msg_len, h.meta_len);
                    reply->payload.assign(staging->begin() + static_cast<long>(h.msg_len + h.meta_len), staging->end());
                  }
                  reply->status = absl::Status(static_cast<absl::StatusCode>(h.code), msg);
                  reply->meta = std::move(meta);
                  reply->payload_size = inline_pieces ? length : reply->payload.size();
                }
                p->promise.set_value(std::move(*reply));
              });
  return UCS_OK;
}

void OnClientEpError(void* arg, ucp_ep_h, ucs_status_t s) {
  static_cast<ClientState*>(arg)->FailAll(UcsError(s, "UCX connection to the daemon failed"));
}

std::string Hex(const void* p, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t b = static_cast<const uint8_t*>(p)[i];
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 0xf]);
  }
  return out;
}

}  // namespace
}  // namespace ucx_internal

using namespace ucx_internal;

void UcxReplier::Send(const absl::Status& status, std::string meta, std::vector<absl::Span<const uint8_t>> payload,
                      std::shared_ptr<void> keepalive) {
  if (!server_) return;
  std::shared_ptr<ServerState> s = std::move(server_);
  {
    absl::MutexLock g(&s->mu);
    if (!s->alive) return;
  }
  s->SendReply(static_cast<ucp_ep_h>(ep_), ep_generation_, request_id_, status, std::move(meta), std::move(payload),
               std::move(keepalive));
}

absl::StatusOr<std::unique_ptr<UcxRpcServer>> UcxRpcServer::Start(const std::string& listen, UcxHandler handler,
                                                                  ThreadPool* pool, uint64_t max_message_bytes,
                                                                  UcxFastHandler fast_handler,
                                                                  const UcxLoopOptions& lo) {
  // Only the interface of the listen address (all of them for 0.0.0.0).
  absl::StatusOr<std::string> device = NetDeviceOf(listen);
  if (!device.ok()) return device.status();
  UcxLoopOptions server_lo = lo;
  if (server_lo.net_devices.empty()) server_lo.net_devices = *device;
  auto loop = UcxWorkerLoop::Create(UCP_FEATURE_AM, "kvring-ucx-server", server_lo);
  if (!loop.ok()) return loop.status();
  std::unique_ptr<UcxRpcServer> srv(new UcxRpcServer());
  srv->loop_ = std::move(*loop);
  srv->state_ = std::make_shared<ServerState>();
  ServerState* st = srv->state_.get();
  st->loop = srv->loop_.get();
  st->handler = std::move(handler);
  st->fast_handler = std::move(fast_handler);
  st->pool = pool;
  st->max_bytes = max_message_bytes;
  absl::StatusOr<std::string> addr = srv->loop_->Run([&]() -> absl::StatusOr<std::string> {
    for (auto [id, cb] :
         {std::pair<unsigned, ucp_am_recv_callback_t>{kRequestAm, OnRequest}, {kHelloAm, OnHello}, {kPingAm, OnPing}}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = cb;
      hp.arg = st;
      ucs_status_t s = ucp_worker_set_am_recv_handler(st->loop->worker(), &hp);
      if (s != UCS_OK) return UcsError(s, "ucp_worker_set_am_recv_handler");
    }
    // Peers connect by worker address: UCX then picks every transport the two
    // workers share (shared memory and CMA on one host, TCP/RDMA across hosts;
    // a sockaddr connection would get TCP lanes only).
    ucp_address_t* wa = nullptr;
    size_t wlen = 0;
    ucs_status_t s = ucp_worker_get_address(st->loop->worker(), &wa, &wlen);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_get_address");
    std::string a = absl::StrCat("ucxw:", Hex(wa, wlen), "@", HostKey());
    ucp_worker_release_address(st->loop->worker(), wa);
    return a;
  });
  if (!addr.ok()) return addr.status();
  srv->address_ = *addr;
  ServerState* raw = st;
  srv->loop_->SetPeriodic([raw] { raw->Sweep(); }, std::chrono::milliseconds(500));
  return srv;
}

UcxRpcServer::~UcxRpcServer() {
  {
    absl::MutexLock g(&state_->mu);
    state_->alive = false;
  }
  ServerState* st = state_.get();
  loop_->Stop([st] {
    for (auto& [ep, gen] : st->eps) CloseEndpoint(st->loop->worker(), ep);
    for (auto& [sen, ep] : st->data_of) CloseEndpoint(st->loop->worker(), sen);
    st->eps.clear();
    st->clients.clear();
    st->data_of.clear();
    st->sentinel_of.clear();
  });
}

template <typename F>
bool UcxRpcClient::WaitFor(F& f, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    const auto slice = std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(50));
    if (f.wait_for(slice) == std::future_status::ready) return true;
    if (peer_alive_ && !peer_alive_()) return false;
    if (!connected()) return false;  // broken meanwhile (the sentinel saw the peer die)
  }
}

absl::StatusOr<std::unique_ptr<UcxRpcClient>> UcxRpcClient::Connect(const std::string& address, absl::Duration timeout,
                                                                    std::function<bool()> peer_alive,
                                                                    const UcxLoopOptions& lo) {
  const size_t at = address.find('@');
  const std::string hex_part = address.substr(0, at);
  const std::string host_key = at == std::string::npos ? "" : address.substr(at + 1);
  if (hex_part.rfind("ucxw:", 0) != 0 || hex_part.size() % 2 != 1 || hex_part.size() < 7) {
    return absl::InvalidArgumentError("a UCX address is 'ucxw:<hex worker address>@<host key>'");
  }
  // Same host: shared memory and CMA are possible, but only without UCX's
  // peer-failure mode; timeouts (here and on the server) stand in for it.
  const bool same_host = !host_key.empty() && host_key == HostKey();
  std::vector<uint8_t> server_addr;
  for (size_t i = 5; i + 1 < hex_part.size(); i += 2) {
    auto v = [](char c) { return c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= '0' && c <= '9' ? c - '0' : -1; };
    const int hi = v(hex_part[i]), lo = v(hex_part[i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("a UCX address is 'ucxw:<hex worker address>'");
    server_addr.push_back(static_cast<uint8_t>(hi * 16 + lo));
  }
  auto loop = UcxWorkerLoop::Create(UCP_FEATURE_AM, "kvring-ucx-client", lo);
  if (!loop.ok()) return loop.status();
  std::unique_ptr<UcxRpcClient> c(new UcxRpcClient());
  c->loop_ = std::move(*loop);
  c->state_ = std::make_shared<ClientState>();
  c->address_ = address.substr(0, 21) + "...";
  c->same_host_ = same_host;
  c->peer_alive_ = std::move(peer_alive);
  ClientState* st = c->state_.get();
  st->loop = c->loop_.get();
  {
    std::random_device rd;
    st->client_id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  // The hello's reply (request id 0) proves both directions work.
  auto hello = std::make_shared<ClientState::Pending>();
  std::future<UcxReply> hello_done = hello->promise.get_future();
  {
    absl::MutexLock g(&st->mu);
    st->pending[0] = hello;
  }
  absl::Status s = c->loop_->Run([&]() -> absl::Status {
    ucs_status_t u = UCS_OK;
    for (auto [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{kReplyAm, OnReply}, {kPingAm, OnPing}}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = cb;
      hp.arg = st;
      u = ucp_worker_set_am_recv_handler(st->loop->worker(), &hp);
      if (u != UCS_OK) return UcsError(u, "ucp_worker_set_am_recv_handler");
    }
    ucp_ep_params_t p{};
    p.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>(server_addr.data());
    p.err_mode = same_host ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnClientEpError;
    p.err_handler.arg = st;
    u = ucp_ep_create(st->loop->worker(), &p, &st->ep);
    if (u != UCS_OK) return UcsError(u, "UCX connect");
    if (same_host) st->sentinel = OpenSentinel(st->loop->worker(), server_addr.data(), OnClientEpError, st);
    ucp_address_t* wa = nullptr;
    size_t wlen = 0;
    u = ucp_worker_get_address(st->loop->worker(), &wa, &wlen);
    if (u != UCS_OK) return UcsError(u, "ucp_worker_get_address");
    auto* ctx = new SendCtx();
    HelloHeader h{st->client_id, same_host ? 1u : 0u, 0};
    ctx->header.resize(sizeof(h));
    std::memcpy(ctx->header.data(), &h, sizeof(h));
    ctx->staged.assign(reinterpret_cast<const uint8_t*>(wa), reinterpret_cast<const uint8_t*>(wa) + wlen);
    ctx->data = ctx->staged.data();
    ctx->length = ctx->staged.size();
    ucp_worker_release_address(st->loop->worker(), wa);
    SendAm(st->ep, kHelloAm, ctx);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (hello_done.wait_for(absl::ToChronoMilliseconds(timeout)) != std::future_status::ready) {
    st->Take(0);
    return absl::UnavailableError(absl::StrCat("UCX daemon did not answer within ", absl::FormatDuration(timeout)));
  }
  UcxReply r = hello_done.get();
  if (!r.status.ok()) return absl::UnavailableError(absl::StrCat("UCX hello failed: ", r.status.message()));
  return c;
}

UcxRpcClient::~UcxRpcClient() {
  ClientState* st = state_.get();
  loop_->Stop([st] {
    if (st->ep != nullptr) CloseEndpoint(st->loop->worker(), st->ep);
    if (st->sentinel != nullptr) CloseEndpoint(st->loop->worker(), st->sentinel);
    st->ep = nullptr;
    st->sentinel = nullptr;
  });
  state_->FailAll(absl::CancelledError("client closed"));
}

void UcxRpcClient::Break(const absl::Status& why) {
  ClientState* st = state_.get();
  state_->FailAll(why);
  loop_->Post([st] {
    if (st->ep != nullptr) CloseEndpoint(st->loop->worker(), st->ep);
    if (st->sentinel != nullptr) CloseEndpoint(st->loop->worker(), st->sentinel);
    st->ep = nullptr;
    st->sentinel = nullptr;
  });
}

bool UcxRpcClient::connected() const {
  absl::MutexLock g(&state_->mu);
  return state_->connected;
}

absl::StatusOr<UcxReply> UcxRpcClient::Call(uint32_t method, const std::string& token, const std::string& meta,
                                            absl::Span<const absl::Span<const uint8_t>> payload,
                                            absl::Span<uint8_t> reply_buffer, absl::Duration timeout) {
  ClientState* st = state_.get();
  auto pending = std::make_shared<ClientState::Pending>();
  pending->buffer = reply_buffer;
  std::future<UcxReply> fut = pending->promise.get_future();
  uint64_t id;
  {
    absl::MutexLock g(&st->mu);
    if (!st->connected) return absl::UnavailableError(absl::StrCat("UCX connection to ", address_, " is down"));
    id = st->next_id++;
    st->pending[id] = pending;
  }
  ReqHeader h{id, st->client_id, method, static_cast<uint32_t>(token.size()), static_cast<uint32_t>(meta.size()), 0};
  // Same-host endpoints run without peer-failure mode (shared-memory
  // transports do not support it), so a send to a peer that died cannot be
  // cancelled: stage the payload, so a stalled send never holds the
  // caller's memory and Call can return. Across hosts the endpoint is in
  // peer-failure mode, closing it cancels the send, and the payload goes
  // zero-copy.
  SendCtx* c = BuildMessage(h, {token, meta}, std::vector<absl::Span<const uint8_t>>(payload.begin(), payload.end()),
                            loop_->max_am_header(), /*stage=*/same_host_, st->staging.get());
  auto send_done = std::make_shared<std::promise<ucs_status_t>>();
  std::shared_future<ucs_status_t> sent = send_done->get_future().share();
  // A failed send also completes the call (the reply will never come), so
  // the caller below sleeps once, on the reply, not first on the send.
  std::shared_ptr<ClientState> state = state_;
  c->done = [send_done, state, id](ucs_status_t s) {
    send_done->set_value(s);
    if (s != UCS_OK) {
      if (auto p = state->Take(id)) p->promise.set_value(UcxReply{});
    }
  };
  loop_->Post([st, c] {
    if (st->ep == nullptr) {
      OnSendDone(nullptr, UCS_ERR_NOT_CONNECTED, c);
      return;
    }
    SendAm(st->ep, kRequestAm, c);
  });
  // One wait, for the reply (or the send's failure): a reply means the
  // request was taken, so the send's completion is in or about to be.
  if (!WaitFor(fut, timeout)) {
    if (sent.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      // The send itself stalled. The payload must stay untouched until the
      // send completes: if the peer stops taking it, close the endpoint
      // (which cancels the send) before returning.
      const absl::Status why = absl::UnavailableError(
          absl::StrCat("UCX send to ", address_, " stalled for ", absl::FormatDuration(timeout)));
      Break(why);
      st->Take(id);
      if (same_host_)
        return why;  // staged: nothing of the caller's is referenced (the context is freed if the send ever ends)
      sent.wait();   // peer-failure mode: closing the endpoint cancels the send
      return why;
    }
    if (sent.get() == UCS_OK && st->Take(id) != nullptr) {
      // Without peer-failure detection a dead peer looks like silence: treat
      // it as a broken connection (the next call reconnects).
      const absl::Status why = absl::UnavailableError(
          absl::StrCat("no UCX reply from ", address_, " within ", absl::FormatDuration(timeout)));
      Break(why);
      return why;
    }
    // The reply (or the send's failure) is landing right now: wait for it.
    fut.wait();
  }
  // The call has its answer (a reply, or the connection's or the send's
  // failure). A zero-copy payload (across hosts) must not be returned to the
  // caller while the send may still read it; a staged one (same host) may:
  // there a send to a dead peer may never end.
  if (sent.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (!same_host_ && !WaitFor(sent, timeout)) {
      Break(absl::UnavailableError(absl::StrCat("UCX send to ", address_, " did not end")));
      sent.wait();  // peer-failure mode: closing the endpoint cancels the send
    }
  } else if (const ucs_status_t ss = sent.get(); ss != UCS_OK) {
    st->Take(id);
    return UcsError(ss, absl::StrCat("UCX send to ", address_));
  }
  return fut.get();
}

}  // namespace kvring

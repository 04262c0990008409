#include "kvring/transport/ucx_rpc.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>
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
constexpr unsigned kByeAm = 5;  // a client leaving: the server closes its endpoint now

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
  uint32_t same_host;   // the client is on this host
  uint32_t pid;         // same host: the client's pid and its start time (/proc/<pid>/stat),
  uint64_t start_time;  // watched by the server to find a client that died without a bye
};
struct ByeHeader {
  uint64_t client_id;
};
static_assert(sizeof(ReqHeader) == 32 && sizeof(RepHeader) == 24 && sizeof(HelloHeader) == 24);

// The start time of process `pid` in clock ticks since boot (field 22 of
// /proc/<pid>/stat), 0 when there is no such process: with the pid it names
// one process, whatever pids are reused later.
uint64_t ProcessStartTime(uint32_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return 0;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (p == nullptr) return 0;
  int field = 2;  // fields after the name: 3 (state) ... 22 (starttime)
  for (++p; *p != 0; ++p) {
    if (*p == ' ' && ++field == 22) return std::strtoull(p + 1, nullptr, 10);
  }
  return 0;
}

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
void SendAm(ucp_ep_h ep, unsigned id, SendCtx* ctx, uint32_t flags = 0) {
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = flags;
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
  // Loop thread only. Every endpoint, on one host too, runs in UCX's
  // peer-failure mode (the shared-memory transports with error handling,
  // see UcxWorkerLoop): only such an endpoint can be closed at once (UCX 1.13
  // keeps any other, with the client's shared-memory segments it attached,
  // until the worker is destroyed), and its failure is reported.
  struct Client {
    ucp_ep_h ep = nullptr;
    uint32_t pid = 0;  // same host: watched by Sweep (0: across hosts, or not told)
    uint64_t start_time = 0;
  };
  std::unordered_map<ucp_ep_h, uint64_t> eps;    // ep -> generation
  std::unordered_map<uint64_t, Client> clients;  // client id -> the endpoint back to it
  uint64_t next_generation = 1;
  // Replies in flight (loop thread only): a reply older than reply_timeout
  // (a client that stopped taking messages) closes its endpoint, which
  // cancels everything pending on it and releases the blocks it held.
  std::unordered_map<SendCtx*, ucp_ep_h> inflight;
  std::chrono::milliseconds reply_timeout{30000};
  // "<pid>:<start time>" of this process, for the hello's reply (set once).
  std::string process_id;

  // Closes a client's endpoint and forgets it: its transport resources
  // (shared-memory segments, sockets) go with it. Loop thread, never inside
  // a UCX callback of that endpoint.
  void DropEndpoint(ucp_ep_h ep) {
    if (!eps.erase(ep)) return;
    for (auto it = clients.begin(); it != clients.end();) {
      it = it->second.ep == ep ? clients.erase(it) : std::next(it);
    }
    CloseEndpoint(loop->worker(), ep);
  }
  void Sweep() {
    const auto now = std::chrono::steady_clock::now();
    std::vector<ucp_ep_h> dead;
    for (auto& [c, ep] : inflight) {
      if (now - c->started > reply_timeout) dead.push_back(ep);
    }
    // Same-host clients that died without a bye (kill -9, a crash).
    for (auto& [id, c] : clients) {
      if (c.pid != 0 && ProcessStartTime(c.pid) != c.start_time) dead.push_back(c.ep);
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
  ucp_ep_h ep = cit->second.ep;
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

// A client's endpoint failed (the client died, or its connection broke):
// closed after this callback returns.
void OnServerEpError(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* st = static_cast<ServerState*>(arg);
  st->loop->Post([self = st->shared_from_this(), ep] { self->DropEndpoint(ep); });
}

// A client introduces itself with its worker address; the server opens an
// endpoint back to it for the replies. The client's own endpoint and this one
// are one connection to UCX (it matches them); neither side ever closes its
// endpoint while the other may still be wiring it up, except the server on
// a bye or a failure: see SayBye.
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
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = OnServerEpError;
  p.err_handler.arg = st;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(st->loop->worker(), &p, &ep) != UCS_OK) return UCS_OK;
  const uint64_t gen = st->next_generation++;
  st->eps[ep] = gen;
  ServerState::Client c;
  c.ep = ep;
  if (h.same_host && h.pid != 0 && ProcessStartTime(h.pid) == h.start_time) {
    c.pid = h.pid;
    c.start_time = h.start_time;
  }
  st->clients[h.client_id] = c;
  // The reply names this process, so that a same-host client notices its
  // death at once instead of at a timeout.
  st->SendReply(ep, gen, /*the hello's request id*/ 0, absl::OkStatus(), st->process_id, {}, nullptr);
  return UCS_OK;
}

// A client leaving in order: its endpoint goes now, not at a timeout.
ucs_status_t OnBye(void* arg, const void* header, size_t header_length, void*, size_t, const ucp_am_recv_param_t*) {
  auto* st = static_cast<ServerState*>(arg);
  if (header_length != sizeof(ByeHeader)) return UCS_OK;
  ByeHeader h;
  std::memcpy(&h, header, sizeof(h));
  auto it = st->clients.find(h.client_id);
  if (it == st->clients.end()) return UCS_OK;
  st->loop->Post([self = st->shared_from_this(), ep = it->second.ep] { self->DropEndpoint(ep); });
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
  ucp_ep_h ep = nullptr;  // loop thread
  bool bye_sent = false;  // loop thread
  // Sends not completed yet (loop thread): the worker's destruction drops
  // them without their callbacks, so the destructor frees what is left.
  std::unordered_set<SendCtx*> outstanding;
  uint64_t client_id = 0;  // set before any send
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

// A client's send, tracked until it completes (ClientState::outstanding).
void ClientSend(ClientState* st, unsigned id, SendCtx* c, uint32_t flags = 0) {
  st->outstanding.insert(c);
  c->untrack = [st, c] { st->outstanding.erase(c); };
  SendAm(st->ep, id, c, flags);
}

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
  {
    const uint32_t pid = static_cast<uint32_t>(::getpid());
    st->process_id = absl::StrCat(pid, ":", ProcessStartTime(pid));
  }
  absl::StatusOr<std::string> addr = srv->loop_->Run([&]() -> absl::StatusOr<std::string> {
    for (auto [id, cb] :
         {std::pair<unsigned, ucp_am_recv_callback_t>{kRequestAm, OnRequest}, {kHelloAm, OnHello}, {kByeAm, OnBye}}) {
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

uint64_t UcxRpcServer::sleeps() const { return loop_->sleeps(); }

UcxRpcServer::~UcxRpcServer() {
  {
    absl::MutexLock g(&state_->mu);
    state_->alive = false;
  }
  ServerState* st = state_.get();
  loop_->Stop([st] {
    for (auto& [ep, gen] : st->eps) CloseEndpoint(st->loop->worker(), ep);
    st->eps.clear();
    st->clients.clear();
  });
  loop_.reset();  // the worker is gone: replies still in flight get no callback
  for (auto& [c, ep] : state_->inflight) delete c;
  state_->inflight.clear();
}

template <typename F>
bool UcxRpcClient::WaitFor(F& f, absl::Duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
  // Poll first for as long as the progress thread spins (UcxLoopOptions):
  // a reply it takes while spinning then wakes no one.
  const auto spin_until = std::min(deadline, std::chrono::steady_clock::now() + loop_->spin_window());
  while (std::chrono::steady_clock::now() < spin_until) {
    if (f.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return true;
  }
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    const auto slice = std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(50));
    if (f.wait_for(slice) == std::future_status::ready) return true;
    if (peer_alive_ && !peer_alive_()) return false;
    if (!connected()) return false;  // broken meanwhile
    // A same-host daemon that died (its pid gone or reused): no reply comes.
    if (server_pid_ != 0 && ProcessStartTime(server_pid_) != server_start_time_) return false;
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
    {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = kReplyAm;
      hp.cb = OnReply;
      hp.arg = st;
      u = ucp_worker_set_am_recv_handler(st->loop->worker(), &hp);
      if (u != UCS_OK) return UcsError(u, "ucp_worker_set_am_recv_handler");
    }
    ucp_ep_params_t p{};
    p.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.address = reinterpret_cast<const ucp_address_t*>(server_addr.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnClientEpError;
    p.err_handler.arg = st;
    u = ucp_ep_create(st->loop->worker(), &p, &st->ep);
    if (u != UCS_OK) return UcsError(u, "UCX connect");
    ucp_address_t* wa = nullptr;
    size_t wlen = 0;
    u = ucp_worker_get_address(st->loop->worker(), &wa, &wlen);
    if (u != UCS_OK) return UcsError(u, "ucp_worker_get_address");
    auto* ctx = new SendCtx();
    const uint32_t pid = static_cast<uint32_t>(::getpid());
    HelloHeader h{st->client_id, same_host ? 1u : 0u, same_host ? pid : 0u, same_host ? ProcessStartTime(pid) : 0};
    ctx->header.resize(sizeof(h));
    std::memcpy(ctx->header.data(), &h, sizeof(h));
    ctx->staged.assign(reinterpret_cast<const uint8_t*>(wa), reinterpret_cast<const uint8_t*>(wa) + wlen);
    ctx->data = ctx->staged.data();
    ctx->length = ctx->staged.size();
    ucp_worker_release_address(st->loop->worker(), wa);
    ClientSend(st, kHelloAm, ctx);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (hello_done.wait_for(absl::ToChronoMilliseconds(timeout)) != std::future_status::ready) {
    st->Take(0);
    return absl::UnavailableError(absl::StrCat("UCX daemon did not answer within ", absl::FormatDuration(timeout)));
  }
  UcxReply r = hello_done.get();
  if (!r.status.ok()) return absl::UnavailableError(absl::StrCat("UCX hello failed: ", r.status.message()));
  uint32_t spid = 0;
  unsigned long long sstart = 0;
  if (same_host && std::sscanf(r.meta.c_str(), "%u:%llu", &spid, &sstart) == 2 && ProcessStartTime(spid) == sstart) {
    c->server_pid_ = spid;
    c->server_start_time_ = sstart;
  }
  return c;
}

namespace {
// Tells the server this client is leaving, so that it closes its endpoint
// (and the shared-memory segments it attached) now. Loop thread. The
// client's own endpoint is closed only when its worker is about to go, with
// no progress in between: UCX 1.13 answers the server's wireup messages for
// an endpoint closed mid-connection with a new endpoint, and the server
// aborts on the changed peer id (a client that timed out at once, and closed
// its endpoints on a worker that lived on, killed daemons that way).
void SayBye(ClientState* st) {
  if (st->ep == nullptr || st->bye_sent) return;
  st->bye_sent = true;
  auto sent = std::make_shared<bool>(false);
  auto* ctx = new SendCtx();
  ByeHeader h{st->client_id};
  ctx->header.resize(sizeof(h));
  std::memcpy(ctx->header.data(), &h, sizeof(h));
  ctx->done = [sent](ucs_status_t) { *sent = true; };
  ClientSend(st, kByeAm, ctx, UCP_AM_SEND_FLAG_EAGER);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (!*sent && std::chrono::steady_clock::now() < until) ucp_worker_progress(st->loop->worker());
}
}  // namespace

UcxRpcClient::~UcxRpcClient() {
  ClientState* st = state_.get();
  // The bye, then the endpoint closed (cancelling any send still in flight:
  // the worker may not be destroyed with requests pending) with no progress
  // after it; the worker goes with loop_.
  loop_->Stop([st] {
    SayBye(st);
    if (st->ep != nullptr) CloseEndpoint(st->loop->worker(), st->ep);
    st->ep = nullptr;
  });
  state_->FailAll(absl::CancelledError("client closed"));
  loop_.reset();  // the worker is gone: no send callback can come any more
  for (SendCtx* c : state_->outstanding) delete c;
  state_->outstanding.clear();
}

void UcxRpcClient::Break(const absl::Status& why) {
  // Every pending call fails now and the connection is not used again (the
  // caller connects afresh); the server closes its side on the bye.
  state_->FailAll(why);
  ClientState* st = state_.get();
  loop_->Post([st] { SayBye(st); });
}

uint64_t UcxRpcClient::sleeps() const { return loop_->sleeps(); }

bool UcxRpcClient::connected() const {
  absl::MutexLock g(&state_->mu);
  return state_->connected;
}

absl::StatusOr<UcxReply> UcxRpcClient::Call(uint32_t method, const std::string& token, const std::string& meta,
                                            absl::Span<const absl::Span<const uint8_t>> payload,
                                            absl::Span<uint8_t> reply_buffer, absl::Duration timeout) {
  absl::StatusOr<UcxPendingCall> call = Start(method, token, meta, payload, reply_buffer);
  if (!call.ok()) return call.status();
  return Finish(std::move(*call), timeout);
}

absl::StatusOr<UcxPendingCall> UcxRpcClient::Start(uint32_t method, const std::string& token, const std::string& meta,
                                                   absl::Span<const absl::Span<const uint8_t>> payload,
                                                   absl::Span<uint8_t> reply_buffer) {
  ClientState* st = state_.get();
  auto pending = std::make_shared<ClientState::Pending>();
  pending->buffer = reply_buffer;
  UcxPendingCall call;
  call.reply_ = pending->promise.get_future();
  {
    absl::MutexLock g(&st->mu);
    if (!st->connected) return absl::UnavailableError(absl::StrCat("UCX connection to ", address_, " is down"));
    call.id_ = st->next_id++;
    st->pending[call.id_] = pending;
  }
  call.state_ = state_;
  const uint64_t id = call.id_;
  ReqHeader h{id, st->client_id, method, static_cast<uint32_t>(token.size()), static_cast<uint32_t>(meta.size()), 0};
  // The message owns its payload (staged, in pooled buffers when large), so
  // a send that stalls or outlives the call never reads the caller's memory
  // and Finish always returns by its deadline: a connection is abandoned,
  // never closed under a send (SayBye says why).
  SendCtx* c = BuildMessage(h, {token, meta}, std::vector<absl::Span<const uint8_t>>(payload.begin(), payload.end()),
                            loop_->max_am_header(), /*stage=*/true, st->staging.get());
  auto send_done = std::make_shared<std::promise<int>>();
  call.sent_ = send_done->get_future().share();
  // A failed send also completes the call (the reply will never come), so
  // the caller sleeps once, on the reply, not first on the send.
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
    ClientSend(st, kRequestAm, c);
  });
  return call;
}

absl::StatusOr<UcxReply> UcxRpcClient::Finish(UcxPendingCall call, absl::Duration timeout) {
  if (call.state_ != state_) return absl::InvalidArgumentError("UcxRpcClient::Finish: a call of another client");
  ClientState* st = state_.get();
  const uint64_t id = call.id_;
  call.state_ = nullptr;  // finished here, whatever happens
  std::future<UcxReply>& fut = call.reply_;
  std::shared_future<int>& sent = call.sent_;
  // One wait, for the reply (or the send's failure): a reply means the
  // request was taken, so the send's completion is in or about to be.
  if (!WaitFor(fut, timeout)) {
    if (sent.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      // The send itself stalled (a peer that stopped taking messages).
      const absl::Status why = absl::UnavailableError(
          absl::StrCat("UCX send to ", address_, " stalled for ", absl::FormatDuration(timeout)));
      Break(why);
      st->Take(id);
      return why;  // staged: nothing of the caller's is referenced (the context is freed if the send ever ends)
    }
    if (sent.get() == UCS_OK && st->Take(id) != nullptr) {
      // Sent, but no reply in time: the connection is treated as broken (the
      // next call reconnects; a late reply finds no call and is dropped).
      const absl::Status why = absl::UnavailableError(
          absl::StrCat("no UCX reply from ", address_, " within ", absl::FormatDuration(timeout)));
      Break(why);
      return why;
    }
    // The reply (or the send's failure) is landing right now: wait for it.
    fut.wait();
  }
  if (sent.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    if (const ucs_status_t ss = static_cast<ucs_status_t>(sent.get()); ss != UCS_OK) {
      st->Take(id);
      return UcsError(ss, absl::StrCat("UCX send to ", address_));
    }
  }
  return fut.get();
}

UcxPendingCall& UcxPendingCall::operator=(UcxPendingCall&& o) noexcept {
  if (this != &o) {
    Abandon();
    state_ = std::exchange(o.state_, nullptr);
    id_ = o.id_;
    reply_ = std::move(o.reply_);
    sent_ = std::move(o.sent_);
  }
  return *this;
}

void UcxPendingCall::Abandon() {
  if (state_ == nullptr) return;
  // Taken out, no reply lands in the caller's buffer later; already taken,
  // the reply (or the send's failure) is landing now: wait for it.
  if (state_->Take(id_) == nullptr && reply_.valid()) reply_.wait();
  state_ = nullptr;
}

}  // namespace kvring

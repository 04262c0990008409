#include "kvring/transport/ucx_rpc.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <future>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "ucx_worker.h"

namespace kvring {
namespace ucx_internal {
namespace {

constexpr unsigned kRequestAm = 1;
constexpr unsigned kReplyAm = 2;

struct ReqHeader {
  uint64_t request_id;
  uint32_t method, token_len, meta_len, pad;
};
struct RepHeader {
  uint64_t request_id;
  int32_t code;
  uint32_t msg_len, meta_len, pad;
};
static_assert(sizeof(ReqHeader) == 24 && sizeof(RepHeader) == 24);

// Everything an in-flight send must keep alive.
struct SendCtx {
  std::vector<uint8_t> header;
  std::string a, b;  // small data pieces (token/meta or msg/meta)
  std::vector<ucp_dt_iov_t> iov;
  std::shared_ptr<void> keepalive;
  std::function<void(ucs_status_t)> done;
};

void OnSendDone(void* request, ucs_status_t status, void* user) {
  auto* ctx = static_cast<SendCtx*>(user);
  if (ctx->done) ctx->done(status);
  delete ctx;
  if (request != nullptr) ucp_request_free(request);
}

// Sends an AM; `ctx` is consumed (deleted when the send completes).
void SendAm(ucp_ep_h ep, unsigned id, SendCtx* ctx, uint32_t flags) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
                   UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = OnSendDone;
  p.user_data = ctx;
  p.datatype = ucp_dt_make_iov();
  p.flags = flags;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, ctx->header.data(), ctx->header.size(), ctx->iov.data(), ctx->iov.size(), &p);
  if (r == nullptr) {
    OnSendDone(nullptr, UCS_OK, ctx);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnSendDone(nullptr, UCS_PTR_STATUS(r), ctx);
  }
}

void AddIov(SendCtx* c, const void* p, size_t n) {
  if (n > 0) c->iov.push_back(ucp_dt_iov_t{const_cast<void*>(p), n});
}

}  // namespace

// ------------------------------------------------------------------ server

struct ServerState : std::enable_shared_from_this<ServerState> {
  UcxWorkerLoop* loop = nullptr;
  ucp_listener_h listener = nullptr;
  UcxHandler handler;
  ThreadPool* pool = nullptr;
  uint64_t max_bytes = 0;
  std::mutex mu;
  bool alive = true;                                   // guarded by mu
  std::unordered_map<ucp_ep_h, uint64_t> eps;         // loop thread only
  uint64_t next_generation = 1;                        // loop thread only

  void Dispatch(ucp_ep_h ep, const ReqHeader& h, std::shared_ptr<std::vector<uint8_t>> buf) {
    auto it = eps.find(ep);
    if (it == eps.end()) return;
    auto req = std::make_shared<UcxRequest>();
    req->method = h.method;
    const uint8_t* d = buf->data();
    req->token.assign(reinterpret_cast<const char*>(d), h.token_len);
    req->meta.assign(reinterpret_cast<const char*>(d + h.token_len), h.meta_len);
    req->payload = absl::MakeConstSpan(d + h.token_len + h.meta_len, buf->size() - h.token_len - h.meta_len);
    req->storage = buf;
    auto rep = std::make_shared<UcxReplier>();
    rep->server_ = shared_from_this();
    rep->ep_ = ep;
    rep->request_id_ = h.request_id;
    rep->ep_generation_ = it->second;
    UcxHandler* handler_ptr = &handler;
    pool->Submit([handler_ptr, req, rep]() mutable { (*handler_ptr)(std::move(*req), std::move(*rep)); });
  }

  void SendReply(ucp_ep_h ep, uint64_t gen, uint64_t id, const absl::Status& status, std::string meta,
                 std::vector<absl::Span<const uint8_t>> payload, std::shared_ptr<void> keepalive) {
    auto* c = new SendCtx();
    RepHeader h{id, static_cast<int32_t>(status.code()), static_cast<uint32_t>(status.message().size()),
                static_cast<uint32_t>(meta.size()), 0};
    c->header.resize(sizeof(h));
    std::memcpy(c->header.data(), &h, sizeof(h));
    c->a = std::string(status.message());
    c->b = std::move(meta);
    c->keepalive = std::move(keepalive);
    AddIov(c, c->a.data(), c->a.size());
    AddIov(c, c->b.data(), c->b.size());
    for (auto s : payload) AddIov(c, s.data(), s.size());
    auto self = shared_from_this();
    loop->Post([self, ep, gen, c] {
      auto it = self->eps.find(ep);
      if (it == self->eps.end() || it->second != gen) {  // the client went away
        delete c;
        return;
      }
      if (c->iov.empty()) {
        static char zero = 0;
        c->iov.push_back(ucp_dt_iov_t{&zero, 0});
      }
      SendAm(ep, kReplyAm, c, 0);
    });
  }
};

namespace {

struct PendingRecv {
  std::shared_ptr<ServerState> st;
  ucp_ep_h ep;
  ReqHeader h;
  std::shared_ptr<std::vector<uint8_t>> buf;
};

void OnServerData(void* request, ucs_status_t status, size_t, void* user) {
  auto* p = static_cast<PendingRecv*>(user);
  if (status == UCS_OK) p->st->Dispatch(p->ep, p->h, p->buf);
  delete p;
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data, size_t length,
                       const ucp_am_recv_param_t* param) {
  auto* st = static_cast<ServerState*>(arg);
  if (header_length != sizeof(ReqHeader) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  ReqHeader h;
  std::memcpy(&h, header, sizeof(h));
  ucp_ep_h ep = param->reply_ep;
  auto it = st->eps.find(ep);
  if (it == st->eps.end()) return UCS_OK;
  if (uint64_t{h.token_len} + h.meta_len > length || length > st->max_bytes) {
    st->SendReply(ep, it->second, h.request_id,
                  absl::InvalidArgumentError(absl::StrCat("malformed or oversize UCX request (", length, " bytes)")), "", {},
                  nullptr);
    return UCS_OK;
  }
  auto buf = std::make_shared<std::vector<uint8_t>>(length);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    auto* p = new PendingRecv{st->shared_from_this(), ep, h, buf};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = OnServerData;
    rp.user_data = p;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(st->loop->worker(), data, buf->data(), length, &rp);
    if (r == nullptr) {
      OnServerData(nullptr, UCS_OK, length, p);
    } else if (UCS_PTR_IS_ERR(r)) {
      delete p;
    }
    return UCS_OK;
  }
  if (length) std::memcpy(buf->data(), data, length);
  st->Dispatch(ep, h, buf);
  return UCS_OK;
}

void OnServerEpError(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* st = static_cast<ServerState*>(arg);
  if (st->eps.erase(ep)) CloseEndpoint(st->loop->worker(), ep);
}

void OnConnection(ucp_conn_request_h conn, void* arg) {
  auto* st = static_cast<ServerState*>(arg);
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = conn;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = OnServerEpError;
  p.err_handler.arg = st;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(st->loop->worker(), &p, &ep) == UCS_OK) st->eps[ep] = st->next_generation++;
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
  std::mutex mu;
  bool connected = true;                                                // guarded by mu
  uint64_t next_id = 1;                                                 // guarded by mu
  std::unordered_map<uint64_t, std::shared_ptr<Pending>> pending;       // guarded by mu

  std::shared_ptr<Pending> Take(uint64_t id) {
    std::lock_guard<std::mutex> g(mu);
    auto it = pending.find(id);
    if (it == pending.end()) return nullptr;
    auto p = it->second;
    pending.erase(it);
    return p;
  }
  void FailAll(const absl::Status& s) {
    std::unordered_map<uint64_t, std::shared_ptr<Pending>> all;
    {
      std::lock_guard<std::mutex> g(mu);
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

struct ReplyRecv {
  std::shared_ptr<ClientState::Pending> p;
  RepHeader h;
  std::vector<uint8_t> head;  // msg || meta
  UcxReply reply;
  ucp_dt_iov_t iov[2];
};

void FinishReply(ReplyRecv* rr, ucs_status_t status) {
  if (status != UCS_OK) {
    rr->reply.status = UcsError(status, "receiving a UCX reply");
  } else {
    const char* d = reinterpret_cast<const char*>(rr->head.data());
    const std::string msg(d, rr->h.msg_len);
    rr->reply.status = absl::Status(static_cast<absl::StatusCode>(rr->h.code), msg);
    rr->reply.meta.assign(d + rr->h.msg_len, rr->h.meta_len);
  }
  rr->p->promise.set_value(std::move(rr->reply));
}

void OnClientData(void* request, ucs_status_t status, size_t, void* user) {
  auto* rr = static_cast<ReplyRecv*>(user);
  FinishReply(rr, status);
  delete rr;
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) {
  auto* st = static_cast<ClientState*>(arg);
  if (header_length != sizeof(RepHeader)) return UCS_OK;
  RepHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (uint64_t{h.msg_len} + h.meta_len > length) return UCS_OK;
  auto p = st->Take(h.request_id);
  if (p == nullptr) return UCS_OK;  // timed out: drop
  auto* rr = new ReplyRecv{p, h, std::vector<uint8_t>(h.msg_len + h.meta_len), {}, {}};
  const size_t payload = length - h.msg_len - h.meta_len;
  rr->reply.payload_size = payload;
  uint8_t* dst;
  if (payload <= p->buffer.size() && p->buffer.data() != nullptr) {
    rr->reply.payload_in_buffer = true;
    dst = p->buffer.data();
  } else {
    rr->reply.payload.resize(payload);
    dst = rr->reply.payload.data();
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    rr->iov[0] = ucp_dt_iov_t{rr->head.data(), rr->head.size()};
    rr->iov[1] = ucp_dt_iov_t{dst, payload};
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    rp.cb.recv_am = OnClientData;
    rp.user_data = rr;
    rp.datatype = ucp_dt_make_iov();
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(st->loop->worker(), data, rr->iov, 2, &rp);
    if (r == nullptr) {
      OnClientData(nullptr, UCS_OK, length, rr);
    } else if (UCS_PTR_IS_ERR(r)) {
      OnClientData(nullptr, UCS_PTR_STATUS(r), 0, rr);
    }
    return UCS_OK;
  }
  const uint8_t* d = static_cast<const uint8_t*>(data);
  if (!rr->head.empty()) std::memcpy(rr->head.data(), d, rr->head.size());
  if (payload) std::memcpy(dst, d + rr->head.size(), payload);
  FinishReply(rr, UCS_OK);
  delete rr;
  return UCS_OK;
}

void OnClientEpError(void* arg, ucp_ep_h, ucs_status_t s) {
  static_cast<ClientState*>(arg)->FailAll(UcsError(s, "UCX connection to the daemon failed"));
}

}  // namespace
}  // namespace ucx_internal

using namespace ucx_internal;

void UcxReplier::Send(const absl::Status& status, std::string meta, std::vector<absl::Span<const uint8_t>> payload,
                      std::shared_ptr<void> keepalive) {
  if (!server_) return;
  std::shared_ptr<ServerState> s = std::move(server_);
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (!s->alive) return;
  }
  s->SendReply(static_cast<ucp_ep_h>(ep_), ep_generation_, request_id_, status, std::move(meta), std::move(payload),
               std::move(keepalive));
}

absl::StatusOr<std::unique_ptr<UcxRpcServer>> UcxRpcServer::Start(const std::string& listen, UcxHandler handler,
                                                                  ThreadPool* pool, uint64_t max_message_bytes) {
  sockaddr_storage sa;
  socklen_t salen;
  if (absl::Status s = ToSockaddr(listen, &sa, &salen); !s.ok()) return s;
  auto loop = UcxWorkerLoop::Create(UCP_FEATURE_AM, "kvring-ucx-server");
  if (!loop.ok()) return loop.status();
  std::unique_ptr<UcxRpcServer> srv(new UcxRpcServer());
  srv->loop_ = std::move(*loop);
  srv->state_ = std::make_shared<ServerState>();
  ServerState* st = srv->state_.get();
  st->loop = srv->loop_.get();
  st->handler = std::move(handler);
  st->pool = pool;
  st->max_bytes = max_message_bytes;
  absl::StatusOr<std::string> addr = srv->loop_->Run([&]() -> absl::StatusOr<std::string> {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kRequestAm;
    hp.cb = OnRequest;
    hp.arg = st;
    ucs_status_t s = ucp_worker_set_am_recv_handler(st->loop->worker(), &hp);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_set_am_recv_handler");
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = salen;
    lp.conn_handler.cb = OnConnection;
    lp.conn_handler.arg = st;
    s = ucp_listener_create(st->loop->worker(), &lp, &st->listener);
    if (s != UCS_OK) return UcsError(s, absl::StrCat("UCX listen on ", listen));
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(st->listener, &la);
    if (s != UCS_OK) return UcsError(s, "ucp_listener_query");
    const int port = ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port);
    return absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  });
  if (!addr.ok()) return addr.status();
  srv->address_ = *addr;
  return srv;
}

UcxRpcServer::~UcxRpcServer() {
  {
    std::lock_guard<std::mutex> g(state_->mu);
    state_->alive = false;
  }
  ServerState* st = state_.get();
  loop_->Stop([st] {
    for (auto& [ep, gen] : st->eps) CloseEndpoint(st->loop->worker(), ep);
    st->eps.clear();
    if (st->listener != nullptr) ucp_listener_destroy(st->listener);
    st->listener = nullptr;
  });
}

absl::StatusOr<std::unique_ptr<UcxRpcClient>> UcxRpcClient::Connect(const std::string& address, absl::Duration timeout) {
  sockaddr_storage sa;
  socklen_t salen;
  if (absl::Status s = ToSockaddr(address, &sa, &salen); !s.ok()) return s;
  auto loop = UcxWorkerLoop::Create(UCP_FEATURE_AM, "kvring-ucx-client");
  if (!loop.ok()) return loop.status();
  std::unique_ptr<UcxRpcClient> c(new UcxRpcClient());
  c->loop_ = std::move(*loop);
  c->state_ = std::make_shared<ClientState>();
  c->address_ = address;
  ClientState* st = c->state_.get();
  st->loop = c->loop_.get();
  absl::Status s = c->loop_->Run([&]() -> absl::Status {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kReplyAm;
    hp.cb = OnReply;
    hp.arg = st;
    ucs_status_t u = ucp_worker_set_am_recv_handler(st->loop->worker(), &hp);
    if (u != UCS_OK) return UcsError(u, "ucp_worker_set_am_recv_handler");
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    p.sockaddr.addrlen = salen;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = OnClientEpError;
    p.err_handler.arg = st;
    u = ucp_ep_create(st->loop->worker(), &p, &st->ep);
    if (u != UCS_OK) return UcsError(u, absl::StrCat("UCX connect to ", address));
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  // A round trip proves the connection (the endpoint connects lazily).
  auto ping = c->Call(0, "", "", {}, {}, timeout);
  if (!ping.ok()) return absl::UnavailableError(absl::StrCat("UCX daemon at ", address, " did not answer: ", ping.status().message()));
  return c;
}

UcxRpcClient::~UcxRpcClient() {
  ClientState* st = state_.get();
  loop_->Stop([st] {
    if (st->ep != nullptr) CloseEndpoint(st->loop->worker(), st->ep);
    st->ep = nullptr;
  });
  state_->FailAll(absl::CancelledError("client closed"));
}

bool UcxRpcClient::connected() const {
  std::lock_guard<std::mutex> g(state_->mu);
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
    std::lock_guard<std::mutex> g(st->mu);
    if (!st->connected) return absl::UnavailableError(absl::StrCat("UCX connection to ", address_, " is down"));
    id = st->next_id++;
    st->pending[id] = pending;
  }
  auto send_done = std::make_shared<std::promise<ucs_status_t>>();
  std::future<ucs_status_t> sent = send_done->get_future();
  auto* c = new SendCtx();
  ReqHeader h{id, method, static_cast<uint32_t>(token.size()), static_cast<uint32_t>(meta.size()), 0};
  c->header.resize(sizeof(h));
  std::memcpy(c->header.data(), &h, sizeof(h));
  c->a = token;
  c->b = meta;
  AddIov(c, c->a.data(), c->a.size());
  AddIov(c, c->b.data(), c->b.size());
  for (auto s : payload) AddIov(c, s.data(), s.size());
  if (c->iov.empty()) {
    static char zero = 0;
    c->iov.push_back(ucp_dt_iov_t{&zero, 0});
  }
  c->done = [send_done](ucs_status_t s) { send_done->set_value(s); };
  loop_->Post([st, c] {
    if (st->ep == nullptr) {
      OnSendDone(nullptr, UCS_ERR_NOT_CONNECTED, c);
      return;
    }
    SendAm(st->ep, kRequestAm, c, UCP_AM_SEND_FLAG_REPLY);
  });
  // The payload must stay untouched until the send completes, whatever else happens.
  const ucs_status_t ss = sent.get();
  if (ss != UCS_OK) {
    st->Take(id);
    return UcsError(ss, absl::StrCat("UCX send to ", address_));
  }
  if (fut.wait_for(absl::ToChronoMilliseconds(timeout)) != std::future_status::ready) {
    if (st->Take(id) != nullptr) {
      return absl::DeadlineExceededError(absl::StrCat("no UCX reply from ", address_, " within ", absl::FormatDuration(timeout)));
    }
    // The reply is landing right now (perhaps into reply_buffer): wait for it.
  }
  return fut.get();
}

}  // namespace kvring

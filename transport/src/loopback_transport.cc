#include "kvring/transport/loopback_transport.h"

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvring {

namespace {
// Completion state shared by a request and the hub.
struct Completion {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<size_t> result ABSL_GUARDED_BY(mu) = size_t{0};
  void Complete(absl::StatusOr<size_t> r) {
    absl::MutexLock l(&mu);
    result = std::move(r);
    done = true;
  }
};

class LoopbackRequest final : public TransportRequest {
 public:
  explicit LoopbackRequest(std::shared_ptr<Completion> c, std::function<void()> cancel = nullptr)
      : c_(std::move(c)), cancel_(std::move(cancel)) {}
  ~LoopbackRequest() override {
    if (cancel_) cancel_();
  }
  absl::StatusOr<size_t> Wait(absl::Duration timeout) override {
    absl::MutexLock l(&c_->mu);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c_->mu) { return c_->done; };
    if (!c_->mu.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
      return absl::DeadlineExceededError("loopback: timed out waiting for the message");
    }
    return c_->result;
  }

 private:
  std::shared_ptr<Completion> c_;
  std::function<void()> cancel_;  // withdraws a posted receive
};
}  // namespace

class LoopbackHub {
 public:
  using Key = std::tuple<int, int, uint64_t>;  // src, dst, tag
  struct PostedRecv {
    absl::Span<uint8_t> buffer;
    std::shared_ptr<Completion> done;
  };

  absl::StatusOr<std::unique_ptr<TransportRequest>> Send(int src, int dst, uint64_t tag,
                                                         absl::Span<const uint8_t> data) {
    auto c = std::make_shared<Completion>();
    std::shared_ptr<Completion> recv_done;
    absl::StatusOr<size_t> recv_result = data.size();
    {
      absl::MutexLock l(&mu_);
      auto& posted = recvs_[Key{src, dst, tag}];
      if (!posted.empty()) {
        PostedRecv r = posted.front();
        posted.pop_front();
        if (data.size() > r.buffer.size()) {
          recv_result = absl::OutOfRangeError(absl::StrCat(
              "loopback: message of ", data.size(), " bytes does not fit the receive buffer of ", r.buffer.size()));
        } else if (!data.empty()) {
          std::memcpy(r.buffer.data(), data.data(), data.size());
        }
        recv_done = r.done;
      } else {
        msgs_[Key{src, dst, tag}].emplace_back(data.begin(), data.end());
      }
    }
    if (recv_done) recv_done->Complete(recv_result);
    c->Complete(data.size());
    return std::unique_ptr<TransportRequest>(new LoopbackRequest(c));
  }

  absl::StatusOr<std::unique_ptr<TransportRequest>> Recv(int src, int dst, uint64_t tag, absl::Span<uint8_t> buffer) {
    auto c = std::make_shared<Completion>();
    std::vector<uint8_t> msg;
    bool have = false;
    {
      absl::MutexLock l(&mu_);
      auto it = msgs_.find(Key{src, dst, tag});
      if (it != msgs_.end() && !it->second.empty()) {
        msg = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) msgs_.erase(it);
        have = true;
      } else {
        recvs_[Key{src, dst, tag}].push_back(PostedRecv{buffer, c});
      }
    }
    if (!have) {
      // Destroying the request before a message arrives withdraws the receive.
      std::weak_ptr<LoopbackHub> weak = self_;
      auto cancel = [weak, key = Key{src, dst, tag}, c] {
        if (auto hub = weak.lock()) hub->Withdraw(key, c);
      };
      return std::unique_ptr<TransportRequest>(new LoopbackRequest(c, std::move(cancel)));
    }
    {
      if (msg.size() > buffer.size()) {
        c->Complete(absl::OutOfRangeError(absl::StrCat("loopback: message of ", msg.size(),
                                                       " bytes does not fit the receive buffer of ", buffer.size())));
      } else {
        if (!msg.empty()) std::memcpy(buffer.data(), msg.data(), msg.size());
        c->Complete(msg.size());
      }
    }
    return std::unique_ptr<TransportRequest>(new LoopbackRequest(c));
  }

  void Withdraw(const Key& key, const std::shared_ptr<Completion>& c) {
    absl::MutexLock l(&mu_);
    auto it = recvs_.find(key);
    if (it == recvs_.end()) return;
    auto& q = it->second;
    for (auto p = q.begin(); p != q.end(); ++p) {
      if (p->done == c) {
        q.erase(p);
        break;
      }
    }
    if (q.empty()) recvs_.erase(it);
  }

  std::weak_ptr<LoopbackHub> self_;

 private:
  absl::Mutex mu_;
  std::map<Key, std::deque<std::vector<uint8_t>>> msgs_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::deque<PostedRecv>> recvs_ ABSL_GUARDED_BY(mu_);
};

std::vector<std::unique_ptr<Transport>> LoopbackTransport::CreateGroup(int size) {
  auto hub = std::make_shared<LoopbackHub>();
  hub->self_ = hub;
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < size; ++r) out.emplace_back(new LoopbackTransport(hub, r, size));
  return out;
}

absl::StatusOr<std::unique_ptr<TransportRequest>> LoopbackTransport::Isend(int peer, uint64_t tag,
                                                                           absl::Span<const uint8_t> data) {
  if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
  return hub_->Send(rank_, peer, tag, data);
}

absl::StatusOr<std::unique_ptr<TransportRequest>> LoopbackTransport::Irecv(int peer, uint64_t tag,
                                                                           absl::Span<uint8_t> buffer) {
  if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
  return hub_->Recv(peer, rank_, tag, buffer);
}

}  // namespace kvring

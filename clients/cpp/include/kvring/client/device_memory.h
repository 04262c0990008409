// DeviceMemory: how the client moves bytes between host and GPU memory when
// a caller hands it device pointers (GetInto into an engine's GPU KV pool,
// Put or Step from device tensors). Bytes cross the bus once, through pinned
// staging buffers the object keeps and reuses (payloads land in them from
// the network, are checksummed there, and go to the device in one copy).
// For a Step whose nodes share this host, exchange buffers: device memory
// the object owns and exports (CUDA IPC) so the nodes read the queries and
// write their partials there, and the partials are merged on the device.
//
// Streams: every asynchronous call takes `stream`, a cudaStream_t of this
// process (nullptr is the legacy default stream; ThreadStream() the calling
// thread's own).
// A caller that orders a step on its own stream (an engine's current
// stream) neither waits for its inputs nor for the output: its inputs are
// read after the stream's earlier work, nodes on this host wait on an event
// recorded there (RecordInputsEvent), and buffers that queued work uses are
// marked (UseOn(stream)), so nothing reuses them before the stream has
// passed that point.
//
// Thread-safe. In a build without CUDA, Create() returns UNIMPLEMENTED and
// IsDevicePointer() is false.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvring/layout/block_layout.h"

namespace kvring {

class DeviceMemory {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceMemory>> Create();
  virtual ~DeviceMemory() = default;

  // A pinned host buffer of at least `bytes`, owned by the handle until it
  // goes (then reused).
  class Staging {
   public:
    Staging() = default;
    Staging(Staging&& o) noexcept : owner_(o.owner_), p_(o.p_), n_(o.n_) { o.owner_ = nullptr; }
    Staging& operator=(Staging&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = o.owner_;
        p_ = o.p_;
        n_ = o.n_;
        o.owner_ = nullptr;
      }
      return *this;
    }
    ~Staging() { Release(); }
    uint8_t* data() const { return p_; }
    size_t size() const { return n_; }
    // Work queued on `stream` uses it: when it goes back to the pool, it is
    // handed out again only once the work queued there by then is done.
    void UseOn(void* stream) {
      after_ = stream;
      after_set_ = true;
    }

   private:
    friend class DeviceMemory;
    void Release();
    DeviceMemory* owner_ = nullptr;
    uint8_t* p_ = nullptr;
    size_t n_ = 0;
    void* after_ = nullptr;
    bool after_set_ = false;
  };
  virtual absl::StatusOr<Staging> Pinned(size_t bytes) = 0;
  // Device memory owned by this object and exported for nodes on this host
  // (kvring.proto DeviceExchange), at least `bytes`, 256-byte aligned; kept
  // and reused (a node maps a buffer once; sizes are powers of two from 16
  // MiB), owned by the handle until it goes. Freed with this object.
  class Exchange {
   public:
    Exchange() = default;
    Exchange(Exchange&& o) noexcept { *this = std::move(o); }
    Exchange& operator=(Exchange&& o) noexcept {
      if (this != &o) {
        Release();
        owner_ = o.owner_;
        p_ = o.p_;
        n_ = o.n_;
        handle_ = std::move(o.handle_);
        drop_ = o.drop_;
        after_ = o.after_;
        after_set_ = o.after_set_;
        o.owner_ = nullptr;
      }
      return *this;
    }
    ~Exchange() { Release(); }
    uint8_t* data() const { return p_; }
    size_t size() const { return n_; }
    // The allocation's cudaIpcMemHandle_t bytes.
    const std::string& ipc_handle() const { return handle_; }
    // Not reused once the handle goes: a node that did not answer may still
    // write into it.
    void Drop() { drop_ = true; }
    // Work queued on `stream` uses it: when it goes back to the pool, the
    // next user's stream first waits for the work queued there by then.
    void UseOn(void* stream) {
      after_ = stream;
      after_set_ = true;
    }

   private:
    friend class DeviceMemory;
    void Release();
    DeviceMemory* owner_ = nullptr;
    uint8_t* p_ = nullptr;
    size_t n_ = 0;
    std::string handle_;
    bool drop_ = false;
    void* after_ = nullptr;
    bool after_set_ = false;
  };
  // An exchange buffer for work on `stream`.
  virtual absl::StatusOr<Exchange> ExchangeBuffer(size_t bytes, void* stream) = 0;
  // Asynchronous copies (any direction; host memory pinned) and merges, in
  // order on `stream`; Wait(stream) waits for all of them.
  virtual absl::Status CopyAsync(void* dst, const void* src, size_t bytes, void* stream) = 0;
  // Device-to-device copies (memory of this context or mapped into it; no
  // two destinations overlap) queued on `stream` as one kernel launch per
  // few dozen copies, not one API call each.
  struct DeviceCopy {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
  };
  virtual absl::Status CopyDevice(absl::Span<const DeviceCopy> copies, void* stream) = 0;
  // kvring::cuda::MergeRows (attention/cuda merge_cuda.h): acc rows <- their
  // own partial (unless `init`) merged with the partial rows each one lists.
  // `csr` (host memory, read before the call returns) is contrib_begin
  // (rows + 1 entries) then contrib: small sets travel in the launch's
  // parameters; larger ones are copied to `csr_scratch` (device memory of
  // csr.size() entries, unused otherwise) on `stream` first. Empty: no row
  // has a contribution (with init: O = 0, LSE = -inf; without: the rows
  // stay as they are, and with `cast` are cast). `cast`: the
  // merged O also written there in cast_dtype (kBF16 or kF16; the shape of
  // acc_out), the engine's own dtype; null: not.
  virtual absl::Status MergeRows(float* acc_out, float* acc_lse, uint32_t rows, const float* parts_out,
                                 const float* parts_lse, absl::Span<const int32_t> csr, int32_t* csr_scratch,
                                 uint32_t q_heads, uint32_t head_dim, bool init, void* cast, DType cast_dtype,
                                 void* stream) = 0;
  virtual absl::Status Wait(void* stream) = 0;
  // Records an event on `stream` that a node on this host can wait on (CUDA
  // IPC): its cudaIpcEventHandle_t bytes. The events are pooled and
  // recorded again by later calls; a node waits on one before it answers.
  // UNIMPLEMENTED where the device has no IPC events (then: Wait).
  virtual absl::StatusOr<std::string> RecordInputsEvent(void* stream) = 0;
  // Work queued on `stream` from now on waits for a node's event (its
  // cudaIpcEventHandle_t bytes: AttendResponse.done_event), opened here once
  // and kept. FAILED_PRECONDITION when it cannot be opened.
  virtual absl::Status WaitNodeEvent(const std::string& ipc_event, void* stream) = 0;
  // Work queued on `stream` from now on waits until the 32-bit word at
  // `word` (device memory of this process; a node on this host sets it:
  // AttendResponse.done_flag) equals `value`. UNIMPLEMENTED where the
  // driver has no stream memory operations (WaitsOnWords says so first).
  virtual absl::Status WaitWord(const void* word, uint32_t value, void* stream) = 0;
  virtual bool WaitsOnWords() const = 0;
  // Sets the word at `word` (device memory of this process) to `value` from
  // a stream of this object's own, created non-blocking so that it waits for
  // nothing queued on the callers' streams (the legacy default stream
  // included); first, where `after_ipc_event` is given (a node's
  // AttendResponse.done_event), that stream waits for the node's work.
  // Returns once the word is set. What a detached step's collector sets a
  // job's word with when its node did not (DetachedRounds). UNIMPLEMENTED
  // where the driver has no stream memory operations.
  virtual absl::Status SetWord(void* word, uint32_t value, const std::string& after_ipc_event) {
    return absl::UnimplementedError("this device memory cannot set a word");
  }
  // Synchronous copies (complete on return).
  virtual absl::Status ToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status ToHost(void* dst, const void* src, size_t bytes) = 0;
  // Whether `p` is device (or managed) memory of this process's CUDA context.
  static bool IsDevicePointer(const void* p);
  // The calling thread's own stream (cudaStreamPerThread).
  static void* ThreadStream();

  // The allocation `p` lies in, exported for a node on this host to write
  // into (CUDA IPC): its handle's bytes, base and size. FAILED_PRECONDITION
  // for memory that cannot be exported (cudaMallocAsync pools, VMM
  // allocations such as torch's expandable segments).
  struct ExportedAllocation {
    std::string ipc_handle;
    uintptr_t base = 0;
    size_t bytes = 0;
  };
  virtual absl::StatusOr<ExportedAllocation> Export(const void* p) = 0;

 protected:
  // (after_set: in use by the work queued on stream `after` so far)
  virtual void Return(uint8_t* p, size_t n, void* after, bool after_set) = 0;
  // (drop: never hand it out again)
  virtual void ReturnExchange(uint8_t* p, size_t n, std::string handle, bool drop, void* after, bool after_set) = 0;
  Exchange MakeExchange(uint8_t* p, size_t n, std::string handle) {
    Exchange e;
    e.owner_ = this;
    e.p_ = p;
    e.n_ = n;
    e.handle_ = std::move(handle);
    return e;
  }
  Staging Make(uint8_t* p, size_t n) {
    Staging s;
    s.owner_ = this;
    s.p_ = p;
    s.n_ = n;
    return s;
  }
};

}  // namespace kvring

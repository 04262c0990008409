// Stream memory operations on a 32-bit word of device memory: one stream
// writes the word once its earlier work is done, another stream waits on
// the device until the word holds a value. With the word in memory shared
// by CUDA IPC, this orders two processes' device work with no event and no
// host in between: a GPU node's step and the engine's stream
// (DeviceExchange.done_flag_offset, docs/MPS.md).
//
// StreamWordWrite: queued on `stream`; the write follows the stream's
// earlier work, with a memory fence (what that work wrote is visible before
// the word is).
// StreamWordWait: queued on `stream`; the stream's later work waits until
// the word equals `value`.
// The driver's cuStreamWriteValue32 / cuStreamWaitValue32 (32-bit stream
// memory operations, which every device has since CUDA 12), reached through
// the runtime's entry point as cuda_ipc.h does, so that nothing links
// libcuda. UNIMPLEMENTED where the driver lacks them; INTERNAL when the
// driver refuses the operation.
//
// Header-only; thread-safe (the entry points are looked up once).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvring {

namespace stream_words_internal {
using Op = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

inline Op Lookup(const char* symbol) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(symbol, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Op>(f);
}

// Both operations, looked up once (null where the driver lacks one).
struct Ops {
  Op write = Lookup("cuStreamWriteValue32");
  Op wait = Lookup("cuStreamWaitValue32");
};
inline const Ops& Get() {
  static const Ops ops;
  return ops;
}

inline absl::Status Run(Op fn, absl::string_view what, void* stream, const void* word, uint32_t value,
                        unsigned int flags) {
  if (fn == nullptr) return absl::UnimplementedError(absl::StrCat("the CUDA driver has no ", what));
  if (CUresult r = fn(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value, flags);
      r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(what, ": CUDA driver error ", static_cast<int>(r)));
  }
  return absl::OkStatus();
}
}  // namespace stream_words_internal

inline absl::Status StreamWordWrite(void* stream, void* word, uint32_t value) {
  return stream_words_internal::Run(stream_words_internal::Get().write, "cuStreamWriteValue32", stream, word, value,
                                    CU_STREAM_WRITE_VALUE_DEFAULT);
}

inline absl::Status StreamWordWait(void* stream, const void* word, uint32_t value) {
  return stream_words_internal::Run(stream_words_internal::Get().wait, "cuStreamWaitValue32", stream, word, value,
                                    CU_STREAM_WAIT_VALUE_EQ);
}

// Whether this process's driver has both operations.
inline bool StreamWordsAvailable() {
  const stream_words_internal::Ops& ops = stream_words_internal::Get();
  return ops.write != nullptr && ops.wait != nullptr;
}

}  // namespace kvring

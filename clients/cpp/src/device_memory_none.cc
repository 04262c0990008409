// device_memory.h in a build without CUDA.
#include "kvring/client/device_memory.h"

namespace kvring {

void DeviceMemory::Staging::Release() { owner_ = nullptr; }
void DeviceMemory::Exchange::Release() { owner_ = nullptr; }

absl::StatusOr<std::unique_ptr<DeviceMemory>> DeviceMemory::Create() {
  return absl::UnimplementedError("device pointers need a kvring client built with CUDA");
}

bool DeviceMemory::IsDevicePointer(const void*) { return false; }
void* DeviceMemory::ThreadStream() { return nullptr; }

}  // namespace kvring

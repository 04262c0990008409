#include "kvring/control/device_delivery.h"

namespace kvring {

absl::StatusOr<std::unique_ptr<DeviceDelivery>> DeviceDelivery::Create(DeviceDeliveryOptions) {
  return absl::UnimplementedError("this kvring was built without CUDA: no delivery into GPU memory");
}

}  // namespace kvring

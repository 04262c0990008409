// A GPU daemon's death under decode: 4 kvringd --gpu daemons on one device
// (R=2, chunks of 2 blocks), 16 sequences decoding with append, one daemon
// SIGKILLed, the engine truncating and regenerating a token whose step
// failed. The same check as the CPU fault test (decode_through_death.h):
// after the map marks the node down no step fails (the tail chunk's new
// replica is repaired from the survivor's HBM-backed open block), no answer
// is wrong, and every sequence attends exactly at the end, at W=R and W=1.
// Skips without a GPU.
#include "../control/decode_through_death.h"
#include "require_gpu.h"

namespace kvring {
namespace {

testing::DecodeThroughDeathOptions GpuDaemons(int write_quorum) {
  testing::DecodeThroughDeathOptions o;
  o.write_quorum = write_quorum;
  o.daemon_flags = {"--gpu=0", "--hbm_bytes=128M"};
  o.page_bytes = "64K";  // an HBM page a block (16 KiB blocks): 2048 pages a daemon
  o.max_rel_l2 = 1e-2;
  o.max_lse_err = 1e-2;
  return o;
}

TEST(GpuFaultTest, AfterAGpuDaemonsDeathTheTailIsRepairedAndDecodeGoesOnAtWriteQuorumR) {
  KVRING_REQUIRE_GPU();
  testing::DecodeThroughANodesDeath(GpuDaemons(2));
}

TEST(GpuFaultTest, AfterAGpuDaemonsDeathTheTailIsRepairedAndDecodeGoesOnAtWriteQuorumOne) {
  KVRING_REQUIRE_GPU();
  testing::DecodeThroughANodesDeath(GpuDaemons(1));
}

}  // namespace
}  // namespace kvring

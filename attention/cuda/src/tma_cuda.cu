// Tensor maps of the page pool (tma_cuda.h).
#include "tma_cuda.h"

#include <cudaTypedefs.h>

#include <cstdint>

namespace kvring::cuda::internal {
namespace {

// The driver's cuTensorMapEncodeTiled, through the runtime (no libcuda link).
// Looked up once per process: a function pointer of the loaded driver.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

bool Sm90OrLater() {
  int dev = 0, major = 0;
  return cudaGetDevice(&dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
}

}  // namespace

bool MakePoolMap(const PagedKvView& kv, int box_tokens, CUtensorMap* map, bool all_column_blocks,
                 int l2_promotion_bytes) {
  if (box_tokens <= 0 || kv.block_tokens % box_tokens != 0 || kv.encoding.quantized() || !Sm90OrLater()) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const int D = kv.head_dim;
  const cuuint64_t planes = (cuuint64_t)kv.layers * 2 * kv.kv_heads, plane_bytes = (cuuint64_t)kv.block_tokens * D * 2;
  cuuint64_t dims[5] = {64, (cuuint64_t)(D / 64), (cuuint64_t)kv.block_tokens, planes, (cuuint64_t)INT32_MAX};
  cuuint64_t strides[4] = {128, (cuuint64_t)D * 2, plane_bytes, kv.page_stride};
  cuuint32_t box[5] = {64, 1, (cuuint32_t)box_tokens, 1, 1};
  if (all_column_blocks) {  // (columns, token, column block, plane, page): one box holds every column block
    dims[1] = (cuuint64_t)kv.block_tokens;
    dims[2] = (cuuint64_t)(D / 64);
    strides[0] = (cuuint64_t)D * 2;
    strides[1] = 128;
    box[1] = (cuuint32_t)box_tokens;
    box[2] = (cuuint32_t)(D / 64);
  }
  const cuuint32_t estrides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapL2promotion promo = l2_promotion_bytes >= 256   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                       : l2_promotion_bytes >= 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                       : l2_promotion_bytes >= 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                                                                   : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(kv.pool), dims, strides, box, estrides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool MakeQuantCodeMap(const PagedKvView& kv, int box_tokens, CUtensorMap* codes) {
  if (box_tokens <= 0 || kv.block_tokens % box_tokens != 0 || !kv.encoding.quantized() || kv.page_stride % 16 != 0 ||
      reinterpret_cast<uintptr_t>(kv.pool) % 16 != 0 || (kv.head_dim != 64 && kv.head_dim != 128) || !Sm90OrLater()) {
    return false;
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const int D = kv.head_dim;
  const cuuint64_t planes = (cuuint64_t)kv.layers * 2 * kv.kv_heads, plane_bytes = (cuuint64_t)kv.block_tokens * D;
  const cuuint64_t cdims[5] = {(cuuint64_t)D, (cuuint64_t)kv.block_tokens, planes, 1, (cuuint64_t)INT32_MAX};
  const cuuint64_t cstrides[4] = {(cuuint64_t)D, plane_bytes, planes * plane_bytes, kv.page_stride};
  const cuuint32_t cbox[5] = {(cuuint32_t)D, (cuuint32_t)box_tokens, 1, 1, 1}, est5[5] = {1, 1, 1, 1, 1};
  return encode(codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, const_cast<void*>(kv.pool), cdims, cstrides, cbox, est5,
                CU_TENSOR_MAP_INTERLEAVE_NONE, D == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool MakeQueryMap(const QueryView& q, int head_dim, int box_rows, CUtensorMap* map) {
  if (head_dim % 64 != 0 || box_rows <= 0 || box_rows > 256 || q.num_rows <= 0 ||
      reinterpret_cast<uintptr_t>(q.q) % 16 != 0 || !Sm90OrLater()) {
    return false;
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {(cuuint64_t)head_dim, (cuuint64_t)q.q_heads, (cuuint64_t)q.num_rows};
  const cuuint64_t strides[2] = {(cuuint64_t)head_dim * 2, (cuuint64_t)q.q_heads * head_dim * 2};
  const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows}, estrides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(q.q), dims, strides, box, estrides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace kvring::cuda::internal

// libFuzzer target: block decoding. The first bytes choose a layout and a
// KvEncoding byte; the rest is a payload fed to every decoder a node or
// client runs on stored or received bytes: DequantizeBlock, QuantizeBlock
// (NaN/Inf must be refused), PartialAttention reading the block directly
// (plain or quantized codes), and the cold tier's Decompress. Sizes that do
// not match must be errors, never reads out of bounds.
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvring/attention/partial_attention.h"
#include "kvring/cache/quantize.h"
#include "kvring/cache/rocksdb_cold_tier.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvring;
  if (size < 7) return 0;
  const DType dts[] = {DType::kF32, DType::kF16, DType::kBF16};
  BlockLayout l{1u + data[0] % 32u, 1u + data[1] % 3u, 1u + data[2] % 4u, 8u * (1u + data[3] % 8u), dts[data[4] % 3]};
  KvEncoding enc;
  const bool enc_ok = KvEncoding::Unpack(data[5], &enc);
  absl::Span<const uint8_t> payload(data + 6, size - 6);

  std::vector<uint8_t> out;
  (void)RocksDbColdTier::Decompress(payload, &out, 1 << 20);
  if (!enc_ok) return 0;
  (void)DequantizeBlock(l, enc, payload, &out);
  if (!enc.quantized()) (void)QuantizeBlock(l, payload, KvEncoding{KvCodec::kInt8, enc.scales}, &out);

  // Attention straight over the bytes when they are exactly one block.
  if (payload.size() == EncodedBytes(l, enc)) {
    std::vector<uint8_t> block(payload.begin(), payload.end());  // aligned copy
    const uint32_t q_heads = l.kv_heads * (1 + data[0] % 2);
    std::vector<float> q(size_t{2} * q_heads * l.head_dim, 0.25f);
    std::vector<int64_t> pos = {static_cast<int64_t>(data[1] % 40), 100};
    QueryTensor qt{q.data(), DType::kF32, 2, q_heads, l.head_dim, pos.data(), nullptr};
    KvBlockRef ref{block.data(), static_cast<int64_t>(data[2] % 8), 1u + data[3] % l.block_tokens};
    std::vector<uint32_t> begin{0, 1};
    AttentionOptions o;
    o.layer = data[4] % l.layers;
    o.window = data[5] % 3;
    PartialResult r(2, q_heads, l.head_dim);
    (void)PartialAttention(o, qt, PagedKv{l, enc, absl::MakeConstSpan(&ref, 1), begin}, r.view());
  }
  return 0;
}

// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/):
// valid requests of every kind and valid blocks of every encoding, so the
// fuzzers start from inputs that reach deep into the code.
//   kvring_fuzz_seeds <corpus dir>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvring.pb.h"
#include "kvring/cache/block_meta.h"
#include "kvring/cache/quantize.h"
#include "kvring/cache/rocksdb_cold_tier.h"
#include "kvring/control/request_validation.h"

using namespace kvring;

namespace {

void Write(const std::filesystem::path& dir, const std::string& name, uint8_t kind, uint8_t split,
           const std::string& body) {
  std::filesystem::create_directories(dir);
  std::ofstream f(dir / name, std::ios::binary);
  f.put(static_cast<char>(kind));
  f.put(static_cast<char>(split));
  f << body;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root(argv[1]);
  const BlockLayout L{2, 1, 1, 8, DType::kBF16};
  std::vector<uint8_t> plain(L.bytes());
  for (size_t i = 0; i < plain.size(); i += 2) plain[i + 1] = 0x3f;  // bf16 ~0.5-1.0
  v1::RequestHeader h;
  h.set_version(1);
  // Put with an inline payload (a block and a sequence ref), then Get / Lookup / Attend / Pin of it.
  v1::PutRequest put;
  *put.mutable_header() = h;
  v1::PutBlock* b = put.add_blocks();
  KeyToProto(BlockKey{1, 2}, b->mutable_block()->mutable_key());
  LayoutToProto(L, b->mutable_block()->mutable_layout());
  b->mutable_block()->set_payload_bytes(static_cast<uint32_t>(plain.size()));
  b->mutable_block()->set_checksum(PayloadChecksum(plain.data(), plain.size()));
  b->set_payload(std::string(plain.begin(), plain.end()));
  b->mutable_sequence()->set_sequence_id("s1");
  b->mutable_sequence()->set_block_index(0);
  Write(root / "requests", "put", 1, 0, put.SerializeAsString());
  v1::PutRequest q8 = put;
  q8.set_quantize("int8/kivi");
  Write(root / "requests", "put-int8", 1, 0, q8.SerializeAsString());
  v1::PutRequest ext = put;
  ext.mutable_blocks(0)->clear_payload();
  const std::string m = ext.SerializeAsString();
  Write(root / "requests", "put-external", 2, static_cast<uint8_t>(255 * m.size() / (m.size() + plain.size())),
        m + std::string(plain.begin(), plain.end()));
  v1::GetRequest get;
  *get.mutable_header() = h;
  KeyToProto(BlockKey{1, 2}, get.add_keys());
  Write(root / "requests", "get", 3, 0, get.SerializeAsString());
  v1::LookupRequest lookup;
  *lookup.mutable_header() = h;
  KeyToProto(BlockKey{1, 2}, lookup.add_keys());
  lookup.set_each(true);
  Write(root / "requests", "lookup", 0, 0, lookup.SerializeAsString());
  v1::AttendRequest at;
  *at.mutable_header() = h;
  v1::AttendSequence* as = at.add_sequences();
  as->set_sequence_id("s1");
  as->set_tokens(16);
  as->set_rows(1);
  as->add_ranges()->set_end(1);
  at.set_num_rows(1);
  at.set_q_heads(1);
  at.set_head_dim(8);
  at.set_q_dtype(0);
  at.add_positions(1);
  at.set_causal(true);
  at.set_queries(std::string(8 * 4, '\0'));
  Write(root / "requests", "attend", 4, 0, at.SerializeAsString());
  // An append that opens a block, then attends over it.
  v1::AttendRequest ap = at;
  v1::Layout* al = ap.mutable_layout();
  al->set_block_tokens(16);
  al->set_layers(1);
  al->set_kv_heads(1);
  al->set_head_dim(8);
  al->set_dtype(0);
  ap.mutable_sequences(0)->set_sequence_id("s2");
  ap.mutable_sequences(0)->set_tokens(2);
  ap.mutable_sequences(0)->set_append_tokens(2);
  ap.set_new_k(std::string(2 * 8 * 4, '\0'));
  ap.set_new_v(std::string(2 * 8 * 4, '\0'));
  Write(root / "requests", "attend-append", 4, 0, ap.SerializeAsString());
  v1::PinRequest pin;
  *pin.mutable_header() = h;
  KeyToProto(BlockKey{1, 2}, pin.add_keys());
  Write(root / "requests", "pin", 5, 0, pin.SerializeAsString());
  // Blocks: the layout bytes of L (fuzz_blocks' decoding), then a payload per encoding.
  const uint8_t lhdr[5] = {1, 0, 0, 0, 2};  // block_tokens 2, layers 1, kv_heads 1, head_dim 8, bf16
  auto write_block = [&](const std::string& name, uint8_t enc, const std::vector<uint8_t>& p) {
    std::filesystem::create_directories(root / "blocks");
    std::ofstream f(root / "blocks" / name, std::ios::binary);
    f.write(reinterpret_cast<const char*>(lhdr), 5);
    f.put(static_cast<char>(enc));
    f.write(reinterpret_cast<const char*>(p.data()), static_cast<std::streamsize>(p.size()));
  };
  write_block("plain", 0, plain);
  for (const char* e : {"int8/per-head", "int8/per-token", "int8/kivi", "fp8/per-head", "fp8/kivi"}) {
    KvEncoding enc;
    std::vector<uint8_t> codes;
    if (!ParseKvEncoding(e, &enc).ok() || !QuantizeBlock(L, plain, enc, &codes).ok()) return 1;
    std::string name(e);
    for (char& c : name) c = c == '/' ? '-' : c;
    write_block(name, enc.Pack(), codes);
  }
  for (ColdCodec c : {ColdCodec::kNone, ColdCodec::kZstd, ColdCodec::kLz4}) {
    std::string packed;
    if (!RocksDbColdTier::Compress(c, 1, plain, &packed).ok()) return 1;
    write_block("cold-" + std::to_string(static_cast<int>(c)), 0xff,
                std::vector<uint8_t>(packed.begin(), packed.end()));
  }
  std::printf("seed corpus written to %s\n", root.c_str());
  return 0;
}

// RocksDbColdTier: the SSD tier, a RocksDB database with two column families:
//   "meta":   scoped key -> block metadata and parent (small; scanned at start)
//   "blocks": scoped key -> payload, losslessly compressed (zstd or lz4)
// Both are written in one atomic WriteBatch. Payloads are compressed by
// kvring (RocksDB's own block compression is off for that family) so the
// ratio is measured and the payload checksum is verified after
// decompression on every read.
//
// Thread-safe (RocksDB is). Open() fails with the RocksDB error when the
// directory cannot be opened (e.g. locked by another process).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvring/cache/cold_tier.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace kvring {

enum class ColdCodec : uint8_t { kNone = 0, kZstd = 1, kLz4 = 2 };

struct RocksDbColdTierOptions {
  // Directory of the database (created if missing). Required.
  std::string path;
  // Payload compression. Default: zstd (level 1: ~the speed of lz4 on KV
  // data, better ratio; see bench/RESULTS.md).
  ColdCodec codec = ColdCodec::kZstd;
  int zstd_level = 1;
  // fsync the WAL on every write: a Write that returned OK survives power
  // loss. Default: false (survives a process crash, not a power cut).
  bool sync_writes = false;
  // After a failed write (disk full, I/O error) RocksDB must not be written
  // until resumed: writes are refused (UNAVAILABLE) without touching it, and
  // the first one at least this long after the last attempt calls
  // DB::Resume(), so writes start again by themselves once space returns (no
  // restart). Default: 1 s.
  absl::Duration resume_interval = absl::Seconds(1);
};

// Parses "zstd", "lz4", "none".
absl::StatusOr<ColdCodec> ParseColdCodec(std::string_view name);

class RocksDbColdTier final : public ColdTier {
 public:
  static absl::StatusOr<std::unique_ptr<RocksDbColdTier>> Open(const RocksDbColdTierOptions& options);
  ~RocksDbColdTier() override;
  RocksDbColdTier(const RocksDbColdTier&) = delete;
  RocksDbColdTier& operator=(const RocksDbColdTier&) = delete;

  absl::Status Write(const ColdBlockInfo& info, absl::Span<const uint8_t> payload) override;
  absl::Status Read(const ScopedKey& key, ColdBlockInfo* info, std::vector<uint8_t>* payload) override;
  absl::Status Erase(const ScopedKey& key) override;
  absl::Status Scan(const std::function<void(const ColdBlockInfo&)>& visit) override;
  ColdTierStats stats() const override;

  // Lossless codec round trip, exposed for the compression benchmark.
  static absl::Status Compress(ColdCodec codec, int level, absl::Span<const uint8_t> in, std::string* out);
  // DATA_LOSS for anything malformed, including a claimed size over max_raw.
  static absl::Status Decompress(absl::Span<const uint8_t> in, std::vector<uint8_t>* out,
                                 uint64_t max_raw = kMaxBlockBytes);

 private:
  RocksDbColdTier(const RocksDbColdTierOptions& options, rocksdb::DB* db,
                  std::vector<rocksdb::ColumnFamilyHandle*> handles);
  RocksDbColdTierOptions options_;
  rocksdb::DB* db_;
  rocksdb::ColumnFamilyHandle* meta_;
  rocksdb::ColumnFamilyHandle* blocks_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
  std::atomic<uint64_t> blocks_count_{0}, raw_bytes_{0}, stored_bytes_{0};
  std::atomic<uint64_t> writes_{0}, reads_{0}, write_errors_{0}, read_errors_{0};
  // After a failed write: UNAVAILABLE without touching the database until
  // resume_interval has passed since the last attempt, then DB::Resume();
  // OK once writes may go on.
  absl::Status ResumeAfterFailure();
  std::atomic<bool> write_failed_{false};
  std::atomic<int64_t> last_resume_ns_{0};
};

}  // namespace kvring

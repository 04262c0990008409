#include "kvring/cache/rocksdb_cold_tier.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvring/cache/rocksdb_logger.h"
#include "kvring/common/quote.h"
#include "kvring/common/status_macros.h"
#include "lz4.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"
#include "zstd.h"

namespace kvring {
namespace {

// Value of the "blocks" family: u8 codec, u8 pad[3], u32 raw length, then data.
constexpr size_t kBlobHeader = 8;
// Value of the "meta" family (fixed layout, little-endian host order).
struct MetaWire {
  uint32_t version;
  uint32_t block_tokens, layers, kv_heads, head_dim;
  uint8_t dtype, encoding, pad0, pad1;
  uint32_t payload_bytes;
  uint64_t checksum;
  uint32_t owner, pad2;
  uint64_t parent_lo, parent_hi;
  uint64_t stored_bytes;
};
static_assert(sizeof(MetaWire) == 72);

std::string DbKey(const ScopedKey& k) {
  std::string s(24, '\0');
  std::memcpy(s.data(), &k.ns, 8);
  std::memcpy(s.data() + 8, &k.key.lo, 8);
  std::memcpy(s.data() + 16, &k.key.hi, 8);
  return s;
}

absl::Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNotFound()) return absl::NotFoundError(what);
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(absl::StrCat(what, ": disk full: ", s.ToString()));
  if (s.IsCorruption()) return absl::DataLossError(absl::StrCat(what, ": ", s.ToString()));
  if (s.IsIOError()) return absl::UnavailableError(absl::StrCat(what, ": I/O error: ", s.ToString()));
  return absl::InternalError(absl::StrCat(what, ": ", s.ToString()));
}

}  // namespace

absl::StatusOr<ColdCodec> ParseColdCodec(std::string_view name) {
  if (name == "zstd") return ColdCodec::kZstd;
  if (name == "lz4") return ColdCodec::kLz4;
  if (name == "none") return ColdCodec::kNone;
  return absl::InvalidArgumentError(absl::StrCat("unknown cold-tier codec ", Quote(name), " (zstd, lz4, none)"));
}

absl::Status RocksDbColdTier::Compress(ColdCodec codec, int level, absl::Span<const uint8_t> in, std::string* out) {
  out->resize(kBlobHeader);
  const uint32_t raw = static_cast<uint32_t>(in.size());
  size_t n = 0;
  switch (codec) {
    case ColdCodec::kZstd: {
      out->resize(kBlobHeader + ZSTD_compressBound(in.size()));
      n = ZSTD_compress(out->data() + kBlobHeader, out->size() - kBlobHeader, in.data(), in.size(), level);
      if (ZSTD_isError(n)) return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(n)));
      break;
    }
    case ColdCodec::kLz4: {
      const int bound = LZ4_compressBound(static_cast<int>(in.size()));
      out->resize(kBlobHeader + bound);
      const int r = LZ4_compress_default(reinterpret_cast<const char*>(in.data()), out->data() + kBlobHeader,
                                         static_cast<int>(in.size()), bound);
      if (r <= 0) return absl::InternalError("lz4 compression failed");
      n = static_cast<size_t>(r);
      break;
    }
    case ColdCodec::kNone:
      break;
  }
  if (codec == ColdCodec::kNone || n >= in.size()) {  // store raw when it does not help
    codec = ColdCodec::kNone;
    out->resize(kBlobHeader + in.size());
    std::memcpy(out->data() + kBlobHeader, in.data(), in.size());
  } else {
    out->resize(kBlobHeader + n);
  }
  (*out)[0] = static_cast<char>(codec);
  std::memcpy(out->data() + 4, &raw, 4);
  return absl::OkStatus();
}

absl::Status RocksDbColdTier::Decompress(absl::Span<const uint8_t> in, std::vector<uint8_t>* out, uint64_t max_raw) {
  if (in.size() < kBlobHeader) return absl::DataLossError("cold block shorter than its header");
  uint32_t raw;
  std::memcpy(&raw, in.data() + 4, 4);
  if (raw > max_raw) {
    return absl::DataLossError(absl::StrCat("cold block claims ", raw, " bytes; at most ", max_raw, " expected"));
  }
  out->resize(raw);
  const uint8_t* data = in.data() + kBlobHeader;
  const size_t n = in.size() - kBlobHeader;
  switch (static_cast<ColdCodec>(in[0])) {
    case ColdCodec::kNone:
      if (n != raw) return absl::DataLossError("cold block size mismatch");
      if (n > 0) std::memcpy(out->data(), data, n);  // (memcpy of an empty vector's null data is UB)
      return absl::OkStatus();
    case ColdCodec::kZstd: {
      const size_t r = ZSTD_decompress(out->data(), raw, data, n);
      if (ZSTD_isError(r) || r != raw) return absl::DataLossError("cold block fails zstd decompression");
      return absl::OkStatus();
    }
    case ColdCodec::kLz4: {
      const int r = LZ4_decompress_safe(reinterpret_cast<const char*>(data), reinterpret_cast<char*>(out->data()),
                                        static_cast<int>(n), static_cast<int>(raw));
      if (r < 0 || static_cast<uint32_t>(r) != raw) return absl::DataLossError("cold block fails lz4 decompression");
      return absl::OkStatus();
    }
  }
  return absl::DataLossError("cold block has an unknown codec");
}

RocksDbColdTier::RocksDbColdTier(const RocksDbColdTierOptions& options, rocksdb::DB* db,
                                 std::vector<rocksdb::ColumnFamilyHandle*> handles)
    : options_(options), db_(db), meta_(handles[1]), blocks_(handles[2]), handles_(std::move(handles)) {}

RocksDbColdTier::~RocksDbColdTier() {
  for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
  delete db_;
}

absl::StatusOr<std::unique_ptr<RocksDbColdTier>> RocksDbColdTier::Open(const RocksDbColdTierOptions& o) {
  if (o.path.empty()) return absl::InvalidArgumentError("cold tier path is empty");
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.max_background_jobs = 2;
  dbo.info_log = MakeRocksDbLogger("cold tier");  // no LOG file on the data disk (rocksdb_logger.h says why)
  rocksdb::ColumnFamilyOptions meta_opts;
  rocksdb::ColumnFamilyOptions blob_opts;
  blob_opts.compression = rocksdb::kNoCompression;  // payloads arrive compressed
  blob_opts.write_buffer_size = 64 << 20;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, meta_opts}, {"meta", meta_opts}, {"blocks", blob_opts}};
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(dbo, o.path, cfs, &handles, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("opening cold tier at ", o.path));
  std::unique_ptr<RocksDbColdTier> tier(new RocksDbColdTier(o, db, std::move(handles)));
  // Count what is there (for stats).
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), tier->meta_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->value().size() != sizeof(MetaWire)) continue;
    MetaWire m;
    std::memcpy(&m, it->value().data(), sizeof(m));
    ++tier->blocks_count_;
    tier->raw_bytes_ += m.payload_bytes;
    tier->stored_bytes_ += m.stored_bytes;
  }
  return tier;
}

absl::Status RocksDbColdTier::Write(const ColdBlockInfo& info, absl::Span<const uint8_t> payload) {
  std::string blob;
  if (absl::Status s = Compress(options_.codec, options_.zstd_level, payload, &blob); !s.ok()) return s;
  MetaWire m{};
  m.version = 1;
  m.block_tokens = info.meta.layout.block_tokens;
  m.layers = info.meta.layout.layers;
  m.kv_heads = info.meta.layout.kv_heads;
  m.head_dim = info.meta.layout.head_dim;
  m.dtype = static_cast<uint8_t>(info.meta.layout.dtype);
  m.encoding = info.meta.encoding.Pack();
  m.payload_bytes = info.meta.payload_bytes;
  m.checksum = info.meta.checksum;
  m.owner = info.meta.owner;
  m.parent_lo = info.parent.lo;
  m.parent_hi = info.parent.hi;
  m.stored_bytes = blob.size();
  const std::string key = DbKey(info.key);
  std::string old_meta;
  const bool existed = db_->Get(rocksdb::ReadOptions(), meta_, key, &old_meta).ok();
  rocksdb::WriteBatch batch;
  batch.Put(blocks_, key, blob);
  batch.Put(meta_, key, rocksdb::Slice(reinterpret_cast<const char*>(&m), sizeof(m)));
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  if (write_failed_.load(std::memory_order_relaxed)) {
    if (absl::Status r = ResumeAfterFailure(); !r.ok()) {
      ++write_errors_;
      return r;
    }
  }
  rocksdb::Status s = db_->Write(wo, &batch);
  if (!s.ok()) {
    ++write_errors_;
    write_failed_.store(true, std::memory_order_relaxed);
    return FromRocks(s, "cold tier write");
  }
  write_failed_.store(false, std::memory_order_relaxed);
  ++writes_;
  if (!existed) {
    ++blocks_count_;
    raw_bytes_ += payload.size();
    stored_bytes_ += blob.size();
  }
  return absl::OkStatus();
}

absl::Status RocksDbColdTier::ResumeAfterFailure() {
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t last = last_resume_ns_.load(std::memory_order_relaxed);
  if (now - last < absl::ToInt64Nanoseconds(options_.resume_interval) ||
      !last_resume_ns_.compare_exchange_strong(last, now)) {
    return absl::UnavailableError(
        "the cold tier refuses writes since one failed (disk full or I/O error); "
        "it retries by itself");
  }
  // RocksDB must not be written again until resumed (its WAL writer aborts
  // on a write after a failed one): Resume() switches to a fresh WAL and
  // clears the background error once the cause is gone.
  rocksdb::Status s = db_->Resume();
  if (s.IsBusy()) {
    // RocksDB is recovering by itself (it watches the disk's free space):
    // asked again at the next attempt.
    return absl::UnavailableError("the cold tier is recovering from a failed write (disk full?); it retries by itself");
  }
  if (!s.ok()) return FromRocks(s, "the cold tier is still failing writes (resume)");
  write_failed_.store(false, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status RocksDbColdTier::Read(const ScopedKey& key, ColdBlockInfo* info, std::vector<uint8_t>* payload) {
  const std::string k = DbKey(key);
  std::string meta, blob;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta_, k, &meta);
  if (!s.ok()) {
    if (!s.IsNotFound()) ++read_errors_;
    return FromRocks(s, absl::StrCat("cold block ", key.key.ToHex()));
  }
  s = db_->Get(rocksdb::ReadOptions(), blocks_, k, &blob);
  if (!s.ok()) {
    ++read_errors_;
    return s.IsNotFound() ? absl::DataLossError("cold block has metadata but no payload") : FromRocks(s, "cold read");
  }
  if (meta.size() != sizeof(MetaWire)) return absl::DataLossError("cold block metadata has the wrong size");
  MetaWire m;
  std::memcpy(&m, meta.data(), sizeof(m));
  info->key = key;
  info->parent = BlockKey{m.parent_lo, m.parent_hi};
  info->meta.layout = BlockLayout{m.block_tokens, m.layers, m.kv_heads, m.head_dim, static_cast<DType>(m.dtype)};
  if (!KvEncoding::Unpack(m.encoding, &info->meta.encoding))
    return absl::DataLossError("cold block has a bad encoding");
  info->meta.payload_bytes = m.payload_bytes;
  info->meta.checksum = m.checksum;
  info->meta.owner = m.owner;
  if (absl::Status d = Decompress(absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(blob.data()), blob.size()),
                                  payload, m.payload_bytes);
      !d.ok()) {
    ++read_errors_;
    return d;
  }
  if (payload->size() != m.payload_bytes || PayloadChecksum(payload->data(), payload->size()) != m.checksum) {
    ++read_errors_;
    return absl::DataLossError(absl::StrCat("cold block ", key.key.ToHex(), " fails its checksum"));
  }
  ++reads_;
  return absl::OkStatus();
}

absl::Status RocksDbColdTier::Erase(const ScopedKey& key) {
  const std::string k = DbKey(key);
  std::string meta;
  const bool existed = db_->Get(rocksdb::ReadOptions(), meta_, k, &meta).ok() && meta.size() == sizeof(MetaWire);
  rocksdb::WriteBatch batch;
  batch.Delete(meta_, k);
  batch.Delete(blocks_, k);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  if (write_failed_.load(std::memory_order_relaxed)) KVRING_RETURN_IF_ERROR(ResumeAfterFailure());
  rocksdb::Status s = db_->Write(wo, &batch);
  if (!s.ok()) {
    write_failed_.store(true, std::memory_order_relaxed);
    return FromRocks(s, "cold tier erase");
  }
  if (existed) {
    MetaWire m;
    std::memcpy(&m, meta.data(), sizeof(m));
    --blocks_count_;
    raw_bytes_ -= m.payload_bytes;
    stored_bytes_ -= m.stored_bytes;
  }
  return absl::OkStatus();
}

absl::Status RocksDbColdTier::Scan(const std::function<void(const ColdBlockInfo&)>& visit) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->key().size() != 24 || it->value().size() != sizeof(MetaWire)) {
      return absl::DataLossError("cold tier metadata entry has the wrong size");
    }
    MetaWire m;
    std::memcpy(&m, it->value().data(), sizeof(m));
    ColdBlockInfo info;
    std::memcpy(&info.key.ns, it->key().data(), 8);
    std::memcpy(&info.key.key.lo, it->key().data() + 8, 8);
    std::memcpy(&info.key.key.hi, it->key().data() + 16, 8);
    info.parent = BlockKey{m.parent_lo, m.parent_hi};
    info.meta.layout = BlockLayout{m.block_tokens, m.layers, m.kv_heads, m.head_dim, static_cast<DType>(m.dtype)};
    KvEncoding::Unpack(m.encoding, &info.meta.encoding);
    info.meta.payload_bytes = m.payload_bytes;
    info.meta.checksum = m.checksum;
    info.meta.owner = m.owner;
    visit(info);
  }
  return FromRocks(it->status(), "scanning the cold tier");
}

ColdTierStats RocksDbColdTier::stats() const {
  ColdTierStats s;
  s.blocks = blocks_count_.load();
  s.raw_bytes = raw_bytes_.load();
  s.stored_bytes = stored_bytes_.load();
  s.writes = writes_.load();
  s.reads = reads_.load();
  s.write_errors = write_errors_.load();
  s.read_errors = read_errors_.load();
  return s;
}

}  // namespace kvring

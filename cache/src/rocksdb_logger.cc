#include "kvring/cache/rocksdb_logger.h"

#include <cstdarg>
#include <cstdio>

#include "kvring/common/logging.h"
#include "rocksdb/env.h"

namespace kvring {
namespace {

class RocksDbLogger final : public rocksdb::Logger {
 public:
  explicit RocksDbLogger(std::string name)
      : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL), name_(std::move(name)) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override { Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap); }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < GetInfoLogLevel()) return;
    char buf[1024];
    std::vsnprintf(buf, sizeof(buf), format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      KVRING_LOG(ERROR) << name_ << " (RocksDB): " << buf;
    } else {
      KVRING_LOG(WARNING) << name_ << " (RocksDB): " << buf;
    }
  }

 private:
  const std::string name_;
};

}  // namespace

std::shared_ptr<rocksdb::Logger> MakeRocksDbLogger(const std::string& name) {
  return std::make_shared<RocksDbLogger>(name);
}

}  // namespace kvring

// RocksDB's informational log, routed into kvring's log (stderr) instead of
// a LOG file in the database's directory.
//
// Why: on a full disk RocksDB's own file logger fails a write, and its next
// line aborts the process (Debian's librocksdb 7.8 is built with assertions:
// WritableFileWriter asserts on a write after a failed one). A daemon must
// survive a full disk, so no RocksDB instance of kvring writes a LOG file.
// Only warnings and errors are kept (RocksDB's INFO level is its periodic
// statistics dumps). Thread-safe.
#pragma once

#include <memory>
#include <string>

namespace rocksdb {
class Logger;
}  // namespace rocksdb

namespace kvring {

// A logger for DBOptions::info_log; each line is prefixed with `name`.
std::shared_ptr<rocksdb::Logger> MakeRocksDbLogger(const std::string& name);

}  // namespace kvring

// Command-line flags and config files for kvring's binaries.
//
// A FlagSet is owned by main(); it binds flag names to variables that the
// binary owns (no global flag registry). Parse() reads, in order:
//   1. the file named by --config=PATH (if given): lines "name = value",
//      '#' starts a comment, blank lines ignored;
//   2. the command line: --name=value, --name value, --flag / --noflag for
//      booleans; "--" ends flags.
// so the command line overrides the file. --help prints Usage() and makes
// help_requested() true. Unknown flags and bad values are errors
// (INVALID_ARGUMENT naming the flag). Not thread-safe; use from main().
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvring {

class FlagSet {
 public:
  FlagSet(std::string program, std::string summary);
  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Each Add* registers --name; the variable's current value is the default
  // shown in --help. `target` must outlive Parse().
  void AddString(std::string name, std::string* target, std::string help);
  void AddInt(std::string name, int64_t* target, std::string help);
  void AddUint(std::string name, uint64_t* target, std::string help);
  void AddDouble(std::string name, double* target, std::string help);
  void AddBool(std::string name, bool* target, std::string help);
  // Durations are written as 1.5s, 200ms, 3m (absl::ParseDuration).
  void AddDuration(std::string name, absl::Duration* target, std::string help);
  // Sizes accept suffixes K, M, G, T (powers of 1024): 64M, 2G.
  void AddBytes(std::string name, uint64_t* target, std::string help);

  // Parses argv (argv[0] skipped). Positional arguments go to `positional`
  // when it is non-null; otherwise they are an error.
  absl::Status Parse(int argc, char** argv, std::vector<std::string>* positional = nullptr);
  // Parses `name = value` lines (the --config file format).
  absl::Status ParseConfigText(const std::string& text, const std::string& source);

  bool help_requested() const { return help_requested_; }
  std::string Usage() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool is_bool = false;
    std::function<absl::Status(const std::string&)> set;
  };
  void Add(std::string name, std::string help, std::string default_text, bool is_bool,
           std::function<absl::Status(const std::string&)> set);
  const Flag* Find(const std::string& name) const;
  absl::Status Set(const std::string& name, const std::string& value, const std::string& where);

  std::string program_;
  std::string summary_;
  std::vector<Flag> flags_;
  std::string config_path_;
  bool help_requested_ = false;
};

// Parses "64M", "2G", "4096" into bytes.
absl::Status ParseByteSize(const std::string& text, uint64_t* out);

}  // namespace kvring

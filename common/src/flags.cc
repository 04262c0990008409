#include "kvring/common/flags.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvring/common/quote.h"
#include "kvring/common/status_macros.h"

namespace kvring {

absl::Status ParseByteSize(const std::string& text, uint64_t* out) {
  std::string body = text;
  uint64_t mult = 1;
  if (!body.empty()) {
    switch (body.back()) {
      case 'K':
      case 'k':
        mult = 1ull << 10;
        break;
      case 'M':
      case 'm':
        mult = 1ull << 20;
        break;
      case 'G':
      case 'g':
        mult = 1ull << 30;
        break;
      case 'T':
      case 't':
        mult = 1ull << 40;
        break;
      default:
        break;
    }
    if (mult != 1) body.pop_back();
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(body, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("not a byte size: ", Quote(text), " (e.g. 4096, 64M, 2G)"));
  }
  if (v > UINT64_MAX / mult) return absl::InvalidArgumentError(absl::StrCat("byte size overflows: ", text));
  *out = v * mult;
  return absl::OkStatus();
}

FlagSet::FlagSet(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void FlagSet::Add(std::string name, std::string help, std::string default_text, bool is_bool,
                  std::function<absl::Status(const std::string&)> set) {
  flags_.push_back(Flag{std::move(name), std::move(help), std::move(default_text), is_bool, std::move(set)});
}

void FlagSet::AddString(std::string name, std::string* target, std::string help) {
  Add(std::move(name), std::move(help), "\"" + *target + "\"", false, [target](const std::string& v) {
    *target = v;
    return absl::OkStatus();
  });
}

void FlagSet::AddInt(std::string name, int64_t* target, std::string help) {
  Add(name, std::move(help), absl::StrCat(*target), false, [target, name](const std::string& v) {
    if (!absl::SimpleAtoi(v, target))
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": not an integer: '", v, "'"));
    return absl::OkStatus();
  });
}

void FlagSet::AddUint(std::string name, uint64_t* target, std::string help) {
  Add(name, std::move(help), absl::StrCat(*target), false, [target, name](const std::string& v) {
    if (!absl::SimpleAtoi(v, target))
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": not an unsigned integer: '", v, "'"));
    return absl::OkStatus();
  });
}

void FlagSet::AddDouble(std::string name, double* target, std::string help) {
  Add(name, std::move(help), absl::StrCat(*target), false, [target, name](const std::string& v) {
    if (!absl::SimpleAtod(v, target))
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": not a number: '", v, "'"));
    return absl::OkStatus();
  });
}

void FlagSet::AddBool(std::string name, bool* target, std::string help) {
  Add(name, std::move(help), *target ? "true" : "false", true, [target, name](const std::string& v) {
    if (!absl::SimpleAtob(v, target))
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": not a boolean: '", v, "'"));
    return absl::OkStatus();
  });
}

void FlagSet::AddDuration(std::string name, absl::Duration* target, std::string help) {
  Add(name, std::move(help), absl::FormatDuration(*target), false, [target, name](const std::string& v) {
    if (!absl::ParseDuration(v, target))
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": not a duration: '", v, "' (e.g. 500ms, 2s)"));
    return absl::OkStatus();
  });
}

void FlagSet::AddBytes(std::string name, uint64_t* target, std::string help) {
  Add(name, std::move(help), absl::StrCat(*target), false, [target, name](const std::string& v) {
    absl::Status s = ParseByteSize(v, target);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", s.message()));
    return absl::OkStatus();
  });
}

const FlagSet::Flag* FlagSet::Find(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

absl::Status FlagSet::Set(const std::string& name, const std::string& value, const std::string& where) {
  const Flag* f = Find(name);
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": unknown flag --", name, " (see --help)"));
  }
  absl::Status s = f->set(value);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", s.message()));
  return absl::OkStatus();
}

absl::Status FlagSet::ParseConfigText(const std::string& text, const std::string& source) {
  int lineno = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++lineno;
    absl::string_view line = raw;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", lineno, ": expected 'name = value'"));
    }
    std::string name(absl::StripAsciiWhitespace(line.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (value.size() >= 2 && value.front() == '"' && value.back() == '"') value = value.substr(1, value.size() - 2);
    KVRING_RETURN_IF_ERROR(Set(name, value, absl::StrCat(source, ":", lineno)));
  }
  return absl::OkStatus();
}

absl::Status FlagSet::Parse(int argc, char** argv, std::vector<std::string>* positional) {
  // Pass 1: --config and --help, so the file is applied before the command line.
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a == "--help" || a == "-h" || a == "--helpfull") help_requested_ = true;
    if (absl::StartsWith(a, "--config=")) config_path_ = a.substr(9);
    if (a == "--config" && i + 1 < argc) config_path_ = argv[i + 1];
  }
  if (help_requested_) return absl::OkStatus();
  if (!config_path_.empty()) {
    std::ifstream in(config_path_);
    if (!in) return absl::NotFoundError(absl::StrCat("--config: cannot read '", config_path_, "'"));
    std::stringstream ss;
    ss << in.rdbuf();
    KVRING_RETURN_IF_ERROR(ParseConfigText(ss.str(), config_path_));
  }
  bool flags_done = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (flags_done || a.size() < 2 || a[0] != '-' || a[1] != '-') {
      if (positional == nullptr)
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "' (see --help)"));
      positional->push_back(a);
      continue;
    }
    if (a == "--") {
      flags_done = true;
      continue;
    }
    std::string body = a.substr(2);
    if (body == "config") {
      ++i;
      continue;
    }
    if (absl::StartsWith(body, "config=")) continue;
    size_t eq = body.find('=');
    if (eq != std::string::npos) {
      KVRING_RETURN_IF_ERROR(Set(body.substr(0, eq), body.substr(eq + 1), "command line"));
      continue;
    }
    const Flag* f = Find(body);
    if (f == nullptr && absl::StartsWith(body, "no")) {
      const Flag* neg = Find(body.substr(2));
      if (neg != nullptr && neg->is_bool) {
        KVRING_RETURN_IF_ERROR(neg->set("false"));
        continue;
      }
    }
    if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", body, " (see --help)"));
    if (f->is_bool) {
      KVRING_RETURN_IF_ERROR(f->set("true"));
      continue;
    }
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", body, " needs a value"));
    KVRING_RETURN_IF_ERROR(Set(body, argv[++i], "command line"));
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat(program_, ": ", summary_, "\n\nFlags:\n");
  absl::StrAppend(&out, "  --config=PATH\n      read 'name = value' lines from PATH before the command line\n");
  absl::StrAppend(&out, "  --help\n      print this text\n");
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, f.is_bool ? "" : "=VALUE", "  (default: ", f.default_text, ")\n      ",
                    f.help, "\n");
  }
  return out;
}

}  // namespace kvring

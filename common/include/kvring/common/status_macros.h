// Status propagation macros. Debian's Abseil 20220623 has none of its own.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVRING_CONCAT_INNER_(a, b) a##b
#define KVRING_CONCAT_(a, b) KVRING_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define KVRING_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status kvring_status_ = (expr);          \
    if (!kvring_status_.ok()) return kvring_status_; \
  } while (0)

// `lhs = *expr` where expr is an absl::StatusOr; returns its status on error.
#define KVRING_ASSIGN_OR_RETURN(lhs, expr) \
  KVRING_ASSIGN_OR_RETURN_IMPL_(KVRING_CONCAT_(kvring_statusor_, __LINE__), lhs, expr)
#define KVRING_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

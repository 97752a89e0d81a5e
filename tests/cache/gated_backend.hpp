#pragma once
// An L2 backend for tests whose loads land only when the test says so, one key at a time
// (land / fail / complete), so a test can check what the cache does between two landings
// without any timing: the test stub (tests/support/stub_backend.hpp) holding its loads.

#include "support/stub_backend.hpp"

#include <utility>

namespace kvtier::test {

class gated_backend : public stub_backend {
 public:
  explicit gated_backend(executor_type ex) : stub_backend(std::move(ex), {.name = "gated", .hold_loads = true}) {}
};

}  // namespace kvtier::test

#pragma once
// null_bus: the default bus policy of every component. Publishing compiles to nothing.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/config.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace bus {

struct null_bus {
  template <event E>
  static constexpr bool handles_event = false;

  template <event E>
  constexpr void publish(const E&) const noexcept {}
};

static_assert(event_bus<null_bus>);

}  // namespace bus
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#pragma once
// The policies of a tiered_cache, bundled: an engine (or the server) names its own traits to
// swap any of them without touching the library.
//
//   struct my_traits : kvtier::cache::default_traits {
//     using admission_policy = my_long_prompts_only;   // any pipeline::admission_policy
//     using bus_type = kvtier::default_event_bus;      // export metrics and logs
//   };
//   kvtier::cache::tiered_cache<my_traits> cache(...);

#include <kvtier/bus/null_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/pipeline/policies.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

struct default_traits {
  using eviction_policy = l1::lru;                      ///< l1::eviction_policy
  using bus_type = bus::null_bus;                       ///< bus::event_bus
  using store_policy = pipeline::write_through;         ///< pipeline::store_policy
  using plan_policy = pipeline::first_backend_plan;     ///< pipeline::prefetch_plan_policy
  using admission_policy = pipeline::admit_all;         ///< pipeline::admission_policy
  using wait_policy = pipeline::timeout_wait;           ///< pipeline::prefetch_wait_policy
};

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#pragma once
// kvtier's version: the single source of truth (CMakeLists.txt reads it from here).

#include <kvtier/config.hpp>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {

inline constexpr int version_major = 0;
inline constexpr int version_minor = 1;
inline constexpr int version_patch = 0;

/// "major.minor.patch", for logs, the status request and /healthz.
inline constexpr const char* version_string = "0.1.0";

}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

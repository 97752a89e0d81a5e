#pragma once
// xxHash, used header-only (XXH_INLINE_ALL: every function static inline in the including
// translation unit, so kvtier links no libxxhash). The one place that defines the switch;
// token_hasher.hpp, l2/object_format.hpp and engine/finished_tracker.hpp include this.

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

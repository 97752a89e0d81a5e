#pragma once
// xxHash, used header-only (XXH_INLINE_ALL: every function static inline in the including
// translation unit, so kvtier links no libxxhash). The one place that defines the switch;
// token_hasher.hpp, l2/object_format.hpp and engine/finished_tracker.hpp include this.
//
// g++ 12 at -Og with Debian's xxHash 0.8.1: "inlining failed in call to 'always_inline'
// XXH3_accumulate_512_sse2" (its accumulators are reached through a function pointer that
// -Og does not fold). A translation unit built with -Og defines XXH_NO_INLINE_HINTS=1 before
// this (or on the command line). It is not defined here: without the hints the checksums of
// large objects run at half the speed at -O3 (17-18 against 34 GB/s for 16 KiB-1 MiB here).

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

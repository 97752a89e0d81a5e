#pragma once
// server (server/server.hpp): L1 faulted in and registered behind the first requests
// (l1_residency.hpp has the why and the numbers):
//   prepare_l1_residency()  constructor, after the checks: "faulting" when l1_prefault is on;
//                           on a kernel without MADV_POPULATE_WRITE, the write loop now,
//                           before anything is accepted, and the registration;
//   start_l1_prefault()     start(): the prefault on its own thread (nice 10);
//   l1_prefault_ended(o)    on the I/O thread (the io_uring rings' thread) when it ends;
//   register_l1_step()      the registration with the L2 backends, a piece per turn of the
//                           I/O thread (tiered_cache::register_l1_in_pieces); then the state
//                           and the log lines;
//   stop_l1_prefault()      the shutdown and the destructor: it stops before its next slice
//                           (the destructor joins the thread).

#include <kvtier/server/server.hpp>

#include <boost/asio/post.hpp>

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace server {

inline void server::prepare_l1_residency() {
  const auto arena = cache_->l1_arena();
  if (config_.l1_huge_pages && !arena.empty()) l1_report_.huge_pages = advise_l1_huge_pages(arena);
  if (!config_.l1_prefault || arena.empty()) {  // off: no prefault, so no line saying what the kernel gave
    if (l1_report_.huge_pages != "off")
      log_.info("L1 huge pages: {}; L1 is not prefaulted (l1_prefault off): each 2 MiB page comes on first use",
                l1_report_.huge_pages);
    return;
  }
  if (kv_region::populate_supported()) {
    l1_residency_.store(l1_residency_state::faulting, std::memory_order_release);
    return;
  }
  // Before Linux 5.14: a write per page, which would overwrite a slot in use, so now, while
  // nothing is in L1 (start-up waits for it, as it used to); io_ runs nothing yet, so the
  // registration may happen here too.
  l1_residency_report r = prefault_l1_by_writing(arena);
  r.huge_pages = l1_report_.huge_pages;
  for (cache::l1_registration reg = cache_->register_l1_in_pieces(); reg.step(r.registration);) {
  }
  l1_prefaulted_bytes_.store(arena.size(), std::memory_order_relaxed);
  l1_residency_.store(l1_residency_state::resident, std::memory_order_release);
  log_l1_residency(r);
}

inline void server::start_l1_prefault() {
  if (l1_residency() != l1_residency_state::faulting || l1_prefault_thread_.joinable()) return;
  l1_prefault_thread_ = std::thread([this] {
    ::pthread_setname_np(::pthread_self(), "kvtier-l1-fault");
    // Per-thread on Linux: the I/O thread and the worker pool keep nice 0.
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), l1_prefault_nice);
    if (options_.hooks.during_l1_prefault) options_.hooks.during_l1_prefault();
    const l1_prefault_outcome o = populate_l1(cache_->l1_arena(), l1_prefault_stop_, l1_prefaulted_bytes_);
    // After a shutdown the handler never runs (io_ has stopped) or sees stopping_.
    boost::asio::post(io_, [this, o] { l1_prefault_ended(o); });
  });
}

inline void server::stop_l1_prefault() noexcept { l1_prefault_stop_.store(true, std::memory_order_release); }

inline void server::l1_prefault_ended(l1_prefault_outcome o) {
  const auto arena = cache_->l1_arena();
  l1_residency_report& r = l1_report_;
  r.bytes = arena.size();
  r.prefaulted_bytes = o.bytes;
  r.prefault_ms = std::chrono::duration<double, std::milli>(o.elapsed).count();
  r.populated = o.complete;
  r.behind_requests = true;
  if (stopping_) {  // stopped by the shutdown: nothing to register for a server going away
    l1_residency_.store(l1_residency_state::first_use, std::memory_order_release);
    return;
  }
  if (!o.complete) {
    // The kernel has MADV_POPULATE_WRITE and could not (out of memory under a cgroup limit,
    // say): writing every page would only call the OOM killer. The pages come on first use,
    // and registering would pin (and so allocate) them all: not done either.
    r.error = o.error != 0 ? std::strerror(o.error) : "stopped";
    l1_residency_.store(l1_residency_state::first_use, std::memory_order_release);
    log_l1_residency(r);
    return;
  }
  l1_residency_.store(l1_residency_state::registering, std::memory_order_release);
  l1_registration_.emplace(cache_->register_l1_in_pieces());
  register_l1_step();
}

inline void server::register_l1_step() {
  if (stopping_) {  // the shutdown came first: the rest is not registered
    l1_residency_.store(l1_residency_state::first_use, std::memory_order_release);
    return;
  }
  // Here: the thread of the backends' rings.
  if (l1_registration_->step(l1_report_.registration)) {
    boost::asio::post(io_, [this] { register_l1_step(); });  // the next piece on the next turn
    return;
  }
  l1_registration_.reset();
  l1_residency_.store(l1_residency_state::resident, std::memory_order_release);
  log_l1_residency(l1_report_);
}

}  // namespace server
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#pragma once
// zmq_transport: the tier_announcer's events through a kv_event_publisher (ZMQ PUB, and the
// replay ROUTER when configured). Target kvtier::kv_events (libzmq, cppzmq). The kvtier-server
// program builds one for the server's "kv_events" configuration (server_options::
// kv_event_transport); without libzmq the program refuses that configuration.

#include <kvtier/config.hpp>
#include <kvtier/kv_events/publisher.hpp>
#include <kvtier/kv_events/tier_announcer.hpp>

#include <string>
#include <utility>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace kv_events {

class zmq_transport final : public kv_event_transport {
 public:
  explicit zmq_transport(kv_event_publisher_options options) : publisher_(std::move(options)) {}

  bool offer(kv_event ev) noexcept override { return publisher_.offer(std::move(ev)); }

  [[nodiscard]] kv_event_transport_stats stats() const override {
    const kv_event_publisher_stats s = publisher_.stats();
    return {s.events_published, s.events_dropped,        s.batches_published,  s.replay_requests,
            s.replay_gaps,      s.replay_buffer_batches, s.replay_buffer_bytes};
  }

  [[nodiscard]] std::string describe() const override {
    std::string d = "PUB " + publisher_.endpoint();
    if (!publisher_.replay_endpoint().empty()) d += ", replay " + publisher_.replay_endpoint();
    return d;
  }

  [[nodiscard]] kv_event_publisher& publisher() noexcept { return publisher_; }

 private:
  kv_event_publisher publisher_;
};

}  // namespace kv_events
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

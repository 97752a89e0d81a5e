// kvtier_kv_events_serve: a kv_event_publisher driven from stdin, for the Python tests
// (tests/python/test_kv_events_format.py: kvtier.kv_events.Subscriber against our
// publisher). Binds tcp://127.0.0.1:* for PUB and replay and prints
//   endpoint <pub endpoint> replay <replay endpoint>
// then reads commands, one a line, answering each with one line:
//   publish <n>   n BlockRemoved events (hashes 0, 1, 2... counted across commands, medium
//                 CPU), one batch each          -> published <batches published so far>
//   stored        one BlockStored with every field set (as in kv_events_dump.cpp's
//                 full_stored)                   -> published <batches published so far>
//   stats         -> stats offered=<n> published=<n> dropped=<n> batches=<n> replays=<n> gaps=<n>
//   quit (or end of input): stops the publisher and exits 0.
// Options: --buffer-steps <n>, --form map|array, --topic <text>.
#include <kvtier/kv_events/publisher.hpp>

#include "kv_events/sample_events.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace kvtier::kv_events;
using kvtier::test::kv_event_samples::full_stored;

// Offers one event and waits (30 s at most) until its batch went out.
bool publish_one(kv_event_publisher& pub, kv_event ev) {
  const auto before = pub.stats().batches_published;
  if (!pub.offer(std::move(ev))) return false;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (pub.stats().batches_published == before) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

kv_event_publisher_options parse_options(int argc, char** argv) {
  kv_event_publisher_options o;
  o.endpoint = "tcp://127.0.0.1:*";
  o.replay_endpoint = "tcp://127.0.0.1:*";
  o.flush_interval = std::chrono::milliseconds(0);
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view name = argv[i];
    if (name == "--buffer-steps")
      o.buffer_steps = std::stoul(argv[i + 1]);
    else if (name == "--topic")
      o.topic = argv[i + 1];
    else if (name == "--form" && parse_event_form(argv[i + 1]))
      o.form = *parse_event_form(argv[i + 1]);
    else
      throw std::invalid_argument("unknown option " + std::string(name));
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  kv_event_publisher pub(parse_options(argc, argv));
  std::cout << "endpoint " << pub.endpoint() << " replay " << pub.replay_endpoint() << std::endl;
  std::uint64_t next_hash = 0;
  std::string command;
  while (std::cin >> command && command != "quit") {
    bool ok = true;
    if (command == "publish") {
      int n = 0;
      std::cin >> n;
      for (int i = 0; i < n && ok; ++i) {
        ok = publish_one(pub, block_removed{{next_hash++}, std::string(medium_cpu), std::nullopt});
      }
    } else if (command == "stored") {
      ok = publish_one(pub, full_stored());
    } else if (command != "stats") {
      std::cout << "error unknown command " << command << std::endl;
      continue;
    }
    const auto s = pub.stats();
    if (!ok) {
      std::cout << "error the publisher did not publish in 30 s" << std::endl;
    } else if (command == "stats") {
      std::cout << "stats offered=" << s.events_offered << " published=" << s.events_published
                << " dropped=" << s.events_dropped << " batches=" << s.batches_published
                << " replays=" << s.replay_requests << " gaps=" << s.replay_gaps << std::endl;
    } else {
      std::cout << "published " << s.batches_published << std::endl;
    }
  }
  pub.stop();
  return 0;
}

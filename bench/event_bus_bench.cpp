// kvtier_bench_event_bus: the cost of publishing one event, next to its limit.
//
//   atomic_fetch_add   one relaxed std::atomic fetch_add: the floor for counting anything
//   bus_l2_event       basic_event_bus<metrics_subscriber>::publish(l2_store_submitted):
//                      two exact counter updates plus the backend series lookup
//   bus_unhandled      publish of an event no subscriber handles
//   empty_loop         the loop alone (what "costs nothing" is compared with)
//   type_erased_bus    map from event type to std::function lists, called synchronously,
//                      updating the same metrics
//   runtime_bus        LMCache's design: events with a string-keyed metadata map, pushed
//                      into a mutex-guarded queue, dispatched by a drain thread to
//                      std::function subscribers looked up by type; cost = publish + dispatch
//
// Each benchmark iteration handles `batch` events; figures are ns per event, medians over
// interleaved repeats. Ends with RESULT lines.
#include <kvtier/bus/event_bus.hpp>
#include <kvtier/telemetry/metrics_subscriber.hpp>

#include <common/gbench.hpp>
#include <common/results.hpp>

#include <any>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using namespace kvtier;
constexpr int batch = 1000;

std::atomic<std::uint64_t> g_atomic{0};

void atomic_fetch_add(benchmark::State& state) {
  for (auto _ : state)
    for (int i = 0; i < batch; ++i) g_atomic.fetch_add(1, std::memory_order_relaxed);
  benchmark::DoNotOptimize(g_atomic.load());
}

telemetry::registry& bench_registry() {
  static telemetry::registry r;
  return r;
}

void bus_l2_event(benchmark::State& state) {
  static bus::basic_event_bus<telemetry::metrics_subscriber> b{telemetry::metrics_subscriber{bench_registry()}};
  bus::l2_store_submitted e{0, "disk", 4, 4 * 4096};
  for (auto _ : state)
    for (int i = 0; i < batch; ++i) {
      benchmark::DoNotOptimize(e);
      b.publish(e);
    }
}

// Handles only the store event, so an L1 event reaches nobody.
struct store_counter {
  telemetry::counter* c;
  void on(const bus::l2_store_submitted& e) noexcept { c->inc(e.key_count); }
};

void bus_unhandled(benchmark::State& state) {
  static telemetry::counter c;
  static bus::basic_event_bus<store_counter> b{store_counter{&c}};
  static_assert(!decltype(b)::handles_event<bus::l1_read_finished>);
  bus::l1_read_finished e{1};
  for (auto _ : state)
    for (int i = 0; i < batch; ++i) {
      benchmark::DoNotOptimize(e);
      b.publish(e);
    }
}

void empty_loop(benchmark::State& state) {
  bus::l1_read_finished e{1};
  for (auto _ : state)
    for (int i = 0; i < batch; ++i) benchmark::DoNotOptimize(e);
}

// --- a synchronous type-erased bus ---------------------------------------------------------
class type_erased_bus {
 public:
  template <class E>
  void subscribe(std::function<void(const E&)> fn) {
    subs_[E::type].push_back([fn = std::move(fn)](const void* e) { fn(*static_cast<const E*>(e)); });
  }
  template <class E>
  void publish(const E& e) {
    auto it = subs_.find(E::type);
    if (it == subs_.end()) return;
    for (auto& f : it->second) f(&e);
  }

 private:
  std::unordered_map<bus::event_type, std::vector<std::function<void(const void*)>>> subs_;
};

void type_erased(benchmark::State& state) {
  static telemetry::metrics_subscriber m(bench_registry());
  static type_erased_bus b = [] {
    type_erased_bus x;
    x.subscribe<bus::l2_store_submitted>([](const bus::l2_store_submitted& e) { m.on(e); });
    return x;
  }();
  bus::l2_store_submitted e{0, "disk", 4, 4 * 4096};
  for (auto _ : state)
    for (int i = 0; i < batch; ++i) {
      benchmark::DoNotOptimize(e);
      b.publish(e);
    }
}

// --- LMCache's runtime bus, in C++ ----------------------------------------------------------
struct runtime_event {
  bus::event_type type;
  double timestamp;
  std::unordered_map<std::string, std::any> metadata;
  std::string session_id;
};

class runtime_bus {
 public:
  using callback = std::function<void(const runtime_event&)>;

  runtime_bus() : thread_([this] { drain_loop(); }) {}
  ~runtime_bus() {
    {
      std::lock_guard g(m_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  void subscribe(bus::event_type t, callback cb) {
    std::lock_guard g(sub_m_);
    subs_[t].push_back(std::move(cb));
  }

  void publish(runtime_event e) {
    e.timestamp = static_cast<double>(std::chrono::system_clock::now().time_since_epoch().count());
    {
      std::lock_guard g(m_);
      if (queue_.size() >= max_queue_) {
        ++dropped_;
        return;
      }
      queue_.push_back(std::move(e));
    }
    cv_.notify_one();
  }

  std::atomic<std::uint64_t> dispatched{0};

 private:
  void drain_loop() {
    std::deque<runtime_event> batch_q;
    for (;;) {
      {
        std::unique_lock l(m_);
        cv_.wait_for(l, std::chrono::milliseconds(100), [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        batch_q.swap(queue_);
      }
      std::unordered_map<bus::event_type, std::vector<callback>> snapshot;
      {
        std::lock_guard g(sub_m_);
        snapshot = subs_;
      }
      for (const auto& e : batch_q) {
        auto it = snapshot.find(e.type);
        if (it != snapshot.end())
          for (auto& cb : it->second) cb(e);
        dispatched.fetch_add(1, std::memory_order_release);
      }
      batch_q.clear();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<runtime_event> queue_;
  std::size_t max_queue_ = 10000;
  std::uint64_t dropped_ = 0;
  bool stop_ = false;
  std::mutex sub_m_;
  std::unordered_map<bus::event_type, std::vector<callback>> subs_;
  std::thread thread_;
};

void runtime(benchmark::State& state) {
  static telemetry::metrics_subscriber m(bench_registry());
  static runtime_bus b;
  static const bool subscribed = [] {
    b.subscribe(bus::event_type::l2_store_submitted, [](const runtime_event& e) {
      bus::l2_store_submitted ev;
      ev.backend_index = std::any_cast<std::uint8_t>(e.metadata.at("adapter_index"));
      ev.key_count = std::any_cast<std::uint32_t>(e.metadata.at("key_count"));
      m.on(ev);
    });
    return true;
  }();
  benchmark::DoNotOptimize(subscribed);
  std::uint64_t published = b.dispatched.load();
  for (auto _ : state) {
    for (int i = 0; i < batch; ++i) {
      runtime_event e{bus::event_type::l2_store_submitted, 0, {}, "req-1"};
      e.metadata.emplace("adapter_index", std::uint8_t{0});
      e.metadata.emplace("key_count", std::uint32_t{4});
      b.publish(std::move(e));
    }
    published += batch;
    // The cost per event includes its dispatch: wait until the drain thread has caught up.
    while (b.dispatched.load(std::memory_order_acquire) < published) std::this_thread::yield();
  }
}

}  // namespace

BENCHMARK(atomic_fetch_add)->Unit(benchmark::kNanosecond);
BENCHMARK(bus_l2_event)->Unit(benchmark::kNanosecond);
BENCHMARK(bus_unhandled)->Unit(benchmark::kNanosecond);
BENCHMARK(empty_loop)->Unit(benchmark::kNanosecond);
BENCHMARK(type_erased)->Unit(benchmark::kNanosecond);
BENCHMARK(runtime)->Unit(benchmark::kNanosecond);

int main(int argc, char** argv) {
  int repeats = 7;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::string_view(argv[i]).starts_with("--repeats=")) repeats = std::stoi(argv[i] + 10);
    else args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  kvtier::bench::repeat_collector collector;
  const auto& t = kvtier::bench::run_interleaved(n, args.data(), repeats, collector);
  auto per_event = [&](const char* name) {
    std::vector<double> v = t.at(name);
    for (auto& x : v) x /= batch;
    return v;
  };
  const auto atomic_ns = per_event("atomic_fetch_add");
  const auto bus_ns = per_event("bus_l2_event");
  const auto unhandled_ns = per_event("bus_unhandled");
  const auto empty_ns = per_event("empty_loop");
  const auto erased_ns = per_event("type_erased");
  const auto runtime_ns = per_event("runtime");
  using kvtier::bench::median;
  using kvtier::bench::median_ratio;
  using kvtier::bench::print_result;
  print_result("atomic_fetch_add_ns", median(atomic_ns));
  print_result("bus_publish_l2_ns", median(bus_ns));
  print_result("bus_publish_unhandled_ns", median(unhandled_ns));
  print_result("empty_loop_ns", median(empty_ns));
  print_result("type_erased_bus_ns", median(erased_ns));
  print_result("runtime_bus_ns", median(runtime_ns));
  print_result("bus_vs_atomic", median_ratio(bus_ns, atomic_ns));
  print_result("runtime_bus_vs_bus", median_ratio(runtime_ns, bus_ns));
  print_result("type_erased_vs_bus", median_ratio(erased_ns, bus_ns));
  print_result("unhandled_vs_empty_loop", median_ratio(unhandled_ns, empty_ns));
  return 0;
}

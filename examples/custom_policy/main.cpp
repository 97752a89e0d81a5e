// A user-written eviction policy plugged into l1::tier without touching the tier.
//
// `fifo` evicts objects in the order they became ready and ignores reads. Like the shipped
// policies it is intrusive: the tier embeds one `fifo::hook` in each of its entries, so the
// policy allocates nothing per key. The contract is kvtier::l1::eviction_policy
// (kvtier/l1/concepts.hpp); the static_assert below checks it at compile time.
//
//   kvtier_example_custom_policy
#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/tier.hpp>

#include <cstdio>
#include <string_view>
#include <vector>

namespace {

class fifo {
 public:
  // Embedded in every tier entry: the links of one doubly linked list, oldest at `head_`.
  struct hook {
    hook* prev = nullptr;
    hook* next = nullptr;
    bool linked = false;
  };

  static constexpr std::string_view name = "fifo";

  void on_insert(hook& h, const kvtier::chunk_key&) noexcept {  // newest at the tail
    h.prev = tail_;
    h.next = nullptr;
    (tail_ != nullptr ? tail_->next : head_) = &h;
    tail_ = &h;
    h.linked = true;
  }
  void on_access(hook&) noexcept {}  // FIFO: reads change nothing
  void on_remove(hook& h) noexcept { unlink(h); }

  // Up to n unlocked objects, oldest first. The tier removes each returned hook (and calls
  // on_remove for it) before calling the policy again.
  template <class Pred>
  void select_victims(std::size_t n, const Pred& evictable, std::vector<hook*>& out) {
    for (hook* h = head_; h != nullptr && n > 0;) {
      hook* next = h->next;
      if (evictable(static_cast<const hook&>(*h))) {
        unlink(*h);
        out.push_back(h);
        --n;
      }
      h = next;
    }
  }

 private:
  void unlink(hook& h) noexcept {
    if (!h.linked) return;
    (h.prev != nullptr ? h.prev->next : head_) = h.next;
    (h.next != nullptr ? h.next->prev : tail_) = h.prev;
    h.prev = h.next = nullptr;
    h.linked = false;
  }

  hook* head_ = nullptr;
  hook* tail_ = nullptr;
};

static_assert(kvtier::l1::eviction_policy<fifo>);

kvtier::chunk_key key(std::uint64_t i) { return kvtier::chunk_key{1, 1, 0, {i, 0}}; }

}  // namespace

int main() {
  using namespace kvtier;
  l1::tier_options options;
  options.slot_bytes = 4096;
  options.slot_count = 10;       // evict above 8 objects, down to 7
  l1::tier<fifo> tier(options);  // the policy is just a template argument

  // Store objects 0..7 one by one, reading object 0 after each store: under LRU, 0 would
  // stay; under FIFO it is still the first to go.
  std::vector<l1::status> one(1);
  for (std::uint64_t i = 0; i < 8; ++i) {
    const std::vector<chunk_key> k{key(i)};
    std::vector<std::span<std::byte>> buffer(1);
    tier.reserve_write(k, 1000, {}, one, buffer);
    buffer[0][0] = std::byte{static_cast<unsigned char>(i)};
    tier.finish_write(k, one);
    tier.touch(std::vector<chunk_key>{key(0)});
  }
  // Object 8 takes the tier above its watermark: 8 + 1 - 7 = 2 objects go, oldest first.
  const std::vector<chunk_key> k8{key(8)};
  tier.reserve_write(k8, 1000, {}, one);
  tier.finish_write(k8, one);

  std::printf("policy %s, %zu objects held:", std::string(l1::tier<fifo>::policy_type::name).c_str(),
              tier.usage().objects);
  for (std::uint64_t i = 0; i <= 8; ++i)
    if (tier.contains(key(i))) std::printf(" %llu", static_cast<unsigned long long>(i));
  std::printf("\n");
  const bool ok =
      !tier.contains(key(0)) && !tier.contains(key(1)) && tier.contains(key(2)) && tier.usage().objects == 7;
  std::printf("%s\n", ok ? "objects 0 and 1 were evicted first, as FIFO says" : "unexpected eviction order");
  return ok ? 0 : 1;
}

#pragma once
// A circular doubly linked list of nodes embedded in the items (no allocation), the building
// block of the shipped eviction policies. front() is the most recently inserted end ("head",
// MRU), back() the oldest ("tail", LRU).

#include <kvtier/config.hpp>

#include <cstddef>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {
namespace detail {

struct list_node {
  list_node* prev = nullptr;
  list_node* next = nullptr;

  [[nodiscard]] bool linked() const noexcept { return next != nullptr; }
};

class intrusive_list {
 public:
  intrusive_list() noexcept { head_.prev = head_.next = &head_; }
  intrusive_list(const intrusive_list&) = delete;
  intrusive_list& operator=(const intrusive_list&) = delete;
  // Moving a non-empty list would leave the items pointing at the old sentinel.
  intrusive_list(intrusive_list&& other) noexcept : intrusive_list() {
    if (!other.empty()) {
      head_.next = other.head_.next;
      head_.prev = other.head_.prev;
      head_.next->prev = &head_;
      head_.prev->next = &head_;
      size_ = other.size_;
      other.head_.prev = other.head_.next = &other.head_;
      other.size_ = 0;
    }
  }
  intrusive_list& operator=(intrusive_list&&) = delete;

  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The newest item, or nullptr.
  [[nodiscard]] list_node* front() const noexcept { return empty() ? nullptr : head_.next; }
  /// The oldest item, or nullptr.
  [[nodiscard]] list_node* back() const noexcept { return empty() ? nullptr : head_.prev; }
  /// The next newer item than n, or nullptr at the front.
  [[nodiscard]] list_node* newer(const list_node* n) const noexcept { return n->prev == &head_ ? nullptr : n->prev; }

  void push_front(list_node& n) noexcept { link_after(head_, n); }
  void push_back(list_node& n) noexcept { link_after(*head_.prev, n); }

  void erase(list_node& n) noexcept {
    n.prev->next = n.next;
    n.next->prev = n.prev;
    n.prev = n.next = nullptr;
    --size_;
  }

  void move_to_front(list_node& n) noexcept {
    if (head_.next == &n) return;
    erase(n);
    push_front(n);
  }

 private:
  void link_after(list_node& at, list_node& n) noexcept {
    n.prev = &at;
    n.next = at.next;
    at.next->prev = &n;
    at.next = &n;
    ++size_;
  }

  list_node head_;
  std::size_t size_ = 0;
};

}  // namespace detail
}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#pragma once
// l1::tier<Policy, Bus>: the L1 tier, chunk objects in CPU memory, one object per fixed-size
// slot of one arena, with LMCache's per-key state machine (absent, write_locked, ready,
// read_locked, removing), expiring or pinned locks, and an eviction policy chosen at compile
// time. Every operation takes a batch of keys and answers per key in a span the caller
// provides. docs/l1.md holds the states, each operation's answers, locks and holds,
// eviction, events and thread safety.

#include <kvtier/bus/concepts.hpp>
#include <kvtier/bus/events.hpp>
#include <kvtier/bus/null_bus.hpp>
#include <kvtier/config.hpp>
#include <kvtier/core/chunk_key.hpp>
#include <kvtier/core/slot_allocator.hpp>
#include <kvtier/fwd.hpp>
#include <kvtier/l1/concepts.hpp>
#include <kvtier/l1/policy/lru.hpp>
#include <kvtier/l1/status.hpp>

#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l1 {

using clock_type = std::chrono::steady_clock;

/// Configuration of a tier. validate() (called by the constructor) throws
/// std::invalid_argument naming the field and what to change.
struct tier_options {
  /// Bytes of one slot: the largest object the tier holds, rounded up to 4 KiB.
  std::size_t slot_bytes = 0;
  /// Slots in the arena; capacity = slot_count * slot_bytes (allocated at construction).
  std::size_t slot_count = 0;
  /// TTL of an expiring write lock (LMCache --l1-write-ttl-seconds).
  clock_type::duration write_lock_ttl = std::chrono::seconds(600);
  /// TTL of expiring read locks, counted from the latest acquire (--l1-read-ttl-seconds).
  clock_type::duration read_lock_ttl = std::chrono::seconds(300);
  /// Eviction starts when an allocation would take the used slots above this share.
  double eviction_watermark = 0.8;
  /// ... and frees unlocked objects until the used slots are down to this share.
  double eviction_target = 0.7;
  /// The time source of the TTLs; tests inject a manual clock so they never sleep.
  std::function<clock_type::time_point()> clock = [] { return clock_type::now(); };

  void validate() const;
};

/// What reserve_write does with the keys of one batch.
struct write_options {
  write_mode mode = write_mode::new_only;
  /// The write lock's lifetime: expiring for remote clients, pinned for the server's own I/O.
  lock_lifetime lock = lock_lifetime::expiring;
  /// A temporary object (prefetched for one reader) is freed when its last read lock goes.
  bool temporary = false;
  /// Reported in l1_write_reserved and l1_allocation_failed.
  bus::allocation_purpose purpose = bus::allocation_purpose::store;
  /// True: the new keys of the batch are allocated together or not at all. False: as many
  /// as fit (after eviction), in batch order; the others answer out_of_memory.
  bool all_or_nothing = true;
};

/// What reserve_prefix does with the keys of its prefix.
struct prefix_options {
  /// The size of every object: new objects get it; a readable object of another size ends
  /// the prefix (wrong_size). 0: any size is read, and no key may be loadable.
  std::size_t object_bytes = 0;
  /// Read holds per read key: 1 + extra_count (at most max_extra_count).
  std::uint32_t extra_count = 0;
  lock_lifetime read_lock = lock_lifetime::pinned;
  lock_lifetime write_lock = lock_lifetime::pinned;
  /// New objects are temporary (freed with their last read hold).
  bool temporary = false;
  /// Reported in l1_write_reserved and l1_allocation_failed.
  bus::allocation_purpose purpose = bus::allocation_purpose::prefetch;
  /// Count the key that ended the prefix (missing, busy, wrong size) as a refused read in
  /// l1_read_reserved (for a caller whose prefix is a read: a lookup, a copy).
  bool count_refused_read = false;
  /// False: readable keys are taken (prefix_take::read) without a hold, unseen by the
  /// policy and uncounted: a caller that only loads what L1 lacks and reads nothing now (a
  /// prefetch nobody waits for). They may then be evicted to make room for the new keys.
  bool hold_reads = true;
};

/// What reserve_prefix took.
struct prefix_result {
  std::size_t length = 0;                 ///< keys [0, length) were taken (read, write or wait)
  std::size_t reads = 0;                  ///< of them, readable (read-locked unless !hold_reads)
  std::size_t writes = 0;                 ///< of them, write-locked new objects
  std::size_t waits = 0;                  ///< of them, left to a writer the caller waits for
  std::size_t short_of_room = 0;          ///< loadable keys of the reachable prefix that got no slot
  prefix_end end = prefix_end::complete;  ///< why keys[length] was not taken
};

/// Memory accounting of a tier: a snapshot (docs/metrics.md lists the gauges read from it).
struct usage_info {
  std::size_t bytes_used = 0;      ///< slots_used * slot_bytes
  std::size_t bytes_capacity = 0;  ///< slot_count * slot_bytes
  std::size_t objects = 0;         ///< keys held (write-locked, ready or read-locked)
  std::size_t slots_used = 0;      ///< objects + removing
  std::size_t removing = 0;        ///< removed while locked, memory freed at the last unlock
  std::size_t object_bytes = 0;    ///< sum of the objects' sizes (<= bytes_used)
  std::size_t evictable = 0;       ///< ready, unlocked objects the policy may take
  std::size_t read_locked = 0;     ///< entries with a read hold (removing ones included)
  std::size_t write_locked = 0;    ///< entries write-locked: being written, not readable yet
};

/// What remove_if removed and what it had to leave.
struct removal_summary {
  std::size_t removed = 0;        ///< objects deleted (forced ones included)
  std::size_t removed_bytes = 0;  ///< their sizes
  std::size_t locked = 0;         ///< objects it matched but left: locked, and not forced
  std::size_t locked_bytes = 0;   ///< their sizes
};

/// The state of one object, for tests and status pages.
struct object_info {
  object_state state = object_state::absent;
  std::size_t bytes = 0;
  bool temporary = false;
  bool write_pinned = false;           ///< write-locked with a pinned lock
  std::uint32_t expiring_readers = 0;  ///< read holds released by the TTL
  std::uint32_t pinned_readers = 0;    ///< read holds that never expire
};

/// The L1 tier. `Policy` models l1::eviction_policy; `Bus` models bus::event_bus and must
/// outlive the tier. Not copyable or movable (the policy links hooks inside the tier).
///
/// Key events (tier bus::l1_tier), published only while bus::wants_kind says the bus wants
/// them (never on bus::null_bus): bus::tier_keys_stored when objects become readable
/// (finish_write, finish_write_and_reserve_read: a store written, a prefetch landed);
/// bus::tier_keys_removed when an announced object leaves: evicted (the policy, above the
/// watermark), deleted (remove, remove_if, clear, and a rewrite in update mode that is
/// abandoned or whose write lock expires: the old object is lost), expired (a temporary
/// object freed with its last read hold, or given none). A write that never became readable
/// is neither; a rewrite keeps its key announced. They are queued while the tier's mutex is
/// held, so the bus's queue has them in the order the index changed: a subscriber applying
/// them in order holds what for_each_object lists, but for the new objects still being
/// written (listed write-locked, announced when they become readable). Subscribers called
/// at once (immediate delivery) run under that mutex and must not call into the tier.
template <class Policy, class Bus>
class tier {
  static_assert(eviction_policy<Policy>, "kvtier::l1::tier: Policy must model kvtier::l1::eviction_policy");
  static_assert(bus::event_bus<Bus>, "kvtier::l1::tier: Bus must model kvtier::bus::event_bus");

 public:
  using policy_type = Policy;
  using bus_type = Bus;
  using time_point = clock_type::time_point;

  /// Largest extra_count of the read operations (1 + extra_count holds are taken per key).
  static constexpr std::uint32_t max_extra_count = 1023;

  /// Allocates the arena (slot_count * slot_bytes). Throws std::invalid_argument for bad
  /// options, std::bad_alloc when the arena cannot be allocated.
  tier(tier_options options, Bus& bus, Policy policy = Policy{});

  /// A tier that publishes nothing (Bus = bus::null_bus).
  // clang-format off
  explicit tier(tier_options options, Policy policy = Policy{})
    requires std::same_as<Bus, bus::null_bus>
      : tier(std::move(options), null_bus_instance(), std::move(policy)) {}
  // clang-format on

  tier(const tier&) = delete;
  tier& operator=(const tier&) = delete;

  // --- writes ------------------------------------------------------------------------
  /// Write-locks the keys of the batch for an object of `object_bytes` (1..slot_bytes).
  /// Per key (o.mode): new_only: an absent key is created, an existing one answers
  /// not_writable; update: an existing writable key (ready, unlocked, not temporary) is
  /// write-locked again, an absent one answers not_found, a busy one not_writable; all: both.
  /// A key repeated in the batch answers not_writable the second time.
  /// The new keys are allocated all or nothing: when they do not all fit, even after
  /// evicting unlocked objects and dropping expired locks, every new key answers
  /// out_of_memory and none is allocated (no object is evicted for a batch that fails).
  /// When the allocation takes the used slots above the eviction watermark, unlocked
  /// objects are evicted first, down to the eviction target.
  /// `buffers`, when not empty (size == keys.size()), receives each success's memory
  /// (object_bytes bytes, 4 KiB-aligned) and an empty span for each failure.
  /// Throws std::invalid_argument when a span's size differs from keys.size() or
  /// object_bytes is 0 or larger than slot_bytes.
  std::size_t reserve_write(std::span<const chunk_key> keys, std::size_t object_bytes, const write_options& o,
                            std::span<status> out, std::span<std::span<std::byte>> buffers = {});

  /// Makes write-locked keys ready (readable, evictable). Answers: not_found (absent, or removed while the
  /// write ran: its memory is freed now), wrong_state (not write-locked).
  std::size_t finish_write(std::span<const chunk_key> keys, std::span<status> out);

  /// Drops write-locked keys without ever making them readable (a failed write or
  /// prefetch): the memory is freed at once, l1_keys_evicted{abandoned} is published and
  /// the store pipeline never hears of them (LMCache issue #5032). An update-mode rewrite
  /// that is abandoned loses the old object too (its memory was being overwritten).
  /// Answers: not_found, wrong_state (not write-locked).
  std::size_t abandon_write(std::span<const chunk_key> keys, std::span<status> out);

  /// Atomically makes write-locked keys ready and takes 1 + extra_count read holds of
  /// `read_lock` lifetime on each, so eviction cannot slip in between (the prefetch
  /// controller's finalize). Publishes l1_write_finished_and_read_reserved, not
  /// l1_write_finished (prefetched objects are already in L2). Answers as finish_write.
  std::size_t finish_write_and_reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count,
                                            lock_lifetime read_lock, std::span<status> out);

  /// The same with holds[i] read holds on keys[i] (0 allowed: the object becomes ready and
  /// unlocked, and a temporary one is freed at once, l1_keys_evicted{temporary}), so one
  /// load can be handed to several readers at once. Throws std::invalid_argument when
  /// holds.size() != keys.size().
  std::size_t finish_write_and_reserve_read(std::span<const chunk_key> keys, std::span<const std::uint32_t> holds,
                                            lock_lifetime read_lock, std::span<status> out);

  // --- reads -------------------------------------------------------------------------
  /// Takes 1 + extra_count read holds of the given lifetime on each readable key (the
  /// policy sees a read). Answers: not_found (absent or removing), not_readable (being
  /// written). An expiring hold lasts read_lock_ttl from the latest expiring acquire on the
  /// key; when it passes, all expiring holds of the key go at once (holds are not owned: see
  /// docs/l1.md, "Locks").
  std::size_t reserve_read(std::span<const chunk_key> keys, std::uint32_t extra_count, lock_lifetime lifetime,
                           std::span<status> out);

  /// Releases 1 + extra_count holds of the given lifetime. A temporary object, or one
  /// removed while locked, is freed with its last hold. Answers: not_found, wrong_state
  /// (fewer holds of that lifetime than asked: nothing is released; also what a holder
  /// whose expiring holds already expired gets).
  std::size_t finish_read(std::span<const chunk_key> keys, std::uint32_t extra_count, lock_lifetime lifetime,
                          std::span<status> out);

  /// Takes the longest prefix of `keys` it can, in one step under the mutex, walking the
  /// keys in order:
  ///   - readable (ready or read-locked, o.object_bytes bytes when given): 1 + extra_count
  ///     read holds of o.read_lock lifetime (the policy sees a read) -> prefix_take::read;
  ///   - being written, and waitable(i) is true (the caller knows the writer and will wait
  ///     for it) -> prefix_take::wait, the key is left as it is;
  ///   - absent, and loadable(i) is true: a new object of o.object_bytes, write-locked
  ///     (o.write_lock), temporary per o -> prefix_take::write, its memory in buffers[i];
  ///   - anything else ends the prefix (prefix_result::end says why).
  /// New objects are allocated for as many of the prefix's loadable keys as fit after
  /// evicting unlocked objects (never a read key of the prefix returned). Short of room, the
  /// prefix is the longest one whose new keys fit once the walk gives back its holds past
  /// it: those read keys are worth less than the prefix's front, and unlocked they may be
  /// evicted for it (a 48-key document whose keys 24..47 fill a 24-slot tier gets keys
  /// 0..23, not nothing). The prefix then ends (end = no_room) at that length or at the
  /// first loadable key that got no slot, and the holds the walk took from there on are
  /// given back (uncounted, unseen by the policy). Keys from `length` on are untouched
  /// (but for those evicted) and answer prefix_take::none.
  /// `loadable(i)` and `waitable(i)` (i: the key's index) run under the tier's mutex and must
  /// not call into the tier. `out` (size keys.size()) gets each key's take; `buffers`, when
  /// not empty (size keys.size()), the memory of each write key (empty spans for the rest).
  /// Events: l1_read_reserved{reads, refused} (refused: 1 when o.count_refused_read and the
  /// prefix ended at a key that was tried), l1_write_reserved{writes, short_of_room,
  /// purpose} and l1_allocation_failed{short_of_room, purpose} when keys lacked a slot.
  /// Throws std::invalid_argument for spans of the wrong size, an extra_count above
  /// max_extra_count, or object_bytes larger than a slot (or 0 with a loadable key).
  template <class Loadable, class Waitable>
  prefix_result reserve_prefix(std::span<const chunk_key> keys, const prefix_options& o, Loadable&& loadable,
                               Waitable&& waitable, std::span<prefix_take> out,
                               std::span<std::span<std::byte>> buffers = {});

  /// reserve_prefix of readable keys only (nothing is loadable or waited for): the leading
  /// run of readable keys is read-locked, the rest untouched (a lookup's L1 prefix).
  prefix_result reserve_read_prefix(std::span<const chunk_key> keys, const prefix_options& o,
                                    std::span<prefix_take> out) {
    return reserve_prefix(
        keys, o, [](std::size_t) { return false; }, [](std::size_t) { return false; }, out);
  }

  /// The memory of read-locked objects, without taking a hold (LMCache's unsafe_read): valid
  /// while the caller holds a read lock on the key. Also serves holders of an object removed
  /// while they read. Answers: not_found, not_readable (being written), wrong_state (not
  /// read-locked). `views` (size == keys.size()) gets an empty span for each failure.
  std::size_t read_views(std::span<const chunk_key> keys, std::span<status> out,
                         std::span<std::span<const std::byte>> views);

  /// Takes one pinned read hold on each key being written and gives its memory (object_bytes
  /// bytes): for a reader of the bytes its writer told final before the write finished (a
  /// prefetch's load whose backend verified a prefix: l2::load_observer), the layer-wise L2
  /// hit. The reader reads only those bytes; the writer keeps writing the rest. The hold keeps
  /// the memory: a write that finishes leaves the hold on the now readable object; one that is
  /// abandoned (a later part failed) or whose lock expires leaves the tier at once (lookups
  /// miss, a new write of the key answers not_writable) and its memory is freed with the last
  /// hold. Released with finish_read(keys, 0, pinned). Answers: not_found (absent or
  /// removing), wrong_state (not being written). Publishes l1_read_reserved (the holds
  /// balance finish_read's).
  std::size_t reserve_unfinished_read(std::span<const chunk_key> keys, std::span<status> out,
                                      std::span<std::span<const std::byte>> views);

  /// Counts a read of ready objects for the policy without locking them (LMCache's
  /// touch_keys). Returns how many were readable.
  std::size_t touch(std::span<const chunk_key> keys);

  // --- removal -----------------------------------------------------------------------
  /// Deletes keys. A locked key answers locked unless `force`; forced, it leaves the tier
  /// at once (lookups miss, reserve_write answers not_writable for it) and its memory is
  /// freed when its last lock is released or expires (memory is never pulled from under a
  /// reader or an in-flight write). Answers: success, not_found, locked.
  std::size_t remove(std::span<const chunk_key> keys, bool force, std::span<status> out);

  /// Deletes every unlocked object, and with `force` the locked ones as remove(force) does.
  /// Returns the number of objects deleted.
  std::size_t clear(bool force);

  /// Deletes the objects whose key `pred` accepts, each as remove(force) does: an unlocked
  /// object at once; a locked one only when `force`, and then its memory is freed when its
  /// last lock goes (a reader in flight keeps reading the bytes it holds, a writer in flight
  /// finds its key gone at finish_write and its slot freed). One pass over the slots under
  /// the mutex (~5 ns per slot); `pred(key)` runs under it and must not call into the tier.
  template <class Pred>
  removal_summary remove_if(Pred&& pred, bool force);

  /// Calls f(key, bytes, state) for every object held (write-locked, ready or read-locked;
  /// not those removed while locked), in slot order, under the mutex: f must not call into
  /// the tier. For listings (an operator's `ls`): one pass over the slots.
  template <class F>
  void for_each_object(F&& f);

  /// When the used slots are above the watermark, evicts unlocked objects down to the
  /// target; returns the number evicted. reserve_write does this by itself; a host may also
  /// call it from a timer.
  std::size_t evict();

  /// Releases every lock whose TTL has passed (they are otherwise released lazily, when an
  /// operation touches the key or an allocation runs short). Call it periodically, e.g.
  /// once a second. Returns the number of locks released (a key's expiring read holds
  /// count as one).
  std::size_t expire_locks();

  // --- queries -----------------------------------------------------------------------
  /// The state of a key (after releasing its expired locks).
  [[nodiscard]] object_state state(const chunk_key& key);
  /// True when the key is readable now (ready or read-locked).
  [[nodiscard]] bool contains(const chunk_key& key) {
    const auto s = state(key);
    return s == object_state::ready || s == object_state::read_locked;
  }
  /// Locks and size of a key, nullopt when absent.
  [[nodiscard]] std::optional<object_info> info(const chunk_key& key);
  [[nodiscard]] usage_info usage() const;

  /// The arena, for one-time registration (io_uring fixed buffers, cudaHostRegister).
  [[nodiscard]] std::span<std::byte> arena() noexcept { return slots_.arena(); }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slots_.slot_bytes(); }
  [[nodiscard]] std::size_t slot_count() const noexcept { return slots_.slot_count(); }
  [[nodiscard]] const tier_options& options() const noexcept { return options_; }
  /// Slots at the eviction watermark and target (what the shares mean for this tier).
  [[nodiscard]] std::size_t watermark_slots() const noexcept { return watermark_slots_; }
  [[nodiscard]] std::size_t target_slots() const noexcept { return target_slots_; }

 private:
  // One entry per slot (entries_[s] describes slot s), so entries never move and the
  // policy's hook is embedded (intrusive, no per-key node). Fields are guarded by mutex_.
  struct entry : Policy::hook {
    chunk_key key{};
    std::size_t bytes = 0;
    slot_id slot = 0;
    std::uint32_t expiring_readers = 0;
    std::uint32_t pinned_readers = 0;
    time_point write_deadline{};
    time_point read_deadline{};  ///< latest expiring acquire + read_lock_ttl
    bool write_locked = false;
    bool write_pinned = false;
    bool temporary = false;
    bool in_policy = false;  ///< on_insert was called and on_remove not yet
    bool removing = false;   ///< removed while locked; freed at the last unlock
    bool announced = false;  ///< readable once (a key event said stored), not removed since

    [[nodiscard]] std::uint32_t readers() const noexcept { return expiring_readers + pinned_readers; }
    [[nodiscard]] bool locked() const noexcept { return write_locked || readers() > 0; }
    [[nodiscard]] bool has_expiring_lock() const noexcept {
      return (write_locked && !write_pinned) || expiring_readers > 0;
    }
  };

  // The time of one operation, read from the clock on first use only: an operation that
  // meets no expiring lock never reads it (a clock_gettime was 17% of the policy benchmark).
  class lazy_now {
   public:
    explicit lazy_now(const std::function<time_point()>& clock) noexcept : clock_(clock) {}
    time_point operator()() {
      if (!read_) {
        now_ = clock_();
        read_ = true;
      }
      return now_;
    }

   private:
    const std::function<time_point()>& clock_;
    time_point now_{};
    bool read_ = false;
  };

  // What one operation has to publish once the mutex is released (the counts), and whether
  // it logs its key events (key_log_, published before the mutex is released).
  struct tally {
    std::array<std::uint32_t, bus::removal_reason_count> removed_keys{};
    std::array<std::uint64_t, bus::removal_reason_count> removed_bytes{};
    std::array<std::uint32_t, bus::lock_kind_count> expired{};
    std::uint32_t expired_read_holds = 0;
    bool keys = false;  ///< the bus wants key events: log them in key_log_
  };

  // One change of the listing, in index order: stored (change 0) or removed (1 + reason).
  struct key_record {
    chunk_key key;
    std::uint8_t change = 0;
  };

  static bus::null_bus& null_bus_instance() noexcept {
    static bus::null_bus b;
    return b;
  }
  static void check_span(std::size_t keys, std::size_t other, const char* what);
  static void check_extra(std::uint32_t extra_count);
  void check_object_bytes(std::size_t object_bytes, const char* operation) const;

  [[nodiscard]] static bool evictable(const entry& e) noexcept { return e.in_policy && !e.locked(); }
  [[nodiscard]] static bool writable(const entry& e) noexcept { return !e.removing && !e.locked() && !e.temporary; }
  [[nodiscard]] static object_state state_of(const entry& e) noexcept;
  [[nodiscard]] static entry& entry_of(typename Policy::hook& h) noexcept { return static_cast<entry&>(h); }

  // The frame of every operation (impl/tier.hpp): f(lazy_now&, tally&) runs under the mutex;
  // what it removed and expired is published once the mutex is released. Returns f's result.
  template <class F>
  auto run_locked(F&& f);
  // A batch in that frame: per key, per_key(entry or nullptr (absent), index, now, tally)
  // answers its status (written to out unless out is empty). Returns the successes.
  template <class PerKey>
  std::size_t for_each_key(std::span<const chunk_key> keys, std::span<status> out, PerKey&& per_key);
  entry* lookup(const chunk_key& key, lazy_now& now, tally& t);
  void publish(const tally& t);
  // The key events (impl/tier.hpp): whether the bus wants them now; under the mutex, an
  // entry announced (once) as readable, and the log published in runs of one change each.
  [[nodiscard]] bool wants_key_events() const noexcept;
  void announce_stored(entry& e, tally& t);
  void publish_keys();

  // Leaf mutators (impl/tier_entry.hpp): each keeps evictable_, read_locked_ and
  // write_locked_ exact (through adjust), none calls another.
  template <class F>
  void adjust(entry& e, F&& f);
  void lock_write(entry& e, lock_lifetime lifetime, lazy_now& now);
  void unlock_write(entry& e);
  void add_readers(entry& e, lock_lifetime lifetime, std::uint32_t n, lazy_now& now);
  void drop_readers(entry& e, lock_lifetime lifetime, std::uint32_t n);
  void policy_insert(entry& e);
  void policy_leave(entry& e);
  void free_slot(entry& e);

  // An entry leaving the tier (impl/tier_entry.hpp).
  bool release_if_done(entry& e, tally& t);
  /// Ends a write that never finished: the object leaves the tier, freed now, or with the
  /// last hold of a reader of its verified prefix (reserve_unfinished_read). True when freed.
  bool drop_unfinished_write(entry& e, tally& t);
  void count_removal(entry& e, bus::removal_reason reason, tally& t);
  void remove_object(entry& e, bus::removal_reason reason, tally& t);
  void mark_removing(entry& e, tally& t, bus::removal_reason reason = bus::removal_reason::deleted);
  void free_removed(entry& e);

  // Expiry (impl/tier_expiry.hpp) and room for new objects (impl/tier_allocation.hpp).
  bool expire(entry& e, lazy_now& now, tally& t);
  std::size_t expire_all(lazy_now& now, tally& t);
  bool ensure_room(std::size_t need, lazy_now& now, tally& t);
  std::size_t room_for(std::size_t need, lazy_now& now, tally& t);
  std::size_t evict_n(std::size_t n, tally& t);
  // Places keys[new_positions_[j]] for j < count in new slots, write-locked, fills their index
  // placeholders (new_index_slots_) and buffers; the room was made by ensure_room / room_for.
  void place_new_keys(std::span<const chunk_key> keys, std::size_t count, std::size_t bytes, bool temporary,
                      lock_lifetime lock, std::span<std::span<std::byte>> buffers, lazy_now& now);

  /// reserve_write's look-up of keys[i]: the entry to overwrite, or nullptr when the key is
  /// answered here (out[i]: not_found, not_writable) or new (queued in new_positions_ with its
  /// index placeholder).
  entry* write_target(const chunk_key& key, std::size_t i, write_mode mode, std::span<status> out, lazy_now& now,
                      tally& t);

  // The steps of reserve_prefix (impl/tier_prefix.hpp), under the mutex.
  /// Walks keys from the front, taking each (out) until one ends the prefix (r.end, r.length);
  /// new keys get index placeholders (new_positions_). False, with every hold given back, when a
  /// loadable key meets object_bytes 0 (misuse).
  template <class Loadable, class Waitable>
  bool walk_prefix(std::span<const chunk_key> keys, const prefix_options& o, std::uint32_t holds, Loadable& loadable,
                   Waitable& waitable, std::span<prefix_take> out, std::span<std::span<std::byte>> buffers,
                   lazy_now& now, tally& t, prefix_result& r);
  /// Takes keys[i], present as e: read (held when o.hold_reads) or waited for; else why the
  /// prefix ends there.
  template <class Waitable>
  std::optional<prefix_end> take_present(entry& e, std::size_t i, const prefix_options& o, std::uint32_t holds,
                                         Waitable& waitable, std::span<prefix_take> out, lazy_now& now);
  /// Makes room for the walk's new keys; short of room, cuts the prefix to the longest that
  /// fits. Returns how many new keys have a slot.
  std::size_t room_for_prefix(std::span<const chunk_key> keys, const prefix_options& o, std::uint32_t holds,
                              std::span<prefix_take> out, lazy_now& now, tally& t, prefix_result& r);
  /// Gives back, uncounted and unseen by the policy, the holds the walk took from `cut` on.
  void give_back_prefix_reads(std::size_t cut, lock_lifetime read_lock, std::uint32_t holds, tally& t);

  std::size_t finish_write_impl(std::span<const chunk_key> keys, std::span<status> out, bool reserve_read,
                                std::uint32_t extra_count, std::span<const std::uint32_t> holds,
                                lock_lifetime read_lock, std::uint32_t& holds_taken);

  tier_options options_;
  Bus& bus_;
  mutable std::mutex mutex_;
  slot_allocator slots_;
  Policy policy_;
  std::unique_ptr<entry[]> entries_;
  std::unordered_map<chunk_key, entry*, chunk_key_hash> index_;  ///< nullptr: a key being reserved
  std::size_t watermark_slots_ = 0;
  std::size_t target_slots_ = 0;
  std::size_t objects_ = 0;
  std::size_t object_bytes_ = 0;
  std::size_t removing_ = 0;
  std::size_t evictable_ = 0;
  std::size_t read_locked_ = 0;   ///< entries with readers() > 0
  std::size_t write_locked_ = 0;  ///< entries with write_locked
  /// No expiring lock has a deadline before this (a lower bound: sweeps are skipped until
  /// then, so a tier whose locks are all pinned never sweeps).
  time_point earliest_deadline_ = time_point::max();
  // Scratch of reserve_write and eviction, reused under the mutex (no allocation per call).
  std::vector<std::size_t> new_positions_;
  std::vector<entry**> new_index_slots_;
  std::vector<slot_id> new_slots_;
  std::vector<typename Policy::hook*> victims_;
  std::vector<entry*> prefix_reads_;  ///< reserve_prefix: the read keys' entries, in order
  std::vector<std::size_t> prefix_read_positions_;
  std::vector<key_record> key_log_;  ///< an operation's key events, when tally::keys
};

}  // namespace l1
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#include <kvtier/l1/impl/tier.hpp>

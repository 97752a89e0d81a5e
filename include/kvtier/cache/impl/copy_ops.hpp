#pragma once
// tiered_cache's whole copies (cache/copy.hpp): the state machines of async_copy_out
// (copy_out_op: chunk-major, part-major, or part-wise from verified prefixes) and
// async_copy_in (copy_in_op), each described above its class. Declarations and documentation:
// cache/tiered_cache.hpp; docs/pipelines.md, "The cache".
//
// Locks: an op's mutex is taken before the cache's mutex_, never while holding it or the
// tier's; the sink and the source run with no lock held.

#include <kvtier/cache/tiered_cache.hpp>

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>

#include <limits>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace cache {

// copy_out_op. Walks the request's keys in order and makes each one *ready* (the op holds a
// pinned read lock on it and knows its memory): a key the lookup holds is taken over (the
// lookup's 1 + extra holds become the op's, so a concurrent release_all cannot free the slot
// under the copy); a key the lookup is still loading is waited for (the lookup's watcher
// wakes the op when its prefetch reports it); any other key is pinned if L1 has it. The
// first key that is neither ends the prefix. Ready keys are copied on the copy executor:
// one task per key (chunk-major, in order, as they become ready), or, when every key of the
// prefix is ready at the start and the sink wants several parts, one task per part over all
// keys (part-major: on_progress tells the parts done). Once no task runs and nothing is left
// to wait for, the op gives back every hold it took and the lookup's holds on the rest of
// the request's keys, and completes with the contiguous prefix copied.
//
// Part-wise (the sink wants several parts, the op serves a lookup, and not every key was ready
// at the start: a layer-wise retrieve of an L2 hit). Every key of the request is watched at
// once, not only the first one not ready: a key still loading whose backend verified a prefix
// (the lookup's partial hold, taken over by the op: its slot stays allocated while the op
// reads it, even if the rest of the load fails) has its parts inside that prefix copied at
// once; a key that lands has all of them. Copies are posted part-major (part 0 of every key
// before part 1 of any), one task per (key, part); on_progress tells the leading parts copied
// for every key of the prefix.
template <class Traits>
class tiered_cache<Traits>::copy_out_op : public std::enable_shared_from_this<copy_out_op> {
 public:
  copy_out_op(tiered_cache& c, copy_out_request r, copy_out_sink sink, copy_out_handler h)
      : c_(c),
        keys_(r.keys.begin(), r.keys.end()),
        object_bytes_(r.object_bytes),
        parts_(r.parts == 0 ? 1 : r.parts),
        progress_(std::move(r.on_progress)),
        sink_(std::move(sink)),
        handler_(std::move(h)),
        lookup_id_(r.lookup),
        state_(keys_.size(), key_state::waiting),
        views_(keys_.size()),
        from_lookup_(keys_.size()),
        end_(keys_.size()) {}

  void start() {
    l_ = lookup_id_ ? c_.find(lookup_id_) : nullptr;
    pos_.assign(keys_.size(), npos);
    if (l_) {
      std::lock_guard g(c_.mutex_);
      std::size_t guess = l_->keys.size();
      for (std::size_t i = 0; i < keys_.size(); ++i) {
        const std::size_t p = locate(*l_, keys_[i], guess);
        pos_[i] = p < l_->keys.size() ? p : npos;
      }
    }
    std::unique_lock g(m_);
    advance(g, true);
  }

 private:
  enum class key_state : std::uint8_t { waiting, ready, copying, copied, failed, partial };
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  // How the op gets key i ready: take over the lookup's holds, wait for the lookup's
  // prefetch, pin it itself, or not at all (the prefix ends there).
  // Part-wise, a key still loading may also have a verified prefix to copy from (partial).
  enum class resolution : std::uint8_t { take, wait, pin, ends, partial };

  // Makes the keys from resolved_ on ready while it can, then schedules copies. Under m_.
  void advance(std::unique_lock<std::mutex>& g, bool first) {
    if (finishing_) return;  // a late watcher call: the op gave everything back already
    if (part_wise_) return advance_part_wise(g);
    std::vector<std::size_t> fresh;  // keys made ready now, in order
    while (resolved_ < end_) {
      const std::size_t i = resolved_;
      const resolution what = l_ && pos_[i] != npos ? ask_lookup(i, nullptr) : resolution::pin;
      if (what == resolution::ends) {
        end_ = i;  // its load (or its chunk's) failed: the prefix ends here
        break;
      }
      if (what == resolution::wait) break;
      if (!hold(i, what)) break;
      fresh.push_back(i);
      ++resolved_;
    }
    if (!fresh.empty()) read_fresh_views(fresh);
    if (first && parts_ > 1 && l_ && resolved_ < end_) return start_part_wise(g);
    schedule_copies(first);
    maybe_finish(g);
  }

  // --- part-wise ------------------------------------------------------------------------
  // Switches to part-wise copying: the keys [0, resolved_) are ready. Under m_.
  void start_part_wise(std::unique_lock<std::mutex>& g) {
    part_wise_ = true;
    final_parts_.assign(keys_.size(), 0);
    posted_.assign(keys_.size(), 0);
    lead_copied_.assign(keys_.size(), 0);
    part_copied_.assign(keys_.size() * parts_, 0);
    for (std::size_t i = 0; i < resolved_; ++i) final_parts_[i] = parts_;
    advance_part_wise(g);
  }

  // Looks at every key not ready yet (not only the first): takes, pins, or reads the verified
  // prefix of each one it can, then posts the parts that became copyable. Under m_.
  void advance_part_wise(std::unique_lock<std::mutex>& g) {
    std::vector<std::size_t> fresh;
    for (std::size_t i = resolved_; i < end_; ++i) {
      if (final_parts_[i] == parts_ || state_[i] == key_state::failed) continue;
      std::size_t verified = 0;
      const resolution what = l_ && pos_[i] != npos ? ask_lookup(i, &verified) : resolution::pin;
      if (what == resolution::ends) {
        end_ = i;
        break;
      }
      if (what == resolution::wait) continue;
      if (what == resolution::partial) {
        state_[i] = key_state::partial;
        std::size_t& f = final_parts_[i];
        while (f < parts_ && part_end(i, f) <= verified) ++f;
        if (f == parts_) f = parts_ - 1;  // the last part is copied once the key landed
        continue;
      }
      if (!hold(i, what)) break;
      fresh.push_back(i);
    }
    if (!fresh.empty()) read_fresh_views(fresh);
    for (std::size_t i : fresh)
      if (i < end_) final_parts_[i] = parts_;
    while (resolved_ < end_ && final_parts_[resolved_] == parts_) ++resolved_;
    post_parts();
    maybe_finish_part_wise(g);
  }

  // One past the last byte of part p of key i: parts are equal slices of the object.
  [[nodiscard]] std::size_t part_end(std::size_t i, std::size_t p) const noexcept {
    return views_[i].size() * (p + 1) / parts_;
  }

  // Posts the copyable parts not posted yet, part-major. Under m_.
  void post_parts() {
    std::size_t lo = parts_, hi = 0;
    for (std::size_t i = 0; i < end_; ++i) {
      lo = std::min(lo, posted_[i]);
      hi = std::max(hi, final_parts_[i]);
    }
    for (std::size_t p = lo; p < hi; ++p)
      for (std::size_t i = 0; i < end_; ++i) {
        if (posted_[i] != p || p >= final_parts_[i] || state_[i] == key_state::failed) continue;
        ++posted_[i];
        ++running_;
        post([self = this->shared_from_this(), i, p] { self->copy_one(i, p); });
      }
  }

  void copy_one(std::size_t i, std::size_t p) {
    const bool ok = sink_(i, p, views_[i]);
    std::size_t report = 0;
    {
      std::lock_guard g(m_);
      if (!ok) {
        state_[i] = key_state::failed;
        end_ = std::min(end_, i);
      } else {
        part_copied_[i * parts_ + p] = 1;
        while (lead_copied_[i] < parts_ && part_copied_[i * parts_ + lead_copied_[i]] != 0) ++lead_copied_[i];
      }
      std::size_t done = end_ > 0 ? parts_ : 0;
      for (std::size_t k = 0; k < end_; ++k) done = std::min(done, lead_copied_[k]);
      if (done > parts_reported_ && done < parts_) report = parts_reported_ = done;
    }
    end_task(report);
  }

  // Under m_: finishes once nothing runs and every key of the prefix is copied whole.
  void maybe_finish_part_wise(std::unique_lock<std::mutex>& g) {
    if (finishing_ || running_ > 0) return;
    for (std::size_t i = 0; i < end_; ++i)
      if (final_parts_[i] < parts_ || lead_copied_[i] < parts_) return;  // still loading: a watcher wakes us
    finishing_ = true;
    g.unlock();
    finish(end_);
  }

  // Key i, which the lookup holds or loads, under the cache's mutex. Under m_. With
  // `verified` (part-wise), a key still loading whose verified prefix the lookup holds (or
  // the op took over) answers partial, with the verified bytes.
  resolution ask_lookup(std::size_t i, std::size_t* verified) {
    std::lock_guard lg(c_.mutex_);
    const std::size_t p = pos_[i];
    resolution what = resolution::pin;
    if (!l_->done) {
      what = resolution::wait;  // the prefetch has not decided yet: complete() wakes us
    } else if (l_->failed.test(p)) {
      return resolution::ends;
    }
    if (l_->held.test(p)) {
      l_->held.reset(p);  // its holds are the op's now
      what = resolution::take;
    } else if (l_->pending.test(p)) {
      what = resolution::wait;
      if (verified != nullptr && (l_->partial.test(p) || state_[i] == key_state::partial)) {
        if (l_->partial.test(p)) {  // its hold on the slot is the op's now
          l_->partial.reset(p);
          l_->partial_given.set(p);
          views_[i] = l_->partial_views[p];
          l_->partial_views[p] = {};
          own_pin_.push_back(keys_[i]);
        }
        *verified = l_->verified[p];
        what = resolution::partial;
      }
    }
    if ((what == resolution::wait || what == resolution::partial) && !watching_) watch_lookup();
    return what;
  }

  // Asks the lookup to wake the op when its prefetch reports. Under m_ and the cache's mutex.
  void watch_lookup() {
    watching_ = true;
    // The op keeps itself alive while it waits (nothing else may hold it); the
    // lookup's watcher only refers to it, and finish() lets go.
    keep_alive_ = this->shared_from_this();
    std::weak_ptr<copy_out_op> weak = keep_alive_;
    l_->watchers.push_back([weak] {
      if (auto op = weak.lock()) {
        std::unique_lock og(op->m_);
        op->advance(og, false);
      }
    });
  }

  // Key i resolved take or pin: takes over the lookup's holds, or pins it; ready then, else
  // (L1 does not have it) the prefix ends at i. Under m_.
  bool hold(std::size_t i, resolution what) {
    if (what == resolution::take) {
      from_lookup_.set(i);
    } else if (!pin_own(i)) {
      end_ = i;
      return false;
    }
    state_[i] = key_state::ready;
    return true;
  }

  // Not the lookup's: pins key i if L1 has it (one hold, ours). Under m_.
  bool pin_own(std::size_t i) {
    std::vector<l1::prefix_take> takes(1);
    l1::prefix_options po;
    po.object_bytes = object_bytes_;
    po.read_lock = l1::lock_lifetime::pinned;
    po.count_refused_read = true;
    if (c_.l1_.reserve_read_prefix(std::span(&keys_[i], 1), po, takes).length != 1) return false;
    own_pin_.push_back(keys_[i]);
    return true;
  }

  // The memory of the keys just made ready; one unreadable or of another size ends the prefix. Under m_.
  void read_fresh_views(const std::vector<std::size_t>& fresh) {
    std::vector<chunk_key> k;
    for (std::size_t i : fresh) k.push_back(keys_[i]);
    std::vector<l1::status> st(k.size());
    std::vector<std::span<const std::byte>> v(k.size());
    c_.l1_.read_views(k, st, v);
    for (std::size_t j = 0; j < fresh.size(); ++j) {
      // A key copied part-wise from its verified prefix keeps the view its copies read (the
      // same slot): rewriting it would race with them.
      if (views_[fresh[j]].empty()) views_[fresh[j]] = v[j];
      if (st[j] != l1::status::success || (object_bytes_ != 0 && v[j].size() != object_bytes_))
        end_ = std::min(end_, fresh[j]);
    }
  }

  // Posts the copies of the ready keys: part-major when the whole prefix is ready at the
  // start and the sink wants several parts, else one task per key. Under m_.
  void schedule_copies(bool first) {
    if (first && parts_ > 1 && resolved_ >= end_ && end_ > 0) {
      // Everything is readable now: copy part-major, so the first parts are usable early.
      part_major_ = true;
      part_done_.assign(parts_, false);
      for (std::size_t i = 0; i < end_; ++i) state_[i] = key_state::copying;
      running_ += parts_;
      for (std::size_t p = 0; p < parts_; ++p) post([self = this->shared_from_this(), p] { self->copy_part(p); });
    } else if (!part_major_) {
      for (; scheduled_ < resolved_ && scheduled_ < end_; ++scheduled_) {
        state_[scheduled_] = key_state::copying;
        ++running_;
        post([self = this->shared_from_this(), i = scheduled_] { self->copy_key(i); });
      }
    }
  }

  template <class F>
  void post(F&& f) {
    boost::asio::post(c_.copy_executor_, std::forward<F>(f));
  }

  void copy_key(std::size_t i) {
    bool ok = true;
    for (std::size_t p = 0; p < parts_ && ok; ++p) ok = sink_(i, p, views_[i]);
    std::unique_lock g(m_);
    state_[i] = ok ? key_state::copied : key_state::failed;
    if (!ok) end_ = std::min(end_, i);
    --running_;
    maybe_finish(g);
  }

  void copy_part(std::size_t p) {
    std::size_t n;
    {
      std::lock_guard g(m_);
      n = end_;
    }
    std::size_t bad = npos;
    for (std::size_t i = 0; i < n; ++i)
      if (!sink_(i, p, views_[i]) && bad == npos) bad = i;
    std::size_t done = 0;
    {
      std::lock_guard g(m_);
      if (bad != npos) {
        state_[bad] = key_state::failed;
        end_ = std::min(end_, bad);
      }
      part_done_[p] = true;
      const std::size_t before = parts_done_;
      while (parts_done_ < parts_ && part_done_[parts_done_]) ++parts_done_;
      if (parts_done_ > before && parts_done_ < parts_) done = parts_done_;
    }
    end_task(done);
  }

  // The end of a part-major or part-wise copy task: its progress (`parts_done`, 0: none)
  // before it stops counting, so the completion always comes after it (two tasks may report
  // out of order: the receiver keeps the largest).
  void end_task(std::size_t parts_done) {
    if (parts_done > 0 && progress_) progress_(parts_done);
    std::unique_lock g(m_);
    --running_;
    if (part_wise_)
      maybe_finish_part_wise(g);
    else
      maybe_finish(g);
  }

  // Under m_: finishes once nothing runs and nothing is left to copy or wait for.
  void maybe_finish(std::unique_lock<std::mutex>& g) {
    if (finishing_ || running_ > 0) return;
    if (!part_major_ && scheduled_ < end_) return;  // waiting for a key still loading
    finishing_ = true;
    std::size_t copied = 0;
    while (copied < end_ &&
           (state_[copied] == key_state::copied || (part_major_ && state_[copied] == key_state::copying)))
      ++copied;
    g.unlock();
    finish(copied);
  }

  void finish(std::size_t copied) {
    std::vector<chunk_key> taken, back, partial;
    for (std::size_t i = 0; i < keys_.size(); ++i)
      if (from_lookup_.test(i)) taken.push_back(keys_[i]);
    if (l_) {
      std::lock_guard g(c_.mutex_);
      for (std::size_t i = 0; i < keys_.size(); ++i) {
        const std::size_t p = pos_[i];
        if (p == npos || from_lookup_.test(i)) continue;
        if (l_->pending.test(p)) l_->gone.set(p);  // not copied: its hold goes back when it lands
        take_partial_back(*l_, p, partial);
        if (l_->held.test(p)) {
          l_->held.reset(p);
          back.push_back(keys_[i]);
        }
      }
    }
    const std::uint32_t extra = l_ ? l_->extra : 0;
    c_.release_holds(taken, extra);
    c_.release_holds(back, extra);
    c_.release_holds(own_pin_, 0);
    c_.release_holds(partial, 0);
    c_.bus_.publish(bus::cache_read_prefetched{static_cast<std::uint32_t>(copied),
                                               static_cast<std::uint32_t>(keys_.size() - copied)});
    if (l_) c_.forget_if_done(lookup_id_, *l_);
    auto h = std::move(handler_);
    auto self = std::move(keep_alive_);  // alive until this function returns
    tiered_cache& c = c_;
    // Through the cache's executor first (the op may finish inside the initiation, or on a
    // copy thread), then on the handler's own; counted until the handler ran. The handler's
    // executor is looked up, copied and dropped only on the cache's executor: asio's shared
    // executor targets count references with fences that TSan cannot see, so copies of one
    // dropped on two threads read as a race.
    boost::asio::post(c.executor_, [h = std::move(h), copied, &c]() mutable {
      auto ex = boost::asio::get_associated_executor(h, c.executor_);
      boost::asio::dispatch(ex, [h = std::move(h), copied, &c]() mutable {
        std::move(h)(error_code{}, copied);
        c.tracker_.end();
      });
    });
  }

  tiered_cache& c_;
  std::vector<chunk_key> keys_;
  std::size_t object_bytes_;
  std::size_t parts_;
  std::function<void(std::size_t)> progress_;
  copy_out_sink sink_;
  copy_out_handler handler_;
  lookup_id lookup_id_;
  std::shared_ptr<lookup> l_;
  std::vector<std::size_t> pos_;  ///< key i's index in the lookup, npos when it has none
  std::mutex m_;
  std::vector<key_state> state_;
  std::vector<std::span<const std::byte>> views_;
  bitmap from_lookup_;              ///< the op took over the lookup's holds on key i
  std::vector<chunk_key> own_pin_;  ///< keys the op pinned itself (one hold each)
  std::size_t end_;                 ///< keys from end_ on are not copied
  std::size_t resolved_ = 0;        ///< keys [0, resolved_) are ready (or copying, copied)
  std::size_t scheduled_ = 0;       ///< chunk-major: keys [0, scheduled_) were posted
  std::size_t running_ = 0;
  bool watching_ = false;
  std::shared_ptr<copy_out_op> keep_alive_;  ///< set while a watcher may wake the op
  bool part_major_ = false;
  bool finishing_ = false;
  std::vector<bool> part_done_;
  std::size_t parts_done_ = 0;
  // Part-wise (under m_): per key, its leading parts whose bytes are final (landed, or inside
  // its verified prefix), posted, and copied; per (key, part), copied.
  bool part_wise_ = false;
  std::vector<std::size_t> final_parts_;
  std::vector<std::size_t> posted_;
  std::vector<std::size_t> lead_copied_;
  std::vector<std::uint8_t> part_copied_;
  std::size_t parts_reported_ = 0;
};

template <class Traits>
void tiered_cache<Traits>::start_copy_out(copy_out_request r, copy_out_sink sink, copy_out_handler h) {
  tracker_.begin();  // ended after the handler ran
  auto op = std::make_shared<copy_out_op>(*this, std::move(r), std::move(sink), std::move(h));
  op->start();
}

// copy_in_op. reserve_write, one task per reserved key on the copy executor, then, on the
// completion's executor, the fence per key and finish_write / abandon_write.
template <class Traits>
class tiered_cache<Traits>::copy_in_op : public std::enable_shared_from_this<copy_in_op> {
 public:
  copy_in_op(tiered_cache& c, copy_in_request r, copy_in_source source, copy_in_fence fence, copy_in_handler h)
      : c_(c),
        keys_(r.keys.begin(), r.keys.end()),
        object_bytes_(r.object_bytes),
        context_(r.context),
        source_(std::move(source)),
        fence_(std::move(fence)),
        handler_(std::move(h)) {}

  void start() {
    const std::size_t n = keys_.size();
    std::vector<l1::status> st(n);
    buffers_.assign(n, {});
    if (n > 0) c_.reserve_write(keys_, object_bytes_, st, buffers_);
    ok_.assign(n, false);
    for (std::size_t i = 0; i < n; ++i) {
      if (st[i] == l1::status::success)
        reserved_.push_back(i);
      else if (st[i] == l1::status::not_writable)
        ++result_.already_present;
      else
        ++result_.failed;
    }
    if (reserved_.empty()) return complete();
    left_ = reserved_.size();
    for (std::size_t i : reserved_)
      boost::asio::post(c_.copy_executor_, [self = this->shared_from_this(), i] {
        const bool ok = self->source_(i, self->buffers_[i]);
        std::unique_lock g(self->m_);
        self->ok_[i] = ok;
        if (--self->left_ == 0) {
          g.unlock();
          self->complete();
        }
      });
  }

 private:
  // On the handler's executor (posted: never inside the initiation): fence, finish or
  // abandon, answer.
  // The handler's executor is looked up and dropped on the cache's executor only (see
  // copy_out_op::finish), never on the copy thread that ran the last copy.
  void complete() {
    boost::asio::post(c_.executor_, [self = this->shared_from_this()] {
      auto ex = boost::asio::get_associated_executor(self->handler_, self->c_.executor_);
      boost::asio::dispatch(ex, [self] { self->finish(); });
    });
  }

  void finish() {
    std::vector<chunk_key> good, bad;
    for (std::size_t i : reserved_) (ok_[i] && (!fence_ || fence_(i)) ? good : bad).push_back(keys_[i]);
    if (!bad.empty()) {
      c_.abandon_write(bad);
      result_.failed += bad.size();
    }
    if (!good.empty()) {
      std::vector<l1::status> fs(good.size());
      const std::size_t stored = c_.finish_write(good, context_, fs);
      result_.stored += stored;
      result_.failed += good.size() - stored;
    }
    auto h = std::move(handler_);
    tiered_cache& c = c_;
    const copy_in_result r = result_;
    std::move(h)(error_code{}, r);  // already on its executor
    c.tracker_.end();
  }

  tiered_cache& c_;
  std::vector<chunk_key> keys_;
  std::size_t object_bytes_;
  pipeline::write_context context_;
  copy_in_source source_;
  copy_in_fence fence_;
  copy_in_handler handler_;
  std::vector<std::span<std::byte>> buffers_;
  std::vector<std::size_t> reserved_;
  std::vector<bool> ok_;  ///< written under m_ by the copies, read after the last one
  std::size_t left_ = 0;
  std::mutex m_;
  copy_in_result result_;
};

template <class Traits>
void tiered_cache<Traits>::start_copy_in(copy_in_request r, copy_in_source source, copy_in_fence fence,
                                         copy_in_handler h) {
  tracker_.begin();  // ended after the handler ran
  auto op = std::make_shared<copy_in_op>(*this, std::move(r), std::move(source), std::move(fence), std::move(h));
  op->start();
}

}  // namespace cache
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

#pragma once
// Definitions of mini_engine::engine (engine.hpp).

#include <cmath>

namespace mini_engine {

inline nlohmann::json run_report::to_json() const {
  nlohmann::json reqs = nlohmann::json::array();
  for (const auto& r : requests)
    reqs.push_back({{"id", r.id},
                    {"prompt_tokens", r.prompt_tokens},
                    {"hit_tokens", r.hit_tokens},
                    {"retrieved_tokens", r.retrieved_tokens},
                    {"computed_tokens", r.computed_tokens},
                    {"ttft_s", r.ttft_s},
                    {"latency_s", r.latency_s},
                    {"output_ok", r.output_ok}});
  return {{"duration_s", duration_s},
          {"completed", completed},
          {"wrong_outputs", wrong_outputs},
          {"corrupt_rows", corrupt_rows},
          {"duplicate_finished", duplicate_finished},
          {"load_error_blocks", load_error_blocks},
          {"tokens_total", tokens_total},
          {"tokens_from_cache", tokens_from_cache},
          {"throughput_tokens_per_s", throughput_tokens_per_s()},
          {"unhealthy_transitions", unhealthy_transitions},
          {"requests", reqs}};
}

inline std::uint32_t engine::allocate_block() {
  // Blocks freed while quarantined wait in held_ until every rank releases them.
  for (auto it = held_.begin(); it != held_.end();) {
    bool q = false;
    for (auto& rs : ranks_) q = q || (rs->conn && rs->conn->block_is_quarantined(*it));
    if (!q) {
      free_.push_back(*it);
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
  while (!free_.empty()) {
    const std::uint32_t b = free_.front();
    free_.pop_front();
    bool ok = true;
    for (auto& rs : ranks_) {
      if (rs->conn) ok = ok && rs->conn->block_reused(b);  // new content: fences any store that read it
      else rs->region.begin_reuse(b);
    }
    if (ok) return b;
    held_.push_back(b);
  }
  return UINT32_MAX;
}

inline bool engine::allocate(request& r) {
  const std::size_t tokens = r.spec.tokens.size() + r.spec.output_tokens;
  const std::size_t need = (tokens + cfg_.block_size - 1) / cfg_.block_size;
  if (free_.size() + held_.size() < need) return false;
  std::vector<std::uint32_t> got;
  while (got.size() < need) {
    const std::uint32_t b = allocate_block();
    if (b == UINT32_MAX) {
      for (auto x : got) free_.push_front(x);
      return false;
    }
    got.push_back(b);
  }
  r.blocks = std::move(got);
  return true;
}

// Gives a fresh block to every replaced block of tokens [first, last); false when none is
// free now (the request waits a step).
inline bool engine::ensure_blocks(request& r, std::size_t first_token, std::size_t last_token) {
  for (std::size_t i = first_token / cfg_.block_size; i * cfg_.block_size < last_token && i < r.blocks.size(); ++i)
    if (r.blocks[i] == no_block) {
      r.blocks[i] = allocate_block();
      if (r.blocks[i] == no_block) return false;
    }
  return true;
}

inline void engine::release_blocks(request& r) {
  for (auto b : r.blocks) {
    if (b == no_block) continue;
    bool q = false;
    for (auto& rs : ranks_) q = q || (rs->conn && rs->conn->block_is_quarantined(b));
    (q ? held_.push_back(b) : free_.push_back(b));
  }
  r.blocks.clear();
}

inline void engine::start_retrieve(request& r) {
  const std::uint32_t chunks = static_cast<std::uint32_t>(r.hit_tokens / cfg_.chunk_tokens);
  const std::size_t bpc = cfg_.chunk_tokens / cfg_.block_size;
  std::span<const std::uint32_t> ids(r.blocks.data(), chunks * bpc);
  for (auto& rs : ranks_) rs->conn->retrieve(r.spec.id, r.spec.tokens, 0, ids, 0);
  r.retrieve_pending = ranks_.size();
  r.ph = phase::retrieving;
}

// Every rank finished its retrieve: blocks that did not land are recomputed (into fresh
// blocks when the connector quarantined them), the rest is verified against recomputation.
// load_errors_ holds every rank's load-error blocks of all requests (taken once per step,
// before any retrieve is finished): each request picks out its own.
inline void engine::finish_retrieve(request& r) {
  std::size_t good = r.hit_tokens;
  std::size_t failed = 0;
  for (std::size_t i = 0; i < r.blocks.size(); ++i)
    if (r.blocks[i] != no_block && load_errors_.erase(r.blocks[i]) != 0) {
      ++failed;
      good = std::min(good, (i * cfg_.block_size) / cfg_.chunk_tokens * cfg_.chunk_tokens);
      bool q = false;
      for (auto& rs : ranks_) q = q || rs->conn->block_is_quarantined(r.blocks[i]);
      if (q) {  // the server may still write it: never touch it again, recompute elsewhere
        held_.push_back(r.blocks[i]);
        r.blocks[i] = no_block;  // allocated by ensure_blocks before the prefill writes it
      }
    }
  r.report.hit_tokens = r.hit_tokens;
  r.retrieved_tokens = good;
  r.computed = good;
  r.ph = phase::prefill;
  pending_errors_ += failed;
  // Every retrieved row must equal what the model computes for it.
  for (auto& rs : ranks_)
    verify_rows_ += write_or_verify(rs->region, rs->shard_, r.hashes, r.blocks, 0, good, false, cfg_.verify_every);
}

inline void engine::prefill_step(std::vector<request*>& running, run_report& rep) {
  std::size_t budget = cfg_.max_batch_tokens;
  const auto step_start = clock::now();
  std::size_t done_tokens = 0;
  std::vector<request*> prefilled;
  for (request* r : running) {
    if (r->ph != phase::prefill || budget == 0) continue;
    const std::size_t prompt = r->spec.tokens.size();
    const std::size_t n = std::min(budget, prompt - r->computed);
    if (!ensure_blocks(*r, r->computed, prompt + r->spec.output_tokens)) continue;
    for (auto& rs : ranks_) write_or_verify(rs->region, rs->shard_, r->hashes, r->blocks, r->computed, r->computed + n, true);
    r->computed += n;
    budget -= n;
    done_tokens += n;
    if (r->computed == prompt) prefilled.push_back(r);
  }
  // The compute cost: a step lasts at least its tokens at tokens_per_second. The first token
  // comes out at the end of the step that finished the prompt, so TTFT includes it.
  if (done_tokens > 0 && cfg_.tokens_per_second > 0) {
    const auto cost = std::chrono::duration<double>(static_cast<double>(done_tokens) / cfg_.tokens_per_second);
    std::this_thread::sleep_until(step_start + std::chrono::duration_cast<clock::duration>(cost));
  }
  for (request* r : prefilled) complete(*r, rep);
}

// Prefill done: first token (checked), store the new full chunks, report finished.
inline void engine::complete(request& r, run_report& rep) {
  const std::size_t prompt = r.spec.tokens.size();
  const auto now = clock::now();
  r.report.id = r.spec.id;
  r.report.prompt_tokens = prompt;
  r.report.retrieved_tokens = r.retrieved_tokens;
  r.report.computed_tokens = prompt - r.retrieved_tokens;
  r.report.ttft_s = std::chrono::duration<double>(now - r.arrival).count();
  // The output token depends on the last token's KV as it sits in the blocks.
  std::size_t bad = 0;
  for (auto& rs : ranks_) bad += write_or_verify(rs->region, rs->shard_, r.hashes, r.blocks, prompt - 1, prompt, false);
  r.report.output_ok = bad == 0;
  rep.wrong_outputs += bad == 0 ? 0 : 1;
  rep.tokens_total += prompt;
  rep.tokens_from_cache += r.retrieved_tokens;
  // Store the full chunks the cache did not give us.
  const std::uint32_t first = static_cast<std::uint32_t>(r.retrieved_tokens / cfg_.chunk_tokens);
  const std::uint32_t last = static_cast<std::uint32_t>(prompt / cfg_.chunk_tokens);
  if (has_connector() && last > first) {
    const std::size_t bpc = cfg_.chunk_tokens / cfg_.block_size;
    std::span<const std::uint32_t> ids(r.blocks.data() + first * bpc, (last - first) * bpc);
    for (auto& rs : ranks_) rs->conn->store(r.spec.id, r.spec.tokens, first, last - first, ids);
  }
  r.ph = phase::storing;
  r.finished_by_engine = true;
  r.send_pending = has_connector() ? ranks_.size() : 0;
}

inline run_report engine::run(std::vector<request_spec> specs) {
  run_report rep;
  cancelled_.store(false);
  std::sort(specs.begin(), specs.end(), [](const auto& a, const auto& b) { return a.arrival_s < b.arrival_s; });
  std::vector<std::unique_ptr<request>> reqs;
  for (auto& s : specs) {
    auto r = std::make_unique<request>();
    r->spec = std::move(s);
    r->hashes = prefix_hashes(r->spec.tokens);
    reqs.push_back(std::move(r));
  }
  std::unordered_map<std::string, request*> by_id;
  for (auto& r : reqs) by_id[r->spec.id] = r.get();
  const std::uint64_t unhealthy_before =
      has_connector() ? static_cast<std::uint64_t>(ranks_[0]->reg.value("kvtier_connector_unhealthy_total").value_or(0))
                      : 0;
  const auto t0 = clock::now();
  std::size_t next = 0;
  std::size_t finished = 0;
  std::vector<request*> running;
  std::vector<std::string> finished_now;

  // With one rank, its connector wakes an idle step at an answer, a retrieve's or a store's
  // end (a real engine keeps stepping while requests wait for KV; a 500 us timer here made
  // every hit's TTFT 0.25 ms later on average per wait); with more, a rank's event alone does
  // not finish a request, so the timer stays.
  const bool wakes_on_progress = ranks_.size() == 1 && has_connector();
  while (finished < reqs.size() && !cancelled_.load()) {
    // What the connector did before this step's calls: an idle step sleeps until it moves.
    const std::uint64_t progress_seen = wakes_on_progress ? ranks_[0]->conn->progress() : 0;
    const auto now = clock::now();
    // Arrivals.
    while (next < reqs.size() && (cfg_.max_in_flight == 0 || running.size() < cfg_.max_in_flight) &&
           now >= t0 + std::chrono::duration_cast<clock::duration>(
                           std::chrono::duration<double>(reqs[next]->spec.arrival_s))) {
      request& r = *reqs[next++];
      r.arrival = now;
      if (has_connector()) {
        ranks_[0]->conn->lookup(r.spec.id, r.spec.tokens);
        r.ph = phase::lookup;
      } else {
        r.ph = phase::allocate;
      }
      running.push_back(&r);
    }
    // Lookups answered -> allocate -> retrieve or prefill.
    std::size_t active = 0;
    for (request* r : running) active += (r->ph != phase::lookup && r->ph != phase::allocate) ? 1 : 0;
    for (request* r : running) {
      if (r->ph == phase::lookup) {
        const auto hit = ranks_[0]->conn->lookup_result(r->spec.id);
        if (!hit) continue;
        // The engine computes at least the last token itself (to produce the first output).
        const std::size_t cap = (r->spec.tokens.size() - 1) / cfg_.chunk_tokens * cfg_.chunk_tokens;
        r->hit_tokens = std::min(*hit, cap);
        r->ph = phase::allocate;
      }
      if (r->ph == phase::allocate && active < cfg_.max_running && allocate(*r)) {
        ++active;
        if (r->hit_tokens > 0) start_retrieve(*r);
        else r->ph = phase::prefill;
      }
    }
    prefill_step(running, rep);

    // Report to the connectors; collect what they finished.
    finished_now.clear();
    for (request* r : running)
      if (r->finished_by_engine && !r->report.id.empty() && r->ph == phase::storing && !r->reported) {
        finished_now.push_back(r->spec.id);
        r->reported = true;
      }
    if (has_connector()) {
      std::vector<request*> retrieved;
      for (auto& rs : ranks_) {
        auto f = rs->conn->get_finished(finished_now);
        for (const auto& id : f.recving) {
          if (!rs->recv_seen.insert(id).second) ++rep.duplicate_finished;
          if (auto it = by_id.find(id); it != by_id.end() && it->second->ph == phase::retrieving &&
                                        --it->second->retrieve_pending == 0)
            retrieved.push_back(it->second);
        }
        for (const auto& id : f.sending) {
          if (!rs->send_seen.insert(id).second) ++rep.duplicate_finished;
          if (auto it = by_id.find(id); it != by_id.end() && it->second->send_pending > 0) --it->second->send_pending;
        }
      }
      // A retrieve's load errors are published before it is reported finished, so after
      // every rank's get_finished they are all there. They are the connectors' (vLLM's
      // get_block_ids_with_load_errors), not per request: never take them per request, or
      // one request would take another's and that one would trust blocks never written.
      for (auto& rs : ranks_)
        for (auto b : rs->conn->take_load_error_blocks()) load_errors_.insert(b);
      for (request* r : retrieved) finish_retrieve(*r);
    }
    // Requests done everywhere free their blocks.
    for (auto it = running.begin(); it != running.end();) {
      request* r = *it;
      if (r->ph == phase::storing && r->send_pending == 0) {
        if (has_connector()) ranks_[0]->conn->end_request(r->spec.id);
        r->report.latency_s = std::chrono::duration<double>(clock::now() - r->arrival).count();
        release_blocks(*r);
        r->ph = phase::done;
        rep.requests.push_back(r->report);
        ++rep.completed;
        ++finished;
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    // Nothing computed this step: wait a little for lookups, retrieves and stores.
    bool computing = false;
    for (request* r : running) computing = computing || r->ph == phase::prefill;
    if (!computing) {
      constexpr std::chrono::microseconds idle_wait{500};
      if (wakes_on_progress)
        ranks_[0]->conn->wait_progress(progress_seen, idle_wait);
      else
        std::this_thread::sleep_for(idle_wait);
    }
  }
  rep.duration_s = std::chrono::duration<double>(clock::now() - t0).count();
  rep.corrupt_rows = verify_rows_;
  rep.load_error_blocks = pending_errors_;
  verify_rows_ = 0;
  pending_errors_ = 0;
  if (has_connector())
    rep.unhealthy_transitions =
        static_cast<std::uint64_t>(ranks_[0]->reg.value("kvtier_connector_unhealthy_total").value_or(0)) -
        unhealthy_before;
  // Abandoned by cancel(): give their blocks back (quarantine still applies).
  for (request* r : running) release_blocks(*r);
  return rep;
}

}  // namespace mini_engine

#pragma once
// Definitions of redis_batch (declarations: ../redis_batch.hpp), which need the whole
// redis_client (routing, connections, redirects). Included by redis_client.hpp.

#include <kvtier/l2/redis/detail/redis_batch.hpp>
#include <kvtier/l2/redis/detail/redis_client.hpp>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/cancellation_type.hpp>
#include <boost/asio/error.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <hiredis.h>

#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace l2 {
namespace detail {

inline redis_batch::redis_batch(redis_client& c, deadline d) : client_(c), deadline_(d), wake_(c.strand()) {}

inline redis_batch::item& redis_batch::add(command c, std::string key) {
  auto& it = items_.emplace_back();
  it.cmd = c;
  if (!key.empty()) it.slot = redis_key_slot(key);
  it.key = std::move(key);
  return it;
}

inline boost::asio::awaitable<error_code> redis_batch::run() {
  namespace asio = boost::asio;
  remaining_ = items_.size();
  if (remaining_ == 0) co_return error_code{};
  if (clock::now() >= deadline_) {
    for (auto& it : items_) it.timed_out = true;
    co_return make_error_code(errc::timeout);
  }
  if (const asio::cancellation_state cs = co_await asio::this_coro::cancellation_state;
      cs.cancelled() != asio::cancellation_type::none) {
    for (auto& it : items_) it.timed_out = true;  // cancelled before anything was sent
    co_return asio::error::operation_aborted;
  }
  for (std::size_t i = 0; i < items_.size(); ++i)
    issue(i, items_[i].fixed != nullptr ? items_[i].fixed : client_.route(items_[i].slot), false);
  wake_.expires_at(deadline_);
  while (remaining_ > 0) {
    auto [ec] = co_await wake_.async_wait(asio::as_tuple(asio::use_awaitable));
    if (remaining_ == 0) break;
    if (!ec) {  // the deadline
      abandon_all();
      co_return make_error_code(errc::timeout);
    }
    const auto cs = co_await asio::this_coro::cancellation_state;
    if (cs.cancelled() != asio::cancellation_type::none) {
      abandon_all();
      co_return asio::error::operation_aborted;
    }
  }
  co_return error_code{};
}

inline void redis_batch::issue(std::size_t i, redis_node* n, bool asking) {
  item& it = items_[i];
  std::shared_ptr<redis_link> link = n != nullptr ? client_.pick_link(*n) : nullptr;
  if (!link) {
    redis_reply_event e;
    e.st = redis_reply_event::status::failed;
    e.text = n == nullptr ? std::string("no Redis node")
                          : "not connected to " + n->name + (n->last_error.empty() ? "" : " (" + n->last_error + ")");
    finish(i, std::move(e));
    return;
  }
  auto r = std::make_unique<redis_request>();
  if (asking) {
    redis_format_append(r->head, {"ASKING"});
    r->asking = true;
  }
  switch (it.cmd) {
    case command::exists:
      redis_format_append(r->head, {"EXISTS", it.key});
      break;
    case command::del:
      redis_format_append(r->head, {"DEL", it.key});
      break;
    case command::get:
      redis_format_append(r->head, {"GET", it.key});
      r->kind = redis_reply_kind::object;
      r->reply_bytes = object_header_bytes + it.dst.size();
      r->dst = it.dst;
      r->expect = it.expect;
      break;
    case command::set: {
      auto f = redis_set_frame(it.key, object_header_bytes + it.payload.size(), client_.options().ttl_seconds);
      r->head += f.head;
      r->object_header = it.header;
      r->has_object_header = true;
      r->payload = it.payload;
      r->tail = std::move(f.tail);
      break;
    }
    case command::raw: {
      std::vector<const char*> argv;
      std::vector<std::size_t> lens;
      for (const auto& a : it.args) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      char* cmd = nullptr;
      const int len = redisFormatCommandArgv(&cmd, static_cast<int>(argv.size()), argv.data(), lens.data());
      if (len < 0 || cmd == nullptr) throw std::bad_alloc();
      r->head.append(cmd, static_cast<std::size_t>(len));
      redisFreeCommand(cmd);
      break;
    }
  }
  r->sink = this;
  r->tag = i;
  it.link = link;
  it.req = link->submit(std::move(r));
}

inline void redis_batch::on_reply(std::size_t tag, redis_reply_event&& e) {
  item& it = items_[tag];
  const std::shared_ptr<redis_link> from = std::move(it.link);
  it.req = nullptr;
  if (e.st == redis_reply_event::status::error && it.fixed == nullptr) {
    if (auto rd = redis_parse_redirect(e.text); rd && it.redirects < client_.options().max_redirects) {
      ++it.redirects;
      if (rd->to.host.empty() && from) rd->to.host = from->endpoint().host;
      redis_node* to = client_.node_for(rd->to);
      client_.on_redirect(*rd, to);
      issue(tag, to, rd->ask);
      return;
    }
  }
  finish(tag, std::move(e));
}

inline void redis_batch::finish(std::size_t i, redis_reply_event&& e) {
  item& it = items_[i];
  if (it.done) return;
  it.done = true;
  it.result = std::move(e);
  // The key listener hears of a change as its reply arrives (replies of one connection come
  // in the order Redis applied the commands), not when the whole batch is over.
  if (it.tell && it.result.st == redis_reply_event::status::reply && it.result.reply) {
    const redisReply& r = *it.result.reply;
    if (it.cmd == command::set && r.type == REDIS_REPLY_STATUS)
      client_.tell(key_change::stored, {}, it.expect);
    else if (it.cmd == command::del && r.type == REDIS_REPLY_INTEGER && r.integer > 0)
      client_.tell(key_change::removed, it.removal, it.expect);
  }
  if (--remaining_ == 0) wake_.cancel();
}

inline void redis_batch::abandon_all() {
  // Detach every outstanding request first, so that a connection closed by one abandon()
  // does not report our other requests back to us.
  std::vector<std::pair<std::shared_ptr<redis_link>, redis_request*>> out;
  for (auto& it : items_) {
    if (it.done) continue;
    it.done = true;
    it.timed_out = true;
    if (it.req != nullptr) {
      it.req->sink = nullptr;
      out.emplace_back(std::move(it.link), it.req);
      it.req = nullptr;
    }
  }
  remaining_ = 0;
  for (auto& [link, req] : out) link->abandon(req);
}

}  // namespace detail
}  // namespace l2
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

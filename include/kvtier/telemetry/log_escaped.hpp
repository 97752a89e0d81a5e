#pragma once
// log_escaped: the completion handler of a coroutine that is spawned and not awaited
// (boost::asio::co_spawn(ex, f(), log_escaped{log, "what"})). An exception escaping such a
// coroutine is a bug (each catches what it expects); asio::detached drops it without a trace,
// this writes it to the log at error level. docs/architecture.md, "Exceptions".

#include <kvtier/config.hpp>
#include <kvtier/telemetry/logger.hpp>

#include <exception>

namespace kvtier {
inline namespace KVTIER_ABI_TAG {
namespace telemetry {

struct log_escaped {
  logger* log;       ///< must outlive the coroutine
  const char* what;  ///< names the coroutine in the line, e.g. "session reader"

  void operator()(std::exception_ptr e) const noexcept {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      log->error("{}: ended by an exception it did not catch (a bug): {}", what, x.what());
    } catch (...) {
      log->error("{}: ended by an exception it did not catch (a bug), not a std::exception", what);
    }
  }
};

}  // namespace telemetry
}  // namespace KVTIER_ABI_TAG
}  // namespace kvtier

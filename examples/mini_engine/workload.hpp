#pragma once
// Built-in workloads of the mini engine: documents of L tokens, each with a distinct first
// token so no document is a prefix of another, sent in rounds.

#include "engine.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace mini_engine {

/// `documents` documents of `tokens` tokens; document d's tokens are a deterministic stream
/// that starts with 1'000'000 + d (the distinct first token) and seed `seed`.
inline std::vector<std::vector<kvtier::token_id>> make_documents(std::size_t documents, std::size_t tokens,
                                                                 std::uint64_t seed = 42) {
  std::vector<std::vector<kvtier::token_id>> docs(documents);
  for (std::size_t d = 0; d < documents; ++d) {
    auto& doc = docs[d];
    doc.reserve(tokens);
    doc.push_back(static_cast<kvtier::token_id>(1'000'000 + d));
    std::uint64_t x = seed ^ (d * 0x9e3779b97f4a7c15ULL);
    while (doc.size() < tokens) doc.push_back(static_cast<kvtier::token_id>(splitmix64(x) % 150'000));
  }
  return docs;
}

/// One request per document, ids "<prefix>-<d>", all arriving at once (or spaced by
/// `spacing_s`).
inline std::vector<request_spec> round_of(const std::vector<std::vector<kvtier::token_id>>& docs,
                                          const std::string& prefix, std::uint32_t output_tokens = 1,
                                          double spacing_s = 0) {
  std::vector<request_spec> out;
  for (std::size_t d = 0; d < docs.size(); ++d)
    out.push_back({prefix + "-" + std::to_string(d), docs[d], output_tokens, spacing_s * static_cast<double>(d)});
  return out;
}

}  // namespace mini_engine

// kvtier_mini_engine: a stand-in inference engine using the kvtier connector.
//
//   kvtier_mini_engine [--socket PATH] --documents 20 --tokens 10000 --rounds 2
//   (the socket defaults to the server's default, protocol::default_socket_path())
//   kvtier_mini_engine --no-connector ...      (the baseline without any cache)
//
// Sends every document once per round (the second round should hit the cache), verifies
// every retrieved block and every output, and prints a JSON report (stdout or --json FILE).
// Exit status: 0 when every request completed with correct output, 1 otherwise, 2 on bad
// arguments.
#include "engine.hpp"
#include "workload.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"kvtier mini engine: continuous batching over a paged KV cache, through the kvtier connector"};
  mini_engine::engine_config cfg;
  std::size_t documents = 20, tokens = 10'000, rounds = 2;
  std::uint32_t output_tokens = 1;
  bool no_connector = false;
  std::string json_path;
  std::string socket = kvtier::protocol::default_socket_path();
  std::optional<std::uint32_t> server_uid;
  app.add_option("--socket", socket, "The kvtier-server socket")->capture_default_str();
  app.add_option("--server-uid", server_uid,
                 "The uid the server runs as (default: this user's; root is accepted too), checked before connecting");
  app.add_flag("--no-connector", no_connector, "Run without any cache (the baseline)");
  app.add_option("--documents", documents, "Documents per round")->capture_default_str()->check(CLI::Range(1, 100000));
  app.add_option("--tokens", tokens, "Tokens per document")->capture_default_str()->check(CLI::Range(2, 1000000));
  app.add_option("--rounds", rounds, "How many times each document is sent")->capture_default_str()->check(CLI::Range(1, 100));
  app.add_option("--output-tokens", output_tokens, "Output tokens per request")->capture_default_str();
  app.add_option("--world-size", cfg.world_size, "Tensor-parallel ranks (1 or 2)")->capture_default_str()->check(CLI::Range(1, 2));
  app.add_option("--tokens-per-second", cfg.tokens_per_second, "Prefill compute cost (0: free)")->capture_default_str();
  app.add_option("--max-running", cfg.max_running, "Requests running at once")->capture_default_str();
  app.add_option("--num-blocks", cfg.num_blocks, "KV blocks per rank")->capture_default_str();
  app.add_option("--layers", cfg.shape.num_layers, "Model layers")->capture_default_str();
  app.add_option("--kv-heads", cfg.shape.num_kv_heads, "KV heads (all ranks)")->capture_default_str();
  app.add_option("--head-dim", cfg.shape.head_dim, "Head dimension")->capture_default_str();
  app.add_option("--chunk-size", cfg.chunk_tokens, "Tokens per chunk (must match the server)")->capture_default_str();
  app.add_option("--model", cfg.model_name, "Model name (cache namespace)")->capture_default_str();
  app.add_option("--json", json_path, "Write the JSON report here instead of stdout");
  CLI11_PARSE(app, argc, argv);
  if (!no_connector) cfg.socket_path = socket;
  cfg.server_uid = server_uid;

  try {
    mini_engine::engine eng(cfg);
    const auto docs = mini_engine::make_documents(documents, tokens);
    nlohmann::json report = {{"rounds", nlohmann::json::array()}};
    bool ok = true;
    for (std::size_t r = 0; r < rounds; ++r) {
      auto rep = eng.run(mini_engine::round_of(docs, "r" + std::to_string(r), output_tokens));
      ok = ok && rep.all_ok(documents);
      double ttft_sum = 0;
      for (const auto& q : rep.requests) ttft_sum += q.ttft_s;
      const double ttft_mean = rep.requests.empty() ? 0 : ttft_sum / static_cast<double>(rep.requests.size());
      std::fprintf(stderr,
                   "round %zu: %zu/%zu completed in %.2f s, %.0f tokens/s, mean TTFT %.3f s, %zu of %zu tokens from "
                   "cache, wrong outputs %zu, corrupt rows %zu, duplicate finished %zu\n",
                   r, rep.completed, documents, rep.duration_s, rep.throughput_tokens_per_s(), ttft_mean,
                   rep.tokens_from_cache, rep.tokens_total, rep.wrong_outputs, rep.corrupt_rows,
                   rep.duplicate_finished);
      report["rounds"].push_back(rep.to_json());
    }
    report["ok"] = ok;
    if (json_path.empty()) std::cout << report.dump(2) << "\n";
    else std::ofstream(json_path) << report.dump(2) << "\n";
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvtier_mini_engine: %s\n", e.what());
    return 2;
  }
}

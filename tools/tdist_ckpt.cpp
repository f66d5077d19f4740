// tdist-ckpt: the checkpoint tools over a sharded checkpoint's per-rank
// files ({prefix}_rank-{r}-of-{w}.pt).
//
//   tdist-ckpt consolidate --ckpt-prefix P [--ckpt-suffix "_rank-*-of-*.pt"]
//                          [--save-path F] [--format pt|safetensors|libtorch] [--optimizer]
//   tdist-ckpt reshard     --ckpt-prefix P [--ckpt-suffix S] --world-size M [--out-prefix Q]
//   tdist-ckpt inspect     --ckpt-prefix P [--ckpt-suffix S] [--json]
//
// The options also take torch_xla's spellings (--ckpt_prefix, ...). The
// tools stream a few MiB at a time, and tdist-ckpt does not load LibTorch
// (c10 only): its memory is what it moves. --format libtorch needs
// LibTorch's serializer and holds the model whole; tdist-ckpt hands that to
// tdist-ckpt-libtorch (this program built with libtdist), installed beside
// it. A damaged or incomplete checkpoint is an error naming the file and
// what is wrong (exit 1); a bad command line exits 2.
//
// TDIST_CKPT_PEAK_RSS_FILE=F: at exit, writes the process's peak resident
// memory (VmHWM, kB) to F. tdist-bench reads it: the rusage a parent gets
// for a child it forked counts the parent's own pages, copied at the fork.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/tools.h"
#include "tdist/checkpoint_tools.h"
#include "util/cli.h"
#if TDIST_CKPT_WITH_LIBTORCH
#include "tdist/sharded_checkpoint.h"
#endif

namespace {

using tdist::cli::both_spellings;

// TDIST_CKPT_PEAK_RSS_FILE: this process's VmHWM, in kB, into that file.
void report_peak_rss() {
  const char* path = std::getenv("TDIST_CKPT_PEAK_RSS_FILE");
  if (!path || !*path) return;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) std::ofstream(path) << std::stoll(line.substr(6)) << "\n";
  }
}

#if !TDIST_CKPT_WITH_LIBTORCH
// Runs tdist-ckpt-libtorch (next to this program) with the same arguments.
[[noreturn]] void run_with_libtorch(char** argv) {
  const std::string exe =
      (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "tdist-ckpt-libtorch").string();
  argv[0] = const_cast<char*>(exe.c_str());
  execv(exe.c_str(), argv);
  std::fprintf(stderr, "tdist-ckpt: error: --format libtorch needs %s (%s)\n", exe.c_str(), std::strerror(errno));
  std::exit(1);
}
#endif

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void print_info(const tdist::ShardedCheckpointInfo& info, bool json) {
  const auto rows = [](const std::vector<tdist::CheckpointTensorInfo>& ts) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& t : ts) {
      out.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", c10::toString(t.dtype)},
                     {"bytes", t.bytes}, {"sharded", t.sharded}});
    }
    return out;
  };
  if (json) {
    std::printf("%s\n", nlohmann::json{{"world_size", info.world_size}, {"files", info.files}, {"units", info.units},
                                       {"model", rows(info.model)}, {"optimizer", info.optimizer},
                                       {"optimizer_state", rows(info.optimizer_state)}}
                            .dump(2)
                            .c_str());
    return;
  }
  std::printf("world size %d, %zu files, %zu FSDP units\n", info.world_size, info.files.size(), info.units.size());
  for (const auto& u : info.units) std::printf("  unit '%s'\n", u.c_str());
  const auto table = [](const char* title, const std::vector<tdist::CheckpointTensorInfo>& ts) {
    int64_t total = 0;
    std::printf("%s\n  %-48s %-20s %-9s %12s  %s\n", title, "name", "shape", "dtype", "bytes", "sharded");
    for (const auto& t : ts) {
      std::printf("  %-48s %-20s %-9s %12lld  %s\n", t.name.c_str(), shape_text(t.shape).c_str(),
                  c10::toString(t.dtype), static_cast<long long>(t.bytes), t.sharded ? "yes" : "no");
      total += t.bytes;
    }
    std::printf("  %zu tensors, %lld bytes\n", ts.size(), static_cast<long long>(total));
  };
  table("model", info.model);
  if (!info.optimizer.empty()) table(("optimizer (" + info.optimizer + ")").c_str(), info.optimizer_state);
}

}  // namespace

int main(int argc, char** argv) {
  std::atexit(report_peak_rss);
  CLI::App app{"tdist-ckpt: consolidate, reshard or inspect a sharded checkpoint", "tdist-ckpt"};
  app.require_subcommand(1);
  std::string prefix, suffix = "_rank-*-of-*.pt", save_path, format = "pt", out_prefix;
  bool optimizer = false, json = false;
  int world = 0;
  const auto common = [&](CLI::App* sub) {
    sub->add_option(both_spellings("ckpt-prefix"), prefix, "the files' path up to the suffix")->required();
    sub->add_option(both_spellings("ckpt-suffix"), suffix,
                    "the per-rank part: first '*' the rank, second the world size")
        ->capture_default_str();
  };
  CLI::App* consolidate = app.add_subcommand("consolidate", "merge the ranks' files into one full state dict");
  common(consolidate);
  consolidate->add_option(both_spellings("save-path"), save_path, "output file (default: PREFIX_consolidated.*)");
  consolidate->add_option("--format", format, "pt, safetensors or libtorch")
      ->check(CLI::IsMember({"pt", "safetensors", "libtorch"}))
      ->capture_default_str();
  consolidate->add_flag("--optimizer", optimizer, "also the full optimizer state, by parameter name");
  CLI::App* reshard = app.add_subcommand("reshard", "write the checkpoint again for another world size");
  common(reshard);
  reshard->add_option(both_spellings("world-size"), world, "the new world size")->required()->check(CLI::PositiveNumber);
  reshard->add_option(both_spellings("out-prefix"), out_prefix, "the new files' prefix (default: PREFIX_world-M)");
  CLI::App* inspect = app.add_subcommand("inspect", "print units, names, shapes, dtypes, bytes, world size");
  common(inspect);
  inspect->add_flag("--json", json, "as JSON");
  tdist::cli::parse_or_exit(app, argc, argv);
  try {
    if (consolidate->parsed()) {
      tdist::ConsolidateOptions o;
      o.optimizer = optimizer;
      o.format = format == "safetensors" ? tdist::CheckpointFormat::safetensors
                 : format == "libtorch"  ? tdist::CheckpointFormat::libtorch
                                         : tdist::CheckpointFormat::pt;
#if TDIST_CKPT_WITH_LIBTORCH
      const std::string path = tdist::consolidate_sharded_model_checkpoints(prefix, suffix, save_path, o);
#else
      if (o.format == tdist::CheckpointFormat::libtorch) run_with_libtorch(argv);
      const std::string path = tdist::checkpoint::consolidate_streaming(prefix, suffix, save_path, o);
#endif
      std::printf("wrote %s\n", path.c_str());
    } else if (reshard->parsed()) {
      if (out_prefix.empty()) out_prefix = prefix + "_world-" + std::to_string(world);
      tdist::reshard_sharded_checkpoint(prefix, suffix, world, out_prefix);
      std::printf("wrote %d files %s%s\n", world, out_prefix.c_str(), suffix.c_str());
    } else {
      print_info(tdist::inspect_sharded_checkpoint(prefix, suffix), json);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-ckpt: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// tdist-ckpt: the checkpoint tools over a sharded checkpoint's per-rank
// files ({prefix}_rank-{r}-of-{w}.pt).
//
//   tdist-ckpt consolidate --ckpt-prefix P [--ckpt-suffix "_rank-*-of-*.pt"]
//                          [--save-path F] [--format pt|safetensors|libtorch] [--optimizer]
//   tdist-ckpt reshard     --ckpt-prefix P [--ckpt-suffix S] --world-size M [--out-prefix Q]
//   tdist-ckpt inspect     (P | DIR | --ckpt-prefix P) [--ckpt-suffix S] [--json]
//
// inspect also takes a Checkpointer's directory (checkpointer.h): its root,
// where the `latest` marker names the newest checkpoint, or a step folder;
// it then inspects that folder's model files and says which.
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
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/tools.h"
#include "tdist/checkpoint_tools.h"
#include "tdist/errors.h"
#include "util/cli.h"
#include "util/open_file.h"
#if TDIST_CKPT_WITH_LIBTORCH
#include "tdist/sharded_checkpoint.h"
#endif

namespace {

using tdist::cli::both_spellings;

// TDIST_CKPT_PEAK_RSS_FILE: this process's VmHWM, in kB, into that file
// (a regular file, not through a link: never a FIFO or device that blocks).
void report_peak_rss() {
  const char* path = std::getenv("TDIST_CKPT_PEAK_RSS_FILE");
  if (!path || !*path) return;
  std::string status, error;
  if (!tdist::detail::read_regular_file("/proc/self/status", 1 << 16, status, error)) return;
  const size_t at = status.find("VmHWM:");
  if (at == std::string::npos) return;
  const std::string line = std::to_string(std::strtoll(status.c_str() + at + 6, nullptr, 10)) + "\n";
  const int fd = tdist::detail::open_regular(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, error, 0644);
  if (fd < 0) {
    std::fprintf(stderr, "tdist-ckpt: TDIST_CKPT_PEAK_RSS_FILE %s\n", error.c_str());
    return;
  }
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    std::fprintf(stderr, "tdist-ckpt: cannot write TDIST_CKPT_PEAK_RSS_FILE %s\n", path);
  }
  ::close(fd);
}

// JSON's escaping of a string (control characters as \u00XX, invalid
// UTF-8 replaced), and also of C1 controls (U+0080..U+009F, which some
// terminals obey): names and paths read from files reach the terminal as
// text, never as escape sequences.
std::string escaped(const std::string& s, bool quoted = false) {
  const std::string j = nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  for (size_t i = 1; i + 1 < j.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(j[i]);
    const unsigned char next = i + 2 < j.size() ? static_cast<unsigned char>(j[i + 1]) : 0;
    if (c == 0xc2 && next >= 0x80 && next <= 0x9f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", next);
      out += buf;
      ++i;
    } else {
      out += static_cast<char>(c);
    }
  }
  return quoted ? "\"" + out + "\"" : out;
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

void print_info(const tdist::ShardedCheckpointInfo& info, const tdist::checkpoint::InspectTarget& target,
                bool json) {
  const auto rows = [](const std::vector<tdist::CheckpointTensorInfo>& ts) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& t : ts) {
      out.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", c10::toString(t.dtype)},
                     {"bytes", t.bytes}, {"sharded", t.sharded}});
    }
    return out;
  };
  if (json) {
    nlohmann::json out{{"ckpt_prefix", target.prefix},
                       {"world_size", info.world_size}, {"files", info.files}, {"units", info.units},
                       {"model", rows(info.model)}, {"optimizer", info.optimizer},
                       {"optimizer_state", rows(info.optimizer_state)},
                       {"other_records", info.other_records}};
    if (!target.from.empty()) out["found_as"] = target.from;
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return;
  }
  if (!target.from.empty()) {
    std::printf("checkpoint %s (%s)\n", escaped(target.prefix).c_str(), escaped(target.from).c_str());
  }
  std::printf("world size %d, %zu files, %zu FSDP units\n", info.world_size, info.files.size(), info.units.size());
  for (const auto& u : info.units) std::printf("  unit %s\n", escaped(u, true).c_str());
  const auto table = [](const std::string& title, const std::vector<tdist::CheckpointTensorInfo>& ts) {
    int64_t total = 0;
    std::printf("%s\n  %-48s %-20s %-9s %12s  %s\n", title.c_str(), "name", "shape", "dtype", "bytes", "sharded");
    for (const auto& t : ts) {
      std::printf("  %-48s %-20s %-9s %12lld  %s\n", escaped(t.name).c_str(), shape_text(t.shape).c_str(),
                  c10::toString(t.dtype), static_cast<long long>(t.bytes), t.sharded ? "yes" : "no");
      total += t.bytes;
    }
    std::printf("  %zu tensors, %lld bytes\n", ts.size(), static_cast<long long>(total));
  };
  table("model", info.model);
  if (!info.optimizer.empty()) table("optimizer (" + escaped(info.optimizer) + ")", info.optimizer_state);
  if (!info.other_records.empty()) {
    std::printf("other records (not part of the model or optimizer state):\n");
    for (const auto& r : info.other_records) std::printf("  %s\n", escaped(r).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::atexit(report_peak_rss);
  CLI::App app{"tdist-ckpt: consolidate, reshard or inspect a sharded checkpoint", "tdist-ckpt"};
  app.require_subcommand(1);
  std::string prefix, suffix = "_rank-*-of-*.pt", save_path, format = "pt", out_prefix;
  bool optimizer = false, json = false;
  int world = 0;
  const auto common = [&](CLI::App* sub, bool required = true) {
    auto* o = sub->add_option(both_spellings("ckpt-prefix"), prefix, "the files' path up to the suffix");
    if (required) o->required();
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
  reshard->add_option(both_spellings("world-size"), world, "the new world size")
      ->required()
      ->check(tdist::cli::in_range(1, 65536));
  reshard->add_option(both_spellings("out-prefix"), out_prefix, "the new files' prefix (default: PREFIX_world-M)");
  CLI::App* inspect = app.add_subcommand("inspect", "print units, names, shapes, dtypes, bytes, world size");
  common(inspect, /*required=*/false);
  std::string inspect_path;
  inspect->add_option("path", inspect_path,
                      "what --ckpt-prefix takes, or a Checkpointer's directory: its root (the checkpoint its "
                      "'latest' marker names first) or one of its step folders")
      ->type_name("PREFIX|DIR");
  inspect->add_flag("--json", json, "as JSON");
  tdist::cli::parse_or_exit(app, argc, argv);
  if (inspect->parsed()) {
    if (!inspect_path.empty() && !prefix.empty()) {
      tdist::cli::usage_error("tdist-ckpt", "inspect takes a PATH or --ckpt-prefix, not both");
    }
    if (inspect_path.empty() && prefix.empty()) {
      tdist::cli::usage_error("tdist-ckpt", "inspect needs what to read: --ckpt-prefix PREFIX, or PREFIX|DIR");
    }
    if (prefix.empty()) prefix = inspect_path;
  }
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
      std::printf("wrote %s\n", escaped(path).c_str());
    } else if (reshard->parsed()) {
      if (out_prefix.empty()) out_prefix = prefix + "_world-" + std::to_string(world);
      tdist::reshard_sharded_checkpoint(prefix, suffix, world, out_prefix);
      std::printf("wrote %d files %s\n", world, escaped(out_prefix + suffix).c_str());
    } else {
      const auto target = tdist::checkpoint::resolve_inspect_target(prefix, suffix);
      print_info(tdist::inspect_sharded_checkpoint(target.prefix, suffix), target, json);
    }
  } catch (const tdist::UsageError& e) {  // the command line asked for something it cannot have
    tdist::cli::usage_error("tdist-ckpt", "error: " + escaped(e.what()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tdist-ckpt: error: %s\n", escaped(e.what()).c_str());
    return 1;
  }
  return 0;
}

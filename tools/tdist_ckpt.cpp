// tdist-ckpt: the checkpoint tools over a sharded checkpoint's per-rank
// files ({prefix}_rank-{r}-of-{w}.pt).
//
//   tdist-ckpt consolidate --ckpt-prefix P [--ckpt-suffix "_rank-*-of-*.pt"]
//                          [--save-path F] [--format pt|safetensors|libtorch] [--optimizer]
//   tdist-ckpt reshard     --ckpt-prefix P [--ckpt-suffix S] --world-size M [--out-prefix Q]
//   tdist-ckpt inspect     (P | DIR | --ckpt-prefix P) [--ckpt-suffix S] [--json]
//   tdist-ckpt convert     --from FMT:PATH --to FMT:PATH [--optimizer] [--max-shard-size BYTES]
//                          (FMT: dcp, tdist, pt, safetensors; src/checkpoint/convert.h)
//
// inspect also reads PyTorch's DCP folders (.metadata and __R_N.distcp):
// every key, its shape, dtype, bytes and chunks, as the folder's
// classification into model, optimizer and other sees it.
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
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/convert.h"
#include "checkpoint/dcp_layout.h"
#include "formats/dcp_metadata.h"
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

// A DCP folder: its keys as dcp_layout.h classifies them.
void print_dcp(const std::string& dir, bool json) {
  namespace dcp = tdist::checkpoint::dcp;
  const dcp::Metadata m = dcp::read_metadata(dir);
  const dcp::Layout l = dcp::classify(m);
  const auto bytes = [](const dcp::Item& it) {
    int64_t n = it.tensor ? static_cast<int64_t>(c10::elementSize(it.dtype)) : static_cast<int64_t>(it.bytes.length);
    if (it.tensor) {
      for (int64_t s : it.size) n *= s;
    }
    return n;
  };
  const auto row = [&](const std::string& name, const dcp::Item& it) {
    return nlohmann::json{{"name", name}, {"key", it.fqn}, {"tensor", it.tensor},
                          {"shape", it.tensor ? nlohmann::json(it.size) : nlohmann::json()},
                          {"dtype", it.tensor ? c10::toString(it.dtype) : "bytes"}, {"bytes", bytes(it)},
                          {"chunks", it.chunks.size()}};
  };
  nlohmann::json model = nlohmann::json::array(), optim = nlohmann::json::array(), other = nlohmann::json::array();
  for (const auto& [name, it] : l.model) model.push_back(row(name, *it));
  for (const auto& e : l.optimizer) optim.push_back(row(e.param + "/" + e.field, *e.item));
  for (size_t g = 0; g < l.param_groups.size(); ++g) {
    for (const auto& [k, it] : l.param_groups[g].options) optim.push_back(row("param_groups[" + std::to_string(g) + "]." + k, *it));
  }
  for (const auto* it : l.other) other.push_back(row(it->fqn, *it));
  std::set<std::string> files;
  for (const auto& it : m.items) {
    if (!it.tensor) files.insert(it.bytes.file);
    for (const auto& c : it.chunks) files.insert(c.storage.file);
  }
  if (json) {
    const nlohmann::json out{{"dcp", dir}, {"version", m.version}, {"files", files}, {"model", model},
                             {"optimizer", optim}, {"other", other}};
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return;
  }
  std::printf("DCP checkpoint %s (version %s), %zu data files, %zu keys\n", escaped(dir).c_str(),
              m.version.empty() ? "unknown" : escaped(m.version).c_str(), files.size(), m.items.size());
  const auto table = [](const char* title, const nlohmann::json& rows) {
    if (rows.empty()) return;
    int64_t total = 0;
    std::printf("%s\n  %-52s %-20s %-9s %12s  %s\n", title, "name", "shape", "dtype", "bytes", "chunks");
    for (const auto& r : rows) {
      const std::string shape = r["tensor"].get<bool>() ? shape_text(r["shape"].get<std::vector<int64_t>>()) : "-";
      std::printf("  %-52s %-20s %-9s %12lld  %zu\n", escaped(r["name"].get<std::string>()).c_str(), shape.c_str(),
                  r["dtype"].get<std::string>().c_str(), static_cast<long long>(r["bytes"].get<int64_t>()),
                  r["chunks"].get<size_t>());
      total += r["bytes"].get<int64_t>();
    }
    std::printf("  %zu keys, %lld bytes\n", rows.size(), static_cast<long long>(total));
  };
  table(("model" + std::string(l.model_root.empty() ? " (keys at the top)" : " (under \"model\")")).c_str(), model);
  table("optimizer", optim);
  table("other (not part of the model or optimizer state)", other);
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
  CLI::App* convert = app.add_subcommand("convert", "move a checkpoint between dcp, tdist, pt and safetensors");
  std::string from, to;
  int64_t max_shard = tdist::checkpoint::ConvertOptions{}.max_shard_size;
  convert->add_option("--from", from, "FMT:PATH to read (FMT: dcp, tdist, pt, safetensors)")->required();
  convert->add_option("--to", to, "FMT:PATH to write (FMT: dcp, tdist, pt, safetensors; a safetensors PATH ending in '/' "
                                  "is a folder of Hugging Face shards)")->required();
  convert->add_flag("--optimizer", optimizer, "also the optimizer state");
  convert->add_option("--max-shard-size", max_shard, "bytes per Hugging Face shard")
      ->check(CLI::Range(int64_t{1}, INT64_MAX))
      ->capture_default_str();
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
    if (convert->parsed()) {
      tdist::checkpoint::ConvertOptions o;
      o.optimizer = optimizer;
      o.max_shard_size = max_shard;
      std::printf("wrote %s\n", escaped(tdist::checkpoint::convert_checkpoint(from, to, o)).c_str());
    } else if (inspect->parsed() && tdist::checkpoint::dcp::is_dcp_folder(prefix)) {
      print_dcp(prefix, json);
    } else if (consolidate->parsed()) {
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

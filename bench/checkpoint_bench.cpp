// tdist-bench checkpoint: sharded checkpoints of an FSDP model with Adam
// (parameters + both moments: --size-mib of fp32 state) at --world-size
// ranks: the per-rank save and load, then `tdist-ckpt consolidate
// --optimizer` and `tdist-ckpt reshard` (their own processes, whose peak
// RSS they report), each next to a plain sequential copy of the same
// bytes on the same disk in the same run (read, write, fsync, 4 MiB at a
// time). The table shows each operation's time, its throughput as a
// fraction of the copy's, and the peak memory of the tools against the
// largest tensor.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cerrno>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "bench/bench_common.h"
#include "tdist/tdist.h"
#include "util/cli.h"

namespace tdist::bench {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The model: `layers` square Linear layers, each its own FSDP unit, sized
// so that parameters + Adam's two moments make `size_mib`.
int64_t width_for(const CheckpointBenchOptions& o) {
  const double floats = o.size_mib * 1024.0 * 1024.0 / 4 / 3 / o.layers;
  return static_cast<int64_t>(std::sqrt(floats));
}

torch::nn::Sequential layers(const CheckpointBenchOptions& o, const FullyShardedDataParallelOptions& f) {
  torch::nn::Sequential seq;
  const int64_t w = width_for(o);
  for (int i = 0; i < o.layers; ++i) seq->push_back(FSDP<torch::nn::Linear>(torch::nn::Linear(w, w), f));
  return seq;
}

int run_rank(const CheckpointBenchOptions& o) {
  at::set_num_threads(1);
  auto pg = init_process_group({});
  FullyShardedDataParallelOptions f;
  torch::manual_seed(0);
  FSDP<torch::nn::Sequential> model(layers(o, f), f);
  torch::optim::Adam opt(model->parameters(), 1e-3);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::ones_like(p);
  opt.step();  // the moments exist
  const std::string prefix = o.run_dir + "/bench";
  std::vector<double> saves, loads;
  for (int i = 0; i < o.repeats; ++i) {
    ::sync();  // every operation starts with the disk idle (no earlier writeback in flight)
    pg->barrier()->wait();
    auto t = Clock::now();
    save_sharded_checkpoint(prefix, *pg, *model, &opt);
    saves.push_back(seconds_since(t));
    ::sync();
    pg->barrier()->wait();
    t = Clock::now();
    load_sharded_checkpoint(prefix, *pg, *model, &opt);
    pg->barrier()->wait();
    loads.push_back(seconds_since(t));
  }
  const double save_s = percentile(saves, 50), load_s = percentile(loads, 50);
  if (pg->rank() == 0) {
    std::ofstream(o.result) << nlohmann::json{{"save_s", save_s}, {"load_s", load_s}}.dump();
  }
  return 0;
}

// A plain sequential copy of `from` files (concatenated) into `to`, fsynced.
double copy_seconds(const std::vector<std::string>& from, const std::string& to) {
  std::vector<char> buf(4 << 20);
  const auto t = Clock::now();
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0) throw std::runtime_error("cannot create " + to);
  for (const auto& path : from) {
    const int in = ::open(path.c_str(), O_RDONLY);
    if (in < 0) throw std::runtime_error("cannot open " + path);
    ssize_t n;
    while ((n = ::read(in, buf.data(), buf.size())) > 0) {
      if (::write(out, buf.data(), static_cast<size_t>(n)) != n) throw std::runtime_error("write failed: " + to);
    }
    ::close(in);
  }
  ::fsync(out);
  ::close(out);
  return seconds_since(t);
}

struct ToolRun {
  double seconds = 0;
  int64_t peak_rss = 0;  // bytes
};

// Runs tdist-ckpt (next to this program) with args; its time and peak RSS
// (which it reports itself: the rusage of a child forked from this process
// would count this process's pages, copied at the fork).
// `dir` is the run's own directory (made by mkdtemp), where the peak file
// goes: never a name in /tmp that another user could plant first.
ToolRun run_tool(const std::vector<std::string>& args, const std::string& dir) {
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").parent_path().string() + "/tdist-ckpt";
  const std::string peak_file = dir + "/peak-rss";
  ::setenv("TDIST_CKPT_PEAK_RSS_FILE", peak_file.c_str(), 1);
  const auto t = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<std::string> a = {exe};
    a.insert(a.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    const int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    execv(exe.c_str(), argv.data());
    _exit(127);
  }
  // The tools stream with no waits of their own; ten minutes means stuck.
  const auto deadline = Clock::now() + std::chrono::minutes(10);
  int status = 0;
  rusage ru{};
  for (;;) {
    const pid_t done = wait4(pid, &status, WNOHANG, &ru);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) throw std::runtime_error("wait4 for tdist-ckpt failed");
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      wait4(pid, &status, 0, &ru);
      throw std::runtime_error("tdist-ckpt " + args[0] + " ran past 10 minutes: killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("tdist-ckpt " + args[0] + " failed");
  const double seconds = seconds_since(t);
  int64_t peak_kb = -1;
  std::ifstream(peak_file) >> peak_kb;
  std::filesystem::remove(peak_file);
  if (peak_kb < 0) throw std::runtime_error("tdist-ckpt " + args[0] + " reported no peak memory");
  return {seconds, peak_kb * 1024};
}

int64_t bytes_of(const std::vector<std::string>& paths) {
  int64_t n = 0;
  for (const auto& p : paths) n += static_cast<int64_t>(std::filesystem::file_size(p));
  return n;
}

int run_parent(const CheckpointBenchOptions& o, const std::vector<std::string>& args) {
  // A fresh directory of this user's (mkdtemp: 0700, never one that exists).
  std::string templ = o.dir + "/tdist-bench-ckpt-XXXXXX";
  if (!::mkdtemp(templ.data())) {
    throw std::runtime_error("cannot make a directory in --dir " + o.dir + ": " + std::strerror(errno));
  }
  const std::string dir = templ;
  const std::string result = dir + "/result.json";
  if (spawn_ranks("checkpoint", o.world_size, args, {"--run-dir", dir, "--result", result}) != 0) return 1;
  const auto ranks = nlohmann::json::parse(std::ifstream(result));
  const std::string prefix = dir + "/bench";
  std::vector<std::string> files;
  for (int r = 0; r < o.world_size; ++r) files.push_back(prefix + "_rank-" + std::to_string(r) + "-of-" +
                                                        std::to_string(o.world_size) + ".pt");
  const int64_t bytes = bytes_of(files);
  // Each operation o.repeats times, taking turns; the median time, the
  // largest peak.
  const int to = o.world_size + 1;
  std::vector<double> copies, cons_s, resh_s;
  ToolRun cons, resh;
  int64_t cons_bytes = 0;
  for (int i = 0; i < o.repeats; ++i) {
    ::sync();  // as in the ranks: each operation starts with the disk idle
    copies.push_back(copy_seconds(files, dir + "/copy"));
    std::filesystem::remove(dir + "/copy");
    ::sync();
    const ToolRun c = run_tool({"consolidate", "--ckpt-prefix", prefix, "--optimizer", "--save-path", dir + "/full.pt"}, dir);
    cons_s.push_back(c.seconds);
    cons.peak_rss = std::max(cons.peak_rss, c.peak_rss);
    cons_bytes = static_cast<int64_t>(std::filesystem::file_size(dir + "/full.pt"));
    std::filesystem::remove(dir + "/full.pt");
    ::sync();
    const ToolRun r = run_tool({"reshard", "--ckpt-prefix", prefix, "--world-size", std::to_string(to),
                                "--out-prefix", dir + "/re"}, dir);
    resh_s.push_back(r.seconds);
    resh.peak_rss = std::max(resh.peak_rss, r.peak_rss);
  }
  const double copy_s = percentile(copies, 50);
  cons.seconds = percentile(cons_s, 50);
  resh.seconds = percentile(resh_s, 50);
  const ToolRun base = run_tool({"--help"}, dir);  // the process alone, nothing done
  const int64_t w = width_for(o);
  const int64_t largest = w * w * 4;
  const double copy_bps = bytes / copy_s;
  std::printf("checkpoint: FSDP, %d Linear(%lld, %lld) units + Adam = %.1f MiB of fp32 state, world %d, in %s;"
              " medians of %d\n",
              o.layers, static_cast<long long>(w), static_cast<long long>(w), bytes / 1048576.0, o.world_size,
              o.dir.c_str(), o.repeats);
  std::printf("  largest tensor %.1f MiB; tdist-ckpt doing nothing (--help) peaks at %.1f MiB\n\n",
              largest / 1048576.0, base.peak_rss / 1048576.0);
  std::printf("  %-26s %10s %10s %12s %14s\n", "operation", "seconds", "MiB/s", "x copy", "peak RSS MiB");
  JsonRows rows;
  const auto row = [&](const char* name, double s, int64_t moved, int64_t peak) {
    const double bps = moved / s;
    std::printf("  %-26s %10.2f %10.0f %12.2f %14s\n", name, s, bps / 1048576.0, bps / copy_bps,
                peak ? std::to_string(peak / 1048576).c_str() : "-");
    rows.begin_row();
    rows.field("operation", name);
    rows.field("seconds", s);
    rows.field("bytes", static_cast<double>(moved));
    rows.field("mib_per_s", bps / 1048576.0);
    rows.field("vs_copy", bps / copy_bps);
    rows.field("peak_rss_bytes", static_cast<double>(peak));
    rows.field("largest_tensor_bytes", static_cast<double>(largest));
  };
  row("sequential copy", copy_s, bytes, 0);
  row("save (all ranks)", ranks["save_s"].get<double>(), bytes, 0);
  row("load (all ranks)", ranks["load_s"].get<double>(), bytes, 0);
  row("consolidate --optimizer", cons.seconds, cons_bytes, cons.peak_rss);
  row(("reshard to " + std::to_string(to)).c_str(), resh.seconds, bytes, resh.peak_rss);
  std::printf("\n  consolidate: peak RSS %.1f MiB (target: at most the largest tensor + 64 MiB = %.1f MiB)\n",
              cons.peak_rss / 1048576.0, (largest + (int64_t{64} << 20)) / 1048576.0);
  rows.begin_row();
  rows.field("operation", "baseline (tdist-ckpt --help)");
  rows.field("peak_rss_bytes", static_cast<double>(base.peak_rss));
  std::filesystem::remove_all(dir);
  return rows.finish(o.json);
}

}  // namespace

void CheckpointBenchOptions::add_to(CLI::App& mode) {
  using cli::both_spellings;
  mode.add_option(both_spellings("world-size"), world_size, "ranks, started here")->check(cli::in_range(1, 64))
      ->capture_default_str();
  mode.add_option("--size-mib", size_mib, "fp32 state: parameters + Adam's moments")
      ->check(cli::in_range(1, 1 << 20))
      ->capture_default_str();
  mode.add_option("--layers", layers, "Linear layers, one FSDP unit each")->check(cli::in_range(1, 1024))
      ->capture_default_str();
  mode.add_option("--dir", dir, "where the files go (the disk measured)")->capture_default_str();
  mode.add_option("--repeats", repeats, "times each operation runs (the median is shown)")
      ->check(cli::in_range(1, 1000))
      ->capture_default_str();
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
  mode.add_option("--run-dir", run_dir)->group("");
  mode.add_option("--result", result)->group("");
}

int checkpoint_bench(const CheckpointBenchOptions& o, const std::vector<std::string>& args) {
  if (!o.result.empty()) return run_rank(o);
  return run_parent(o, args);
}

}  // namespace tdist::bench

// tdist-bench checkpoint: sharded checkpoints of an FSDP model with Adam
// (parameters + both moments: --size-mib of fp32 state) at --world-size
// ranks: the per-rank save and load, then `tdist-ckpt consolidate
// --optimizer` and `tdist-ckpt reshard` (their own processes, whose peak
// RSS they report), each next to a plain sequential copy of the same
// bytes on the same disk in the same run (read, write, fsync, 4 MiB at a
// time). The table shows each operation's time, its throughput as a
// fraction of the copy's, and the peak memory of the tools against the
// largest tensor. Then the Checkpointer's cost to the same model training:
// a synchronous save's stall against an asynchronous one's (the copy, and
// what the steps that overlap its writing lose).
//
// --format dcp: the same as PyTorch's DCP folder (save, load, `tdist-ckpt
// convert --to safetensors --optimizer` in place of consolidate; no
// reshard: DCP loads at any world size), with each rank's peak memory
// beyond what it held before (target: its shard + one tensor + 64 MiB), and
// with --python, PyTorch's own dcp.load and dcp.save of the same folder
// into the same model under FSDP2 (bench/torch_dcp_reference.py), taking
// turns with tdist's tools in each repeat.
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

// The Checkpointer's cost to training (the slowest rank's, medians of
// o.repeats): a training step alone; the stall of a synchronous save; the
// stall of an asynchronous one (the copy to memory) and the steps that run
// while its writer thread writes, against steps alone. async_lost_s: what
// training lost to an asynchronous save in all (its stall plus what the
// steps during the write took beyond steps alone).
struct CheckpointerTimes {
  double step_s = 0, sync_stall_s = 0, async_stall_s = 0, async_step_s = 0, async_write_s = 0, async_lost_s = 0;
};

template <typename Model>
CheckpointerTimes checkpointer_times(const CheckpointBenchOptions& o, ProcessGroup& pg, Model& model,
                                     torch::optim::Optimizer& opt) {
  const int64_t w = width_for(o);
  const auto step = [&] {
    const auto t = Clock::now();
    torch::Tensor x = torch::randn({8, w});
    opt.zero_grad();
    model->forward(x).pow(2).mean().backward();
    opt.step();
    return seconds_since(t);
  };
  const auto slowest = [&](double v) {
    at::Tensor t = at::tensor({v}, at::kDouble);
    pg.all_reduce(t, {ReduceOp::MAX})->wait();
    return t.item<double>();
  };
  CheckpointerOptions co;
  co.dir = o.run_dir + "/checkpointer";
  co.keep_last = 1;
  co.idle_writes = o.writer == "idle";
  co.overlap_copy = o.overlap == "on";
  co.files.format = o.format == "dcp" ? ShardedFormat::dcp : ShardedFormat::tdist;
  std::vector<double> alone, sync_stall, async_stall, during, writes, lost;
  for (int i = 0; i < 6; ++i) alone.push_back(slowest(step()));
  {
    co.async = false;
    Checkpointer ckpt(default_group(), *model, &opt, co);
    for (int i = 0; i < o.repeats; ++i) {
      ::sync();
      pg.barrier()->wait();
      const auto t = Clock::now();
      ckpt.save(i + 1);
      sync_stall.push_back(slowest(seconds_since(t)));
      alone.push_back(slowest(step()));
    }
  }
  const double step_alone = percentile(alone, 50);
  co.async = true;
  Checkpointer ckpt(default_group(), *model, &opt, co);
  for (int i = 0; i < o.repeats; ++i) {
    ::sync();
    pg.barrier()->wait();
    const auto t = Clock::now();
    ckpt.save(100 + i);
    const double stall = seconds_since(t);
    double extra = 0;
    // Steps while the writer writes (every rank as many as rank 0 needs).
    for (;;) {
      at::Tensor more = at::tensor({ckpt.saving() ? int64_t{1} : int64_t{0}}, at::kLong);
      pg.all_reduce(more, {ReduceOp::MAX})->wait();
      if (more.item<int64_t>() == 0) break;
      const double s = step();
      during.push_back(s);
      extra += s - step_alone;
    }
    ckpt.wait();
    writes.push_back(slowest(seconds_since(t)));
    async_stall.push_back(slowest(stall));
    lost.push_back(slowest(stall + std::max(0.0, extra)));
  }
  CheckpointerTimes out;
  out.step_s = step_alone;
  out.sync_stall_s = percentile(sync_stall, 50);
  out.async_stall_s = percentile(async_stall, 50);
  out.async_step_s = during.empty() ? 0 : slowest(percentile(during, 50));
  if (during.empty()) slowest(0);  // (every rank takes part in the same collectives)
  out.async_write_s = percentile(writes, 50);
  out.async_lost_s = percentile(lost, 50);
  return out;
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM").
int64_t vm_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(std::string(field) + ":", 0) == 0) return std::stoll(line.substr(std::strlen(field) + 1)) * 1024;
  }
  return 0;
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
  ShardedCheckpointOptions so;
  so.format = o.format == "dcp" ? ShardedFormat::dcp : ShardedFormat::tdist;
  std::vector<double> saves, loads;
  // What the ops hold beyond the model and optimizer: the peak from here
  // on ("5" into clear_refs resets VmHWM to the current VmRSS).
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t rss_before = vm_bytes("VmRSS");
  for (int i = 0; i < o.repeats; ++i) {
    ::sync();  // every operation starts with the disk idle (no earlier writeback in flight)
    pg->barrier()->wait();
    auto t = Clock::now();
    save_sharded_checkpoint(prefix, *pg, *model, &opt, so);
    saves.push_back(seconds_since(t));
    ::sync();
    pg->barrier()->wait();
    t = Clock::now();
    load_sharded_checkpoint(prefix, *pg, *model, &opt);
    pg->barrier()->wait();
    loads.push_back(seconds_since(t));
  }
  const double save_s = percentile(saves, 50), load_s = percentile(loads, 50);
  at::Tensor extra = at::tensor({vm_bytes("VmHWM") - rss_before}, at::kLong);
  pg->all_reduce(extra, {ReduceOp::MAX})->wait();
  const CheckpointerTimes c = checkpointer_times(o, *pg, model, opt);
  if (pg->rank() == 0) {
    std::ofstream(o.result) << nlohmann::json{{"save_s", save_s}, {"load_s", load_s}, {"step_s", c.step_s},
                                              {"rank_extra_peak_bytes", extra.item<int64_t>()},
                                              {"sync_stall_s", c.sync_stall_s}, {"async_stall_s", c.async_stall_s},
                                              {"async_step_s", c.async_step_s}, {"async_write_s", c.async_write_s},
                                              {"async_lost_s", c.async_lost_s}}
                                   .dump();
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
  const bool dcp = o.format == "dcp";
  std::vector<std::string> files;
  if (dcp) {
    for (const auto& e : std::filesystem::directory_iterator(prefix)) files.push_back(e.path().string());
  } else {
    for (int r = 0; r < o.world_size; ++r) {
      files.push_back(prefix + "_rank-" + std::to_string(r) + "-of-" + std::to_string(o.world_size) + ".pt");
    }
  }
  const int64_t bytes = bytes_of(files);
  const std::string torch_json = dir + "/torch.json";
  std::vector<double> torch_load, torch_save;
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
    const std::string full = dir + (dcp ? "/full.safetensors" : "/full.pt");
    const ToolRun c = dcp ? run_tool({"convert", "--from", "dcp:" + prefix, "--to", "safetensors:" + full, "--optimizer"}, dir)
                          : run_tool({"consolidate", "--ckpt-prefix", prefix, "--optimizer", "--save-path", full}, dir);
    cons_s.push_back(c.seconds);
    cons.peak_rss = std::max(cons.peak_rss, c.peak_rss);
    cons_bytes = static_cast<int64_t>(std::filesystem::file_size(full));
    std::filesystem::remove(full);
    ::sync();
    if (dcp && !o.python.empty()) {  // PyTorch's dcp.load and dcp.save of the same folder, in turn with ours
      const std::string cmd = o.python + " " + source_dir() + "/bench/torch_dcp_reference.py --ckpt " + prefix +
                              " --width " + std::to_string(width_for(o)) + " --layers " + std::to_string(o.layers) +
                              " --world-size " + std::to_string(o.world_size) + " --repeats 1 --out " + torch_json +
                              " > " + dir + "/torch.log 2>&1";
      if (std::system(cmd.c_str()) != 0) {
        std::ifstream log(dir + "/torch.log");
        std::fprintf(stderr, "%s", std::string(std::istreambuf_iterator<char>(log), {}).c_str());
        throw std::runtime_error("PyTorch's reference failed: " + cmd);
      }
      const auto t = nlohmann::json::parse(std::ifstream(torch_json));
      torch_load.push_back(t["load_s"].get<double>());
      torch_save.push_back(t["save_s"].get<double>());
      continue;
    }
    if (dcp) continue;  // DCP loads at any world size: nothing to reshard
    const ToolRun r = run_tool({"reshard", "--ckpt-prefix", prefix, "--world-size", std::to_string(to),
                                "--out-prefix", dir + "/re"}, dir);
    resh_s.push_back(r.seconds);
    resh.peak_rss = std::max(resh.peak_rss, r.peak_rss);
  }
  const double copy_s = percentile(copies, 50);
  cons.seconds = percentile(cons_s, 50);
  resh.seconds = resh_s.empty() ? 0 : percentile(resh_s, 50);
  const ToolRun base = run_tool({"--help"}, dir);  // the process alone, nothing done
  const int64_t w = width_for(o);
  const int64_t largest = w * w * 4;
  const double copy_bps = bytes / copy_s;
  std::printf("checkpoint (%s): FSDP, %d Linear(%lld, %lld) units + Adam = %.1f MiB of fp32 state, world %d, in %s;"
              " medians of %d\n",
              dcp ? "PyTorch's DCP folder" : "tdist's per-rank files", o.layers, static_cast<long long>(w),
              static_cast<long long>(w), bytes / 1048576.0, o.world_size, o.dir.c_str(), o.repeats);
  std::printf("  largest tensor %.1f MiB; tdist-ckpt doing nothing (--help) peaks at %.1f MiB\n\n",
              largest / 1048576.0, base.peak_rss / 1048576.0);
  std::printf("  %-36s %10s %10s %12s %14s\n", "operation", "seconds", "MiB/s", "x copy", "peak RSS MiB");
  JsonRows rows;
  const auto row = [&](const char* name, double s, int64_t moved, int64_t peak) {
    const double bps = moved / s;
    std::printf("  %-36s %10.2f %10.0f %12.2f %14s\n", name, s, bps / 1048576.0, bps / copy_bps,
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
  row(dcp ? "convert to safetensors --optimizer" : "consolidate --optimizer", cons.seconds, cons_bytes, cons.peak_rss);
  if (!dcp) row(("reshard to " + std::to_string(to)).c_str(), resh.seconds, bytes, resh.peak_rss);
  if (!torch_load.empty()) {
    row("PyTorch dcp.load", percentile(torch_load, 50), bytes, 0);
    row("PyTorch dcp.save", percentile(torch_save, 50), bytes, 0);
  }
  std::printf("\n  %s: peak RSS %.1f MiB (target: at most the largest tensor + 64 MiB = %.1f MiB)\n",
              dcp ? "convert" : "consolidate", cons.peak_rss / 1048576.0, (largest + (int64_t{64} << 20)) / 1048576.0);
  const int64_t extra = ranks["rank_extra_peak_bytes"].get<int64_t>();
  std::printf("  a rank's save and load: %.1f MiB beyond what it held (target: its shard + one tensor + 64 MiB = "
              "%.1f MiB)\n", extra / 1048576.0, (bytes / o.world_size + largest + (int64_t{64} << 20)) / 1048576.0);
  rows.begin_row();
  rows.field("operation", "rank save and load, extra peak");
  rows.field("peak_rss_bytes", static_cast<double>(extra));
  const double sync_stall = ranks["sync_stall_s"].get<double>(), lost = ranks["async_lost_s"].get<double>();
  std::printf("\n  Checkpointer (--writer %s --overlap-copy %s), the same model training (a step alone: %.3f s):\n",
              o.writer.c_str(), o.overlap.c_str(),
              ranks["step_s"].get<double>());
  std::printf("    synchronous save: training stalls %.3f s\n", sync_stall);
  std::printf("    asynchronous save: the call stalls %.3f s (the copy); %.3f s to write, while steps take %.3f s "
              "(alone: %.3f s)\n",
              ranks["async_stall_s"].get<double>(), ranks["async_write_s"].get<double>(),
              ranks["async_step_s"].get<double>(), ranks["step_s"].get<double>());
  const double per_step = ranks["async_stall_s"].get<double>() +
                          std::max(0.0, ranks["async_step_s"].get<double>() - ranks["step_s"].get<double>());
  std::printf("    a step that overlaps it loses %.3f s (the stall, and its slowdown) = %.1f %% of the synchronous "
              "stall (target: at most 10 %%)\n",
              per_step, 100 * per_step / sync_stall);
  std::printf("    all the steps that overlap its writing lose %.3f s = %.1f %% of the synchronous stall\n", lost,
              100 * lost / sync_stall);
  for (const char* k : {"step_s", "sync_stall_s", "async_stall_s", "async_step_s", "async_write_s", "async_lost_s"}) {
    rows.begin_row();
    rows.field("operation", std::string("checkpointer ") + k);
    rows.field("seconds", ranks[k].get<double>());
  }
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
  mode.add_option("--writer", writer,
                  "the Checkpointer's asynchronous writing: idle (SCHED_IDLE, the default) or nice (nice 19)")
      ->check(CLI::IsMember({"idle", "nice"}))
      ->capture_default_str();
  mode.add_option("--overlap-copy", overlap,
                  "the Checkpointer's copy of the weights: on (after the call, finished by the next backward at the "
                  "latest) or off (in the call)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  mode.add_option("--format", format, "tdist (per-rank .pt files) or dcp (PyTorch's DCP folder)")
      ->check(CLI::IsMember({"tdist", "dcp"}))
      ->capture_default_str();
  mode.add_option("--python", python, "dcp: a Python with torch 2.x whose dcp.load and dcp.save run beside ours")
      ->type_name("PYTHON");
  mode.add_option("--json", json, "also write the rows here")->type_name("FILE");
  mode.add_option("--run-dir", run_dir)->group("");
  mode.add_option("--result", result)->group("");
}

int checkpoint_bench(const CheckpointBenchOptions& o, const std::vector<std::string>& args) {
  if (!o.result.empty()) return run_rank(o);
  return run_parent(o, args);
}

}  // namespace tdist::bench

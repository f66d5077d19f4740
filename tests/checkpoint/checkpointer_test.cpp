// Checkpointer in real processes: a run stopped after a save and restarted
// continues bit for bit as one that never stopped (model, Adam, the RNG
// that draws its data and dropout, the user's data position); the last
// keep_last checkpoints are kept; a resume at another world size reshards
// and says the RNG was not restored; a failed background save is raised,
// leaving the latest one as it was; a slow save is committed within a
// tenth of the interval; a hostile latest marker is an error, not a hang.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/tensor_tree.h"
#include "checkpoint/writer_pause.h"
#include "util/mapped_tensor.h"
#include "tdist/tdist.h"
#include "tests/fsdp/models.h"
#include "tests/util/process.h"
#include "tests/util/world.h"

namespace {

using tdist::CheckpointError;
using tdist::FSDP;
using tdist::ProcessGroup;
using tdist::StateDict;
using tdist::test::Net;
using tdist::test::run_world;
using tdist::test::TempDir;

tdist::FullyShardedDataParallelOptions wrap_options() {
  tdist::FullyShardedDataParallelOptions o;
  o.process_group = tdist::default_group();
  return o;
}

// One step whose batch and dropout draw from the default generator: a
// resume that did not restore it would differ from the first step on.
void train_step(FSDP<Net>& model, torch::optim::Optimizer& opt, ProcessGroup& pg) {
  at::Tensor x = torch::randn({4, 6}) + pg.rank();
  opt.zero_grad();
  torch::dropout(model(x), 0.3, true).pow(2).mean().backward();
  opt.step();
}

StateDict full_state(FSDP<Net>& model, torch::optim::Optimizer& opt) {
  StateDict all = tdist::full_state_dict(*model, false);
  const auto optim = tdist::full_optimizer_state_dict(*model, opt, false);
  for (const auto& p : optim.state) {
    for (const auto& f : p.value()) all.insert(p.key() + "/" + f.key(), f.value());
  }
  return all;
}

void expect_equal_to_file(const std::string& path, const StateDict& got, const std::string& what) {
  const StateDict want = tdist::load_safetensors(path);
  WORLD_CHECK(want.size() == got.size(), what << ": " << got.size() << " tensors against " << want.size());
  for (const auto& item : got) {
    WORLD_CHECK(want.contains(item.key()) && torch::equal(want[item.key()], item.value()),
                what << ": '" << item.key() << "' differs");
  }
}

tdist::CheckpointerOptions options(const std::string& dir) {
  tdist::CheckpointerOptions o;
  o.dir = dir;
  o.every_steps = 3;
  o.keep_last = 2;
  return o;
}

// Trains steps (from, to], saving as the Checkpointer says, with the data
// position ("seen": samples drawn so far) as an extra.
void run_steps(FSDP<Net>& model, torch::optim::Optimizer& opt, ProcessGroup& pg, tdist::Checkpointer& ckpt,
               int64_t from, int64_t to) {
  for (int64_t step = from + 1; step <= to; ++step) {
    train_step(model, opt, pg);
    ckpt.maybe_save(step, {{"seen", at::tensor({step * 4}, at::kLong)}});
  }
}

// The entries of dir, sorted, with each step folder's save id cut off
// ("step-00000006-0a1b..." -> "step-00000006").
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.size() == 30) name.resize(13);
    names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The folders dir/latest lists, save ids cut off, newest first.
std::vector<std::string> latest_list(const std::string& dir) {
  std::ifstream f(dir + "/latest");
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) out.push_back(line.size() == 30 ? line.substr(0, 13) : line);
  return out;
}

// The one folder of `step` in dir (its full name), or "".
std::string folder_of(const std::string& dir, const std::string& step) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(step + "-", 0) == 0) return name;
  }
  return "";
}

TEST(Checkpointer, ARestartedRunContinuesBitForBitAsOneThatNeverStopped) {
  TempDir tmp;
  const std::string straight_dir = tmp.path() + "/straight", dir = tmp.path() + "/run";
  const std::string straight = tmp.path() + "/straight.safetensors", at9 = tmp.path() + "/at9.safetensors";
  // Ten steps without a stop, saving asynchronously at 3, 6 and 9.
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(1);
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, options(straight_dir));
    WORLD_CHECK(!ckpt.restore(), "a fresh folder restored something");
    run_steps(model, opt, pg, ckpt, 0, 10);
    ckpt.wait();
    const StateDict all = full_state(model, opt);
    if (pg.rank() == 0) tdist::save_safetensors(straight, all);
  }), "");
  // The same run, stopped after step 7 (step 7 is lost; 6 was saved).
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(1);
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, options(dir));
    run_steps(model, opt, pg, ckpt, 0, 7);
  }), "");
  EXPECT_EQ(latest_list(dir), (std::vector<std::string>{"step-00000006", "step-00000003"}));
  // What a crash in the middle of a save leaves: a folder of step 9 with a
  // stray training state of another world size. The resumed run's own
  // save of step 9 must not read or keep it.
  const std::string stray = dir + "/step-00000009-00000000deadbeef";
  std::filesystem::create_directories(stray);
  std::ofstream(stray + "/train_rank-0-of-4.pt") << "a crashed save's";
  // Restarted with other weights, another seed and another learning rate:
  // the checkpoint sets them all.
  ASSERT_EQ(run_world(2, [&](ProcessGroup& pg) {
    torch::manual_seed(99);
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, options(dir));
    const auto resumed = ckpt.restore();
    WORLD_CHECK(resumed && resumed->step == 6, "restored step " << (resumed ? resumed->step : -1));
    WORLD_CHECK(resumed->rng_restored && resumed->saved_world_size == 2, "rng");
    WORLD_CHECK(resumed->extras.at("seen").item<int64_t>() == 24, "the data position");
    run_steps(model, opt, pg, ckpt, 6, 9);
    ckpt.wait();
    const StateDict nine = full_state(model, opt);
    if (pg.rank() == 0) tdist::save_safetensors(at9, nine);
    run_steps(model, opt, pg, ckpt, 9, 10);
    expect_equal_to_file(straight, full_state(model, opt), "resumed at step 6");
  }), "");
  // keep_last = 2: the saves at 6 and 9 are kept, the one at 3 and the
  // crash's leftover are gone.
  EXPECT_EQ(listing(dir), (std::vector<std::string>{"latest", "step-00000006", "step-00000009"}));
  EXPECT_EQ(latest_list(dir), (std::vector<std::string>{"step-00000009", "step-00000006"}));
  EXPECT_FALSE(std::filesystem::exists(stray));
  EXPECT_EQ(listing(dir + "/" + folder_of(dir, "step-00000009")),
            (std::vector<std::string>{"model_rank-0-of-2.pt", "model_rank-1-of-2.pt", "train_rank-0-of-2.pt",
                                      "train_rank-1-of-2.pt"}));

  // At another world size: resharded, step and extras from rank 0, the
  // RNG left alone (and said so).
  EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, options(dir));
    const auto resumed = ckpt.restore();
    WORLD_CHECK(resumed && resumed->step == 9 && !resumed->rng_restored && resumed->saved_world_size == 2,
                "restored at world 1");
    WORLD_CHECK(resumed->extras.at("seen").item<int64_t>() == 36, "the data position at world 1");
    expect_equal_to_file(at9, full_state(model, opt), "restored at world 1");
  }), "");
}

// The same with the model and optimizer as PyTorch's DCP folders
// (ShardedCheckpointOptions::format): written asynchronously, restored bit
// for bit, pruned whole (a folder inside each step folder), and restored
// at another world size.
TEST(Checkpointer, DcpFoldersResumeBitForBitAndArePruned) {
  TempDir tmp;
  const std::string straight_dir = tmp.path() + "/straight", dir = tmp.path() + "/run";
  const std::string straight = tmp.path() + "/straight.safetensors", at9 = tmp.path() + "/at9.safetensors";
  const auto dcp_options = [](const std::string& d) {
    tdist::CheckpointerOptions o = options(d);
    o.files.format = tdist::ShardedFormat::dcp;
    return o;
  };
  const auto run = [&](const std::string& d, int64_t stop, uint64_t seed, const std::string& save_at_9) {
    return run_world(2, [&](ProcessGroup& pg) {
      torch::manual_seed(seed);
      auto o = wrap_options();
      FSDP<Net> model(Net(&o), o);
      torch::optim::Adam opt(model->parameters(), 0.01);
      tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, dcp_options(d));
      int64_t from = 0;
      if (const auto resumed = ckpt.restore()) from = resumed->step;
      run_steps(model, opt, pg, ckpt, from, std::min<int64_t>(stop, 9));
      ckpt.wait();
      if (!save_at_9.empty()) {
        const StateDict nine = full_state(model, opt);
        if (pg.rank() == 0) tdist::save_safetensors(save_at_9, nine);
      }
      if (stop == 10) {
        run_steps(model, opt, pg, ckpt, 9, 10);
        ckpt.wait();
        const StateDict all = full_state(model, opt);
        if (pg.rank() == 0 && save_at_9.empty()) tdist::save_safetensors(straight, all);
        if (!save_at_9.empty()) expect_equal_to_file(straight, all, "resumed from a DCP checkpoint");
      }
    });
  };
  ASSERT_EQ(run(straight_dir, 10, 1, ""), "");
  ASSERT_EQ(run(dir, 7, 1, ""), "");    // stopped after step 7: 6 saved
  ASSERT_EQ(run(dir, 10, 99, at9), "");  // other weights: the checkpoint sets them
  EXPECT_EQ(listing(dir), (std::vector<std::string>{"latest", "step-00000006", "step-00000009"}));
  const std::string nine = dir + "/" + folder_of(dir, "step-00000009");
  EXPECT_EQ(listing(nine), (std::vector<std::string>{"model", "train_rank-0-of-2.pt", "train_rank-1-of-2.pt"}));
  EXPECT_EQ(listing(nine + "/model"), (std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp"}));
  EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.5);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, dcp_options(dir));
    const auto resumed = ckpt.restore();
    WORLD_CHECK(resumed && resumed->step == 9 && resumed->saved_world_size == 2, "restored at world 1");
    expect_equal_to_file(at9, full_state(model, opt), "restored at world 1");
  }), "");
}

// A save that fails on its writer thread (here: rank 1's training state
// cannot be written) is raised by wait() on every rank; its folder is
// removed and the latest marker keeps naming the last good checkpoint.
TEST(Checkpointer, AFailedBackgroundSaveIsRaisedAndTheLatestStays) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/run";
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, options(dir));
    run_steps(model, opt, pg, ckpt, 0, 3);
    ckpt.wait();
    std::map<std::string, at::Tensor> extras;
    if (pg.rank() == 1) extras["broken"] = at::Tensor();  // fails to build on rank 1 only
    ckpt.save(6, extras);
    std::string error;
    try {
      ckpt.wait();
    } catch (const CheckpointError& e) {
      error = e.what();
    }
    WORLD_CHECK(error.find("rank 1") != std::string::npos && error.find("'broken'") != std::string::npos,
                "the error: '" << error << "'");
    WORLD_CHECK(ckpt.latest_step() == 3, "latest moved to " << ckpt.latest_step().value_or(-1));
    pg.barrier()->wait();
    WORLD_CHECK(folder_of(dir, "step-00000006").empty(), "the failed save's folder was left");
    ckpt.save(7);
    ckpt.wait();
    WORLD_CHECK(ckpt.latest_step() == 7, "latest after a good save: " << ckpt.latest_step().value_or(-1));
    // A negative step is refused before anything is written.
    bool refused = false;
    try {
      ckpt.save(-1);
    } catch (const tdist::UsageError&) {
      refused = true;
    }
    WORLD_CHECK(refused, "save(-1) was taken");
  }), "");
}

// A save still being written at a failure is lost with it: maybe_save
// waits for the save in flight every_steps / 10 steps after it (here 2 of
// 20), so that a run never has more than 22 steps since its latest
// checkpoint. The writer is held back 1.5 s, far longer than those steps.
TEST(Checkpointer, ASlowSaveIsCommittedWithinATenthOfTheInterval) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/run";
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    tdist::detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds(1500));
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    auto co = options(dir);
    co.every_steps = 20;
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, co);
    for (int64_t step = 1; step <= 42; ++step) {
      train_step(model, opt, pg);
      ckpt.maybe_save(step);
      const int64_t latest = ckpt.latest_step().value_or(0);
      WORLD_CHECK(step - latest <= 22, "step " << step << " with the latest checkpoint at " << latest);
      if (step == 21) WORLD_CHECK(ckpt.saving(), "the save of step 20 was written at once: the test shows nothing");
    }
    ckpt.wait();
  }), "");
}

// An asynchronous save of an FSDP model copies the weights and Adam's
// state after save() returns: here the writer waits 1.5 s before it starts,
// so the copy is made by the next step's backward as it ends (the weight
// fence), before that step's optimizer changes them. The checkpoint holds
// the state at save(), bit for bit; without the fence it would hold the
// next step's.
TEST(Checkpointer, TheSnapshotIsTheStateAtSaveWhileTheNextStepsRun) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/run";
  EXPECT_EQ(run_world(2, [&](ProcessGroup& pg) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    torch::optim::Adam opt(model->parameters(), 0.01);
    auto co = options(dir);
    co.every_steps = 0;
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, co);
    for (int i = 0; i < 2; ++i) train_step(model, opt, pg);
    const StateDict at_save = full_state(model, opt);
    tdist::detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds(1500));
    ckpt.save(2);
    for (int i = 0; i < 3; ++i) train_step(model, opt, pg);
    WORLD_CHECK(ckpt.saving(), "the save was written before the steps: the test shows nothing");
    ckpt.wait();
    tdist::detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds(0));
    WORLD_CHECK(ckpt.restore().has_value(), "no checkpoint");
    const StateDict restored = full_state(model, opt);
    for (const auto& item : at_save) {
      WORLD_CHECK(restored.contains(item.key()) && torch::equal(restored[item.key()], item.value()),
                  "'" << item.key() << "' is not what it was at save()");
    }
  }), "");
}

// A model that is neither DDP nor FSDP has no backward end to wait at:
// its copy is made in save(), and an optimizer step right after it
// changes nothing in the checkpoint.
TEST(Checkpointer, AnUnwrappedModelIsCopiedInSave) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/run";
  EXPECT_EQ(run_world(2, [&](ProcessGroup&) {
    torch::nn::Linear model(4, 3);
    torch::optim::SGD opt(model->parameters(), 0.5);
    auto co = options(dir);
    co.every_steps = 0;
    tdist::Checkpointer ckpt(tdist::default_group(), *model, &opt, co);
    const at::Tensor at_save = model->weight.detach().clone();
    tdist::detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds(500));
    ckpt.save(1);
    {
      torch::NoGradGuard no_grad;
      model->weight.add_(1.0);
    }
    ckpt.wait();
    tdist::detail::set_checkpoint_writer_pause_for_testing(std::chrono::milliseconds(0));
    WORLD_CHECK(ckpt.restore().has_value(), "no checkpoint");
    WORLD_CHECK(torch::equal(model->weight, at_save), "the checkpoint holds the weights after save()");
  }), "");
}

// A symbolic link named like a step folder is removed itself; what it
// points to is never touched.
TEST(Checkpointer, PruningNeverFollowsALink) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/run", outside = tmp.path() + "/precious";
  std::filesystem::create_directories(dir);
  std::filesystem::create_directories(outside);
  std::ofstream(outside + "/keep.txt") << "mine";
  std::filesystem::create_directory_symlink(outside, dir + "/step-00000001-00000000000000aa");
  EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
    auto o = wrap_options();
    FSDP<Net> model(Net(&o), o);
    tdist::Checkpointer ckpt(tdist::default_group(), *model, nullptr, options(dir));
    ckpt.save(2);
    ckpt.wait();
  }), "");
  EXPECT_TRUE(std::filesystem::exists(outside + "/keep.txt"));
  EXPECT_EQ(listing(dir), (std::vector<std::string>{"latest", "step-00000002"}));
}

// What dir/latest holds is read with a bound and checked: a FIFO is refused
// at once, text that names no step folder is a CheckpointError.
TEST(Checkpointer, AHostileLatestMarkerIsAnErrorNotAHang) {
  TempDir tmp;
  for (const std::string kind : {"fifo", "garbage", "huge"}) {
    const std::string dir = tmp.path() + "/" + kind;
    std::filesystem::create_directories(dir);
    const std::string marker = dir + "/latest";
    if (kind == "fifo") {
      ASSERT_EQ(::mkfifo(marker.c_str(), 0600), 0);
    } else if (kind == "garbage") {
      std::ofstream(marker) << "step-00000001-0000000000000001\n../../etc\n";
    } else {
      std::ofstream(marker) << "step-00000001-0000000000000001\n" << std::string(1 << 20, '1');
    }
    EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
      auto o = wrap_options();
      FSDP<Net> model(Net(&o), o);
      tdist::Checkpointer ckpt(tdist::default_group(), *model, nullptr, options(dir));
      std::string error;
      try {
        ckpt.restore();
      } catch (const CheckpointError& e) {
        error = e.what();
      }
      WORLD_CHECK(error.find("latest") != std::string::npos, kind << ": '" << error << "'");
    }), "") << kind;
  }
}

TEST(Checkpointer, MisuseIsNamed) {
  EXPECT_EQ(run_world(1, [&](ProcessGroup&) {
    torch::nn::Linear plain(3, 2);
    auto bad = [&](tdist::CheckpointerOptions o, const std::string& says) {
      std::string error;
      try {
        tdist::Checkpointer ckpt(tdist::default_group(), *plain, nullptr, o);
      } catch (const tdist::UsageError& e) {
        error = e.what();
      }
      WORLD_CHECK(error.find(says) != std::string::npos, "'" << error << "' does not say " << says);
    };
    bad({}, "dir is empty");
    tdist::CheckpointerOptions o;
    o.dir = "/tmp/unused";
    o.keep_last = 0;
    bad(o, "keep_last");
    o.keep_last = 1;
    o.every_steps = -1;
    bad(o, "every_steps");
  }), "");
}

// The /proc/self/maps range [start, end) that holds address p; {0, 0}: none.
std::pair<uintptr_t, uintptr_t> mapping_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const size_t dash = line.find('-'), space = line.find(' ');
    const uintptr_t lo = std::stoull(line.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
    if (lo <= a && a < hi) return {lo, hi};
  }
  return {0, 0};
}

// Whether [p, p + bytes) is mapped in this process now.
bool is_mapped(const void* p, size_t bytes) {
  std::vector<unsigned char> pages((bytes + 4095) / 4096);
  return ::mincore(const_cast<void*>(p), bytes, pages.data()) == 0;
}

// An asynchronous save's host copies, kept from one save to the next, are
// mapped for themselves, never taken from malloc's heap: there they would
// use up its free space, and every large temporary of the steps that
// follow (a weight's gradient, each backward) would be mapped and faulted
// afresh (util/mapped_tensor.h).
TEST(Checkpointer, AnAsynchronousSavesCopiesAreMappedOutsideMallocsHeap) {
  const at::Tensor weights = torch::randn({3, 1000, 333});  // ~3.8 MiB
  const size_t bytes = weights.nbytes();
  const void* data = nullptr;
  {
    tdist::checkpoint::CopyPool pool;
    at::Tensor copy = pool.copy(weights);
    EXPECT_TRUE(torch::equal(copy, weights));
    data = copy.data_ptr();
    // A mapping of its own starts on a page; malloc's blocks (LibTorch's
    // at 64-byte alignment) start inside its heap, or 16 or more bytes into
    // a mapping of their own (the chunk's header).
    EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 4096, 0u) << "the copy is not at the start of a mapping";
    const auto [lo, hi] = mapping_of(data);
    EXPECT_GE(hi, reinterpret_cast<uintptr_t>(data) + bytes);
    // Reused by the next save: the same buffer.
    pool.restart();
    copy = at::Tensor();
    EXPECT_EQ(pool.copy(weights * 2).data_ptr(), data);
  }
  EXPECT_FALSE(is_mapped(data, bytes)) << "the copy's memory outlived the pool";
}

TEST(MappedCpuTensor, HoldsZerosInItsOwnMappingWithTheShapeAsked) {
  const at::Tensor t = tdist::detail::mapped_cpu_tensor({4, 300, 7}, {}, at::TensorOptions(at::kDouble));
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{4, 300, 7}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.scalar_type(), at::kDouble);
  EXPECT_TRUE(torch::equal(t, torch::zeros({4, 300, 7}, at::kDouble)));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4096, 0u);
  t.fill_(2.5);  // writable
  EXPECT_EQ(t.sum().item<double>(), 2.5 * 4 * 300 * 7);
  // Strided (a transpose's strides): spans what the last element needs.
  at::Tensor s = tdist::detail::mapped_cpu_tensor({300, 4}, {1, 300}, at::TensorOptions(at::kFloat));
  EXPECT_EQ(s.strides(), (std::vector<int64_t>{1, 300}));
  s.fill_(1);
  EXPECT_EQ(s.sum().item<float>(), 1200);
  EXPECT_TRUE(is_mapped(s.data_ptr(), 1200 * sizeof(float)));
  // Empty: no mapping of its own (a size of zero has nothing to map).
  EXPECT_EQ(tdist::detail::mapped_cpu_tensor({0, 5}, {}, at::TensorOptions(at::kFloat)).numel(), 0);
  // Strides that do not fit, and sizes whose bytes overflow: errors, nothing mapped.
  EXPECT_THROW(tdist::detail::mapped_cpu_tensor({3, 4}, {1}, at::TensorOptions(at::kFloat)), std::invalid_argument);
  EXPECT_THROW(tdist::detail::mapped_cpu_tensor({3, 4}, {-1, 1}, at::TensorOptions(at::kFloat)), std::invalid_argument);
  EXPECT_THROW(tdist::detail::mapped_cpu_tensor({int64_t{1} << 62, 8}, {}, at::TensorOptions(at::kFloat)),
               std::bad_alloc);
  const void* p = s.data_ptr();
  s = at::Tensor();
  EXPECT_FALSE(is_mapped(p, 1200 * sizeof(float)));
}

}  // namespace

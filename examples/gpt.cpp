// GPT-2 in Hugging Face's layout, trained on byte-level text with FSDP (or
// DDP), on every rank of a tdist-run job (alone: a world of one).
//
//   build/bin/tdist-run --nproc-per-node 2 build/bin/gpt --steps 300
//   build/bin/gpt --from-pretrained DIR --data FILE --eval-only
//   build/bin/tdist-run --nproc-per-node 3 build/bin/gpt --from-pretrained DIR --steps 50 --save-pretrained OUT
//   build/bin/tdist-run --max-restarts 3 --nproc-per-node 2 build/bin/gpt --steps 300 --checkpoint-dir ckpt --checkpoint-every 50
//       (saves every 50 steps; started again, resumes from the latest checkpoint in ckpt/ by itself)
//
// The model is examples/gpt_model.h (GPT2LMHeadModel's computation and
// names, lm_head tied to wte); --from-pretrained reads a Hugging Face
// directory (config.json + model.safetensors or shards) through
// tdist::load_pretrained, each rank reading what it keeps;
// --save-pretrained writes one that GPT2LMHeadModel.from_pretrained loads.
// The data is a file's bytes (default: Debian's fortunes, concatenated),
// split and windowed as examples/gpt_data.h says. At the end rank 0 prints
// val_loss=<mean cross-entropy over every validation target> and a sampled
// continuation of --prompt.
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "examples/cli_checks.h"
#include "examples/example_main.h"
#include "examples/gpt_data.h"
#include "examples/gpt_model.h"
#include "examples/progress.h"
#include "tdist/tdist.h"

namespace {

// Tokens per window unless --block-size says: Hugging Face's run_clm
// default (its 1024 is GPT-2's n_positions) scaled to this small model,
// and like run_clm never longer than the model's n_positions.
constexpr int64_t kDefaultBlockSize = 128;

struct Args {
  std::string fsdp = "full";  // full | grad_op | no
  bool ddp = false;
  std::string precision = "fp32";
  bool activation_checkpointing = false;
  std::string device = "cpu";
  std::string backend = "auto";
  std::string init = "deferred";
  std::string from_pretrained, save_pretrained, max_shard_size = "5GB";
  std::string data;
  int64_t steps = 300;
  int64_t batch_size = 8;  // per rank
  int64_t block_size = 0;  // 0: kDefaultBlockSize, or the model's n_positions when that is smaller
  int64_t n_layer = 4, n_head = 4, n_embd = 128;
  double dropout = 0;
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.1, grad_clip = 1.0;
  int64_t warmup = 20;
  uint64_t seed = 1337;
  bool eval_only = false;
  bool skip_eval = false;
  int64_t eval_interval = 0;
  int64_t eval_batch = 32;
  std::string prompt = "The meaning of life is ";
  int64_t sample_bytes = 200;
  double temperature = 0.8;
  std::string json;
  // glibc's mmap threshold: -1 unless given (4 MiB, or the environment's
  // MALLOC_MMAP_THRESHOLD_); 0 leaves glibc's own, which moves. After
  // start-up: the one in force (0: glibc's own).
  int64_t malloc_mmap_threshold = -1;
  examples::ProgressOptions progress;
  examples::CheckpointFlags checkpoint;
};

// "5GB", "200MB", "64KiB", "1000": bytes (decimal units as Hugging Face
// reads them; the binary ones too).
int64_t parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw CLI::ValidationError("--max-shard-size", "'" + s + "' is not a size (e.g. 5GB, 200MB)");
  }
  const std::string unit = s.substr(used);
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "KiB") mult = 1024.0;
  else if (unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "GiB") mult = 1024.0 * 1024 * 1024;
  if (mult == 0 || !(v * mult >= 1) || v * mult > 1e15) {
    throw CLI::ValidationError("--max-shard-size", "'" + s + "' is not a size (e.g. 5GB, 200MB)");
  }
  return static_cast<int64_t>(v * mult);
}

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app{"GPT-2 (Hugging Face's layout) on byte-level text with FSDP or DDP.", "gpt"};
  // An option given twice takes its last value (a script's defaults, then the user's).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--fsdp", a.fsdp, "FSDP sharding, each block a unit: full (ZeRO-3), grad_op (ZeRO-2), no (NO_SHARD)")
      ->check(CLI::IsMember({"full", "grad_op", "no"}))->capture_default_str();
  app.add_flag("--ddp", a.ddp, "DistributedDataParallel instead of FSDP");
  app.add_option("--init", a.init,
                 "deferred: build the model with no memory and make it one FSDP unit at a time (with "
                 "--from-pretrained the files' values are the first the shards hold); eager: build it whole "
                 "on every rank first")
      ->check(CLI::IsMember({"deferred", "eager"}))->capture_default_str();
  app.add_option("--precision", a.precision, "fp32, or bf16 (FSDP mixed precision)")
      ->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  app.add_flag("--activation-checkpointing", a.activation_checkpointing, "recompute each block's activations in backward");
  app.add_option("--device", a.device, "where the model trains: cpu, or cuda (LOCAL_RANK's GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  examples::add_backend_flag(app, a.backend);
  app.add_option("--from-pretrained", a.from_pretrained, "a Hugging Face GPT-2 directory (config.json + safetensors)")
      ->type_name("DIR");
  app.add_option("--save-pretrained", a.save_pretrained, "write the trained model there, as Hugging Face does")
      ->type_name("DIR");
  app.add_option("--max-shard-size", a.max_shard_size, "--save-pretrained's largest file (5GB, 200MB, ...)")
      ->capture_default_str();
  app.add_option("--data", a.data, "train on this file's bytes (default: Debian's fortunes)")->type_name("FILE");
  app.add_option("--steps", a.steps, "training steps (0: none)")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--batch-size", a.batch_size, "windows per rank and step")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--block-size", a.block_size,
                 "tokens per window (default: 128, or a pretrained model's n_positions when that is smaller)")
      ->check(examples::positive());
  app.add_option("--n-layer", a.n_layer, "a fresh model's blocks")->check(examples::positive())->capture_default_str();
  app.add_option("--n-head", a.n_head, "a fresh model's attention heads")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--n-embd", a.n_embd, "a fresh model's width (a multiple of --n-head)")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--dropout", a.dropout, "a fresh model's dropout")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  app.add_option("--lr", a.lr, "peak learning rate (AdamW)")->check(examples::positive())->capture_default_str();
  app.add_option("--min-lr", a.min_lr, "the cosine decay's floor")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--weight-decay", a.weight_decay, "on weight matrices and embeddings")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--grad-clip", a.grad_clip, "clip the global gradient norm (0: off)")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "linear warmup steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--seed", a.seed, "seeds the fresh model's weights, the batches and the sample")->capture_default_str();
  app.add_flag("--eval-only", a.eval_only, "no training: print the validation loss");
  app.add_flag("--skip-eval", a.skip_eval,
               "no validation at the end (a big shape's timing run: the full split costs far more than a few steps)");
  app.add_option("--eval-interval", a.eval_interval, "also evaluate every N steps (0: at the end only)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--eval-batch", a.eval_batch, "validation windows per forward")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--prompt", a.prompt, "the text rank 0 continues at the end")->capture_default_str();
  app.add_option("--sample-bytes", a.sample_bytes, "bytes sampled after the prompt (0: none)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--temperature", a.temperature, "the sample's softmax temperature")->check(examples::positive())
      ->capture_default_str();
  app.add_option("--json", a.json, "rank 0 writes the results here")->type_name("FILE");
  app.add_option("--malloc-mmap-threshold", a.malloc_mmap_threshold,
                 "glibc's mmap threshold in bytes: tensors this big get memory of their own, returned when freed "
                 "(default 4194304, or MALLOC_MMAP_THRESHOLD_; 0: glibc's own, faster, up to 1 GB more a job here)")
      ->check(CLI::NonNegativeNumber);
  examples::add_progress_flags(app, a.progress);
  examples::add_checkpoint_flags(app, a.checkpoint);
  try {
    app.parse(argc, argv);
    if (!a.save_pretrained.empty()) parse_size(a.max_shard_size);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);  // --help: 0; a usage error: 2
  }
  const auto usage = [](const std::string& m) {
    std::fprintf(stderr, "gpt: %s\n", m.c_str());
    std::exit(2);
  };
  if (a.n_embd % a.n_head != 0) usage("--n-embd must be a multiple of --n-head");
  if (a.ddp && a.precision == "bf16") {
    usage("--precision bf16 is FSDP's mixed precision: with DDP train in fp32 (or use --fsdp no, DDP's strategy with bf16)");
  }
  if (a.eval_only && a.skip_eval) usage("--eval-only and --skip-eval contradict each other");
  if (a.eval_only) a.steps = 0;
  if (a.prompt.empty() && a.sample_bytes > 0) usage("--prompt must not be empty (or pass --sample-bytes 0)");
  return a;
}


// The model as trained: its root module (for state dicts, saving,
// clipping) and its forward, whatever wraps it.
struct Trained {
  torch::nn::Module* root = nullptr;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<double(double)> clip;  // returns the norm before clipping
  std::function<void(bool)> train_mode;
  std::shared_ptr<void> keep;  // the wrapper
  int64_t parameters = 0;      // the whole model's, each tied one once
};

Trained build(const Args& a, const examples::GptConfig& cfg, const c10::Device& device) {
  examples::GptModelImpl::MakeBlock plain_checkpointed;
  if (a.activation_checkpointing && a.ddp) {
    plain_checkpointed = [](const examples::GptConfig& c, int64_t i) {
      return torch::nn::AnyModule(tdist::checkpoint_module(examples::GptBlock(c, i)));
    };
  }
  torch::manual_seed(a.seed);
  const auto make = [&] { return examples::GptLMHeadModel(cfg, plain_checkpointed); };
  // Deferred: no memory until FSDP makes each unit (the same values as eager).
  examples::GptLMHeadModel net = a.init == "deferred" ? tdist::deferred_init(make) : make();
  Trained t;
  for (const auto& p : tdist::unique_parameters(*net)) t.parameters += p.numel();
  if (a.ddp) {
    tdist::materialize_module(*net);  // DDP keeps the whole model on every rank
    net->to(device);
    auto ddp = std::make_shared<tdist::DistributedDataParallel<examples::GptLMHeadModel>>(net);
    t.root = ddp->get();
    t.forward = [ddp](const torch::Tensor& x) { return (*ddp)->forward(x); };
    t.clip = [ddp](double max) {
      return torch::nn::utils::clip_grad_norm_(tdist::unique_parameters(**ddp), max);
    };
    t.train_mode = [ddp](bool on) { (*ddp)->train(on); };
    t.keep = ddp;
    return t;
  }
  tdist::FullyShardedDataParallelOptions o;
  o.sharding_strategy = a.fsdp == "full"    ? tdist::ShardingStrategy::FULL_SHARD
                        : a.fsdp == "grad_op" ? tdist::ShardingStrategy::SHARD_GRAD_OP
                                              : tdist::ShardingStrategy::NO_SHARD;
  if (a.precision == "bf16") o.mixed_precision.param_dtype = at::kBFloat16;
  if (device.is_cuda()) o.device_id = device;
  // Pretrained weights go straight into the shards: no initialization first
  // (load_pretrained is strict, so a tensor the files lack is an error).
  o.skip_init = a.init == "deferred" && !a.from_pretrained.empty();  // the files give the first values
  if (a.activation_checkpointing) {
    o.auto_wrapper_callable = [](torch::nn::AnyModule m, const tdist::FullyShardedDataParallelOptions& c) {
      return torch::nn::AnyModule(tdist::FullyShardedDataParallel(tdist::checkpoint_module(std::move(m)), c));
    };
  }
  tdist::FullyShardedDataParallelOptions root = o;
  root.auto_wrap_policy = tdist::transformer_auto_wrap_policy<examples::GptBlock>();
  auto fsdp = std::make_shared<tdist::FSDP<examples::GptLMHeadModel>>(net, root);
  t.root = fsdp->get();
  t.forward = [fsdp](const torch::Tensor& x) { return (*fsdp)->forward(x); };
  t.clip = [fsdp](double max) { return (*fsdp)->clip_grad_norm_(max); };
  t.train_mode = [fsdp](bool on) { (*fsdp)->train(on); };
  t.keep = fsdp;
  return t;
}

// Mean cross-entropy of logits [b, t, v] against targets [b, t], summed.
torch::Tensor ce_sum(const torch::Tensor& logits, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), y.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

// The validation loss: every rank takes a contiguous share of the windows;
// every rank runs the same number of forwards (FSDP's are collective).
double validation_loss(const Args& a, const examples::ByteText& text, Trained& m, tdist::ProcessGroup& pg,
                       const c10::Device& device) {
  const int64_t windows = text.val_windows(a.block_size);
  if (windows == 0) {
    throw std::runtime_error("the validation text (" + std::to_string(text.val_bytes()) +
                             " bytes) holds no window of " + std::to_string(a.block_size + 1) + " bytes");
  }
  const int rank = pg.rank(), world = pg.size();
  const int64_t per = (windows + world - 1) / world;
  const int64_t first = std::min(windows, rank * per), last = std::min(windows, first + per);
  const int64_t batches = (per + a.eval_batch - 1) / a.eval_batch;
  m.train_mode(false);
  torch::NoGradGuard no_grad;
  double sum = 0;
  for (int64_t b = 0; b < batches; ++b) {
    const int64_t from = first + b * a.eval_batch, count = std::max<int64_t>(0, std::min(a.eval_batch, last - from));
    auto [x, y] = text.val_batch(from, std::max<int64_t>(count, 1), a.block_size);  // a stand-in when none are left
    const torch::Tensor logits = m.forward(x.to(device));
    // A window at a time: its fp32 logits and log-softmax, vocabulary-wide,
    // are the only bytes the loss adds (not the whole batch's: 2 x 100 MiB
    // a rank for GPT-2 at --eval-batch 4, block 128).
    const torch::Tensor targets = y.to(device);
    for (int64_t i = 0; i < count; ++i) sum += ce_sum(logits[i], targets[i]).item<double>();
  }
  m.train_mode(true);
  torch::Tensor total = torch::tensor({sum}, torch::kDouble);
  pg.all_reduce(total)->wait();
  return total.item<double>() / static_cast<double>(windows * a.block_size);
}

// Samples a continuation of the prompt (every rank runs the forwards; rank
// 0's draw is broadcast, so all agree).
std::string sample(const Args& a, Trained& m, tdist::ProcessGroup& pg, const c10::Device& device, int64_t vocab) {
  std::string out = a.prompt;
  m.train_mode(false);
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(a.seed + 7);
  for (int64_t i = 0; i < a.sample_bytes; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(out.size()) - a.block_size);
    torch::Tensor x = torch::empty({1, static_cast<int64_t>(out.size()) - start}, torch::kLong);
    int64_t* px = x.data_ptr<int64_t>();
    for (int64_t j = start; j < static_cast<int64_t>(out.size()); ++j) px[j - start] = static_cast<uint8_t>(out[j]);
    const torch::Tensor logits = m.forward(x.to(device)).select(1, -1).squeeze(0).to(torch::kFloat).cpu();
    // Only bytes: ids past 255 (a pretrained model's larger vocabulary) are never drawn.
    torch::Tensor probs = torch::softmax(logits.narrow(0, 0, std::min<int64_t>(vocab, 256)) / a.temperature, -1);
    torch::Tensor tok = torch::multinomial(probs, 1, false, gen);
    pg.broadcast(tok)->wait();  // from rank 0
    out.push_back(static_cast<char>(tok.item<int64_t>()));
  }
  m.train_mode(true);
  return out;
}

// Learning rate at `step`: linear warmup, then cosine decay to min_lr.
double lr_at(const Args& a, int64_t step) {
  if (step < a.warmup) return a.lr * static_cast<double>(step + 1) / static_cast<double>(a.warmup);
  const int64_t decay = std::max<int64_t>(1, a.steps - a.warmup);
  const double progress = std::min(1.0, static_cast<double>(step - a.warmup) / static_cast<double>(decay));
  return a.min_lr + 0.5 * (1 + std::cos(M_PI * progress)) * (a.lr - a.min_lr);
}

examples::GptConfig config_of(const Args& a, nlohmann::ordered_json& base) {
  if (a.from_pretrained.empty()) {
    examples::GptConfig c;
    c.n_layer = a.n_layer;
    c.n_head = a.n_head;
    c.n_embd = a.n_embd;
    c.n_positions = a.block_size > 0 ? a.block_size : kDefaultBlockSize;
    c.embd_pdrop = c.attn_pdrop = c.resid_pdrop = a.dropout;
    return c;
  }
  const std::string path = a.from_pretrained + "/config.json";
  const std::string text = examples::read_text_file(path, int64_t{1} << 20);
  try {
    base = examples::gpt_config_parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not JSON (" + e.what() + ")");
  } catch (const std::exception& e) {
    throw std::runtime_error(a.from_pretrained + "/" + e.what());
  }
  try {
    return examples::gpt_config_from_json(base);
  } catch (const std::exception& e) {
    throw std::runtime_error(a.from_pretrained + "/" + e.what());
  }
}

// What one rank holds at its peak, in fp32 bytes. Eager (and DDP): the
// whole model at start-up, and its gradients and AdamW's two moments while
// training. Deferred under FSDP: the model states of its strategy (ZeRO-3:
// parameters, gradients and moments sharded; ZeRO-2: parameters whole; no
// sharding: everything whole) and the largest unit gathered with its
// gradient.
double bytes_per_rank(const Args& a, const examples::GptConfig& cfg, int world) {
  const double p = static_cast<double>(cfg.parameter_count());
  if (a.ddp || a.init == "eager" || a.fsdp == "no") return 16 * p;
  const double e = static_cast<double>(cfg.n_embd), inner = static_cast<double>(cfg.inner());
  const double block = 4 * e + 3 * e * e + 3 * e + e * e + e + e * inner + inner + inner * e + e;
  const double root = static_cast<double>(cfg.vocab_size + cfg.n_positions) * e + 2 * e +
                      (cfg.tie_word_embeddings ? 0 : static_cast<double>(cfg.vocab_size) * e);
  const double unit = std::max(block, root);
  const double w = std::max(1, world);
  const double states = a.fsdp == "full" ? 16 * p / w : 4 * p + 12 * p / w;
  return states + 8 * unit;
}

// Refuse a size this machine cannot hold, naming where it came from,
// before allocating any of it.
void check_fits(const Args& a, const examples::GptConfig& cfg, int world) {
  const int64_t params = cfg.parameter_count();
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int64_t ranks = std::max<int64_t>(1, local ? std::atoll(local) : 1);
  const double per_rank = bytes_per_rank(a, cfg, world);
  const double need = per_rank * static_cast<double>(ranks);
  const int64_t available = examples::proc_field_bytes("/proc/meminfo", "MemAvailable");
  if (available <= 0 || need <= static_cast<double>(available)) return;
  const std::string from = a.from_pretrained.empty() ? std::string("--n-layer/--n-head/--n-embd/--block-size")
                                                     : a.from_pretrained + "/config.json (n_layer, n_embd, n_inner, "
                                                                           "vocab_size, n_positions)";
  char msg[640];
  std::snprintf(msg, sizeof msg,
                "%s: a model of %.1f M parameters needs %.1f GiB on each of this node's %lld ranks (%s), "
                "and this machine has %.1f GiB available",
                from.c_str(), static_cast<double>(params) / 1e6, per_rank / (1 << 30), static_cast<long long>(ranks),
                a.ddp || a.init == "eager" || a.fsdp == "no" ? "the whole model, its gradients and AdamW's moments"
                                                             : "its shards of the model states and the largest unit",
                static_cast<double>(available) / (1 << 30));
  throw std::runtime_error(msg);
}

c10::Device device_of(const Args& a) {
  if (a.device == "cpu") return c10::Device(c10::kCPU);
  if (!torch::cuda::is_available()) throw std::runtime_error("--device cuda: this machine has no usable CUDA device");
  const char* local = std::getenv("LOCAL_RANK");
  const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>((local ? std::atoll(local) : 0) % n));
}

// --block-size: as given, or the default (kDefaultBlockSize, at most the
// model's n_positions). A run that uses windows (training, evaluation, a
// sample) refuses one longer than the model's n_positions; a conversion
// (--steps 0 --skip-eval --sample-bytes 0) uses none and checks nothing.
int64_t block_size_of(const Args& a, const examples::GptConfig& cfg) {
  if (a.block_size == 0) return std::min(kDefaultBlockSize, cfg.n_positions);
  const bool uses_windows = a.steps > 0 || !a.skip_eval || a.sample_bytes > 0;
  if (uses_windows && a.block_size > cfg.n_positions) {
    throw std::runtime_error("--block-size " + std::to_string(a.block_size) + " is longer than the model's n_positions (" +
                             std::to_string(cfg.n_positions) + ")");
  }
  return a.block_size;
}

// The text, where the run reads any (training or evaluation); else empty.
examples::ByteText text_of(const Args& a) {
  if (a.steps == 0 && a.skip_eval) return examples::ByteText(std::string());
  return examples::ByteText(a.data.empty() ? examples::fortunes_corpus() : examples::read_text_file(a.data));
}

int run(const Args& args, tdist::ProcessGroup& pg) {
  const int rank = pg.rank(), world = pg.size();
  const auto t_start = std::chrono::steady_clock::now();
  const c10::Device device = device_of(args);
  nlohmann::ordered_json base;
  const examples::GptConfig cfg = config_of(args, base);
  check_fits(args, cfg, world);
  Args a = args;
  a.block_size = block_size_of(args, cfg);
  const examples::ByteText text = text_of(a);
  const int64_t rss0 = examples::proc_status_bytes("VmRSS");
  Trained m = build(a, cfg, device);
  if (!a.from_pretrained.empty()) {
    tdist::LoadPretrainedOptions lo;
    lo.base_model_prefix = "transformer";
    lo.ignore_unexpected = {R"(.*\.attn\.(masked_)?bias)"};  // older checkpoints' causal masks (whole key)
    const auto report = tdist::load_pretrained(*m.root, a.from_pretrained, lo);
    if (rank == 0) {
      std::printf("loaded %zu tensors from %s (%zu files)\n", report.loaded.size(), a.from_pretrained.c_str(),
                  report.files.size());
    }
  }
  // Start-up's peak (the model built, sharded and loaded): every rank's.
  torch::Tensor startup = torch::zeros({world}, torch::kDouble);
  startup[rank] = static_cast<double>(examples::proc_status_bytes("VmHWM"));
  pg.all_reduce(startup)->wait();
  const int64_t params = m.parameters;
  if (rank == 0) {
    std::printf("start-up (--init %s): peak RSS per rank:", a.init.c_str());
    for (int r = 0; r < world; ++r) std::printf(" %.0f MiB", startup[r].item<double>() / (1 << 20));
    std::printf(" (before the model: %.0f MiB)\n", static_cast<double>(rss0) / (1 << 20));
    std::printf("GPT-2: %lld layers, %lld heads, %lld wide, vocabulary %lld, %.2f M parameters; %s, %d ranks, %s\n",
                static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_head),
                static_cast<long long>(cfg.n_embd), static_cast<long long>(cfg.vocab_size), params / 1e6,
                a.ddp ? "DDP" : ("FSDP " + a.fsdp).c_str(), world, a.precision.c_str());
    if (text.size() > 0) {
      std::printf("text: %lld bytes for training, %lld for validation\n", static_cast<long long>(text.train_bytes()),
                  static_cast<long long>(text.val_bytes()));
    }
  }

  // AdamW with weight decay on matrices and embeddings, none on biases and
  // LayerNorms; each tied parameter once.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : tdist::unique_parameters(*m.root)) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(a.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(0)));
  torch::optim::AdamW opt(std::move(groups));

  nlohmann::ordered_json curve = nlohmann::ordered_json::array();
  const auto evaluate = [&](int64_t step) {
    const double v = validation_loss(a, text, m, pg, device);
    curve.push_back({{"step", step}, {"val_loss", v}});
    if (rank == 0 && a.steps > 0) std::printf("step %lld: val_loss %.4f\n", static_cast<long long>(step), v);
    return v;
  };
  // --checkpoint-dir: resume from the latest checkpoint there (at the step
  // it was saved at; the batches are a function of the step), save every
  // --checkpoint-every steps.
  int64_t first_step = 0;
  std::unique_ptr<tdist::Checkpointer> ckpt;
  if (!a.checkpoint.dir.empty()) {
    tdist::CheckpointerOptions co;
    co.dir = a.checkpoint.dir;
    co.every_steps = a.checkpoint.every;
    ckpt = std::make_unique<tdist::Checkpointer>(tdist::default_group(), *m.root, &opt, co);
    if (auto r = ckpt->restore()) {
      first_step = std::min(r->step, a.steps);
      if (rank == 0) {
        std::printf("resumed from %s (step %lld, saved at world size %d)\n", r->path.c_str(),
                    static_cast<long long>(r->step), r->saved_world_size);
        std::fflush(stdout);  // a log (a pipe) sees it now: resuming is timed by it
      }
    }
  }
  if (a.eval_interval > 0 && a.steps > 0 && first_step == 0) evaluate(0);

  examples::ProgressOptions po = a.progress;
  po.rank = rank;
  po.unit = "tokens";
  examples::Progress bar(po);
  bar.start(a.steps - first_step);
  double train_seconds = 0;
  std::vector<double> losses, step_ms;
  for (int64_t step = first_step; step < a.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr_at(a, step));
    auto [x, y] = text.train_batch(a.seed, step, rank, world, a.batch_size, a.block_size);
    torch::Tensor loss = ce_sum(m.forward(x.to(device)), y.to(device)) / static_cast<double>(x.numel());
    loss.backward();
    if (a.grad_clip > 0) m.clip(a.grad_clip);
    opt.step();
    // zero_grad(set_to_none), 2.x's default, on 1.13 too, and at once: no
    // gradient is held through an evaluation, a save or the next forward
    // (each unit's arrives with its backward).
    for (auto& group : opt.param_groups()) {
      for (auto& p : group.params()) p.mutable_grad().reset();
    }
    // The global batch's loss (every rank's mean, averaged) for the display and the JSON.
    torch::Tensor l = loss.detach().to(torch::kDouble).cpu().reshape({1});
    pg.all_reduce(l, {tdist::ReduceOp::AVG})->wait();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    train_seconds += secs;
    step_ms.push_back(1000 * secs);
    losses.push_back(l.item<double>());
    bar.step(x.numel() * world, losses.back());
    if (a.eval_interval > 0 && (step + 1) % a.eval_interval == 0 && step + 1 < a.steps) {
      bar.finish();
      evaluate(step + 1);
    }
    if (ckpt) ckpt->maybe_save(step + 1);
  }
  bar.finish();
  if (ckpt) ckpt->wait();
  // Peak memory of training (before the evaluation and the save).
  torch::Tensor mem = torch::zeros({world}, torch::kDouble);
  mem[rank] = static_cast<double>(examples::proc_status_bytes("VmHWM"));
  pg.all_reduce(mem)->wait();
  // The trained weights' fingerprint for the JSON, after the peak is read
  // (collective under FSDP: every rank gathers the full state dict, unit by
  // unit, which would raise it).
  std::string weights_fingerprint;
  if (!a.json.empty()) {
    std::vector<torch::Tensor> weights;
    for (const auto& item : tdist::full_state_dict(*m.root)) weights.push_back(item.value());
    weights_fingerprint = examples::fingerprint(weights);
  }
  // Speed: the median step after two warm-up steps, the slowest rank's.
  torch::Tensor ms = torch::tensor(step_ms.empty() ? std::vector<double>{0.0} : step_ms, torch::kDouble);
  pg.all_reduce(ms, {tdist::ReduceOp::MAX})->wait();
  const int64_t warm = std::min<int64_t>(2, ms.numel() - 1);
  const double median_ms = ms.slice(0, warm).median().item<double>();
  const double tokens_per_s = median_ms > 0 ? static_cast<double>(a.batch_size * a.block_size * world) / (median_ms / 1000) : 0;
  const double val = a.skip_eval ? std::nan("") : evaluate(a.steps);
  std::string continuation;
  if (a.sample_bytes > 0) continuation = sample(a, m, pg, device, cfg.vocab_size);
  if (!a.save_pretrained.empty()) {
    tdist::SavePretrainedOptions so;
    so.max_shard_size = parse_size(a.max_shard_size);
    so.config_json = examples::gpt_config_to_json(cfg, base).dump(2);
    if (a.ddp) {
      if (rank == 0) tdist::save_pretrained(*m.root, a.save_pretrained, so);
      pg.barrier()->wait();
    } else {
      tdist::save_pretrained(*m.root, a.save_pretrained, so);
    }
  }
  if (rank == 0) {
    if (!continuation.empty()) std::printf("sample:\n%s\n", continuation.c_str());
    if (a.steps > 0) {
      std::printf("%lld steps in %.1f s: %.0f tokens/s (median step %.1f ms); peak RSS per rank:",
                  static_cast<long long>(a.steps), train_seconds, tokens_per_s, median_ms);
      for (int r = 0; r < world; ++r) std::printf(" %.0f MiB", mem[r].item<double>() / (1 << 20));
      std::printf("\n");
    }
    if (!a.save_pretrained.empty()) std::printf("saved to %s\n", a.save_pretrained.c_str());
    if (!a.skip_eval) std::printf("val_loss=%.8f\n", val);
    std::fflush(stdout);
    if (!a.json.empty()) {
      nlohmann::ordered_json j;
      j["val_loss"] = a.skip_eval ? nlohmann::ordered_json() : nlohmann::ordered_json(val);
      j["val_curve"] = curve;
      j["train_loss"] = losses;
      j["steps"] = a.steps;
      j["world_size"] = world;
      j["mode"] = a.ddp ? "ddp" : "fsdp_" + a.fsdp;
      j["precision"] = a.precision;
      j["parameters"] = params;
      j["tokens_per_s"] = tokens_per_s;
      j["ms_per_step"] = median_ms;
      j["step_ms"] = std::vector<double>(ms.data_ptr<double>(), ms.data_ptr<double>() + ms.numel());
      j["train_seconds"] = train_seconds;
      j["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      j["peak_rss_bytes"] = std::vector<double>(mem.data_ptr<double>(), mem.data_ptr<double>() + world);
      j["rss_before_model_bytes"] = rss0;
      j["init"] = a.init;
      j["malloc_mmap_threshold"] = a.malloc_mmap_threshold;
      j["startup_peak_rss_bytes"] = std::vector<double>(startup.data_ptr<double>(), startup.data_ptr<double>() + world);
      j["sample"] = continuation;
      j["weights_fingerprint"] = weights_fingerprint;
      if (!examples::write_json("gpt", a.json, j)) return 1;
    }
  }
  pg.barrier()->wait();
  return 0;
}

}  // namespace

// glibc raises its mmap threshold (up to 32 MiB) each time a tensor it
// mmapped is freed; then every tensor below it comes from the heap, whose
// holes between long-lived tensors (AdamW's moments, made at the first
// step) it keeps: 170-630 MiB a rank more in a step of the world-8 GPT-2
// medium run (docs/deferred-init.md). A fixed threshold keeps the peak
// down for ~15-25 % of the step time there.
// Returns the threshold in force: the one set, the environment's, or 0
// (glibc's own).
int64_t set_malloc_mmap_threshold(int64_t given) {
#if defined(__GLIBC__)
  const char* env = std::getenv("MALLOC_MMAP_THRESHOLD_");
  if (given < 0 && env) return std::strtoll(env, nullptr, 10);  // glibc read it at start-up
  const int64_t bytes = given < 0 ? int64_t{4} << 20 : given;
  if (bytes > 0 && mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min<int64_t>(bytes, int64_t{1} << 30))) != 1) {
    std::fprintf(stderr, "gpt: glibc refused --malloc-mmap-threshold %lld\n", static_cast<long long>(bytes));
    std::exit(2);
  }
  return bytes;
#else
  (void)given;
  return 0;
#endif
}

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  a.malloc_mmap_threshold = set_malloc_mmap_threshold(a.malloc_mmap_threshold);
  return examples::run_example("gpt", a.backend, [&](tdist::ProcessGroup& pg) { return run(a, pg); });
}

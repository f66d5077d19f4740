// PowerSGD hooks. The hook itself (on the thread that runs backward) adds
// the error feedback and plans the bucket; the later steps run as a chain
// on the group's worker thread, each starting the next all-reduce, so every
// rank issues the same collectives in the same order.
#include "tdist/powersgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "process_group/group_or_default.h"

namespace tdist {

struct PowerSGDState::Bucket {
  at::Tensor error;  // error feedback, in the working dtype
  at::Tensor q;      // Q memory (warm start)
  at::Tensor p;      // P scratch
};

namespace {

void log_line(const std::string& msg) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "[tdist] " << msg << std::endl;
}

// Orthogonalisation and the products run in fp32 at least.
at::ScalarType working_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t;
}

// Gram-Schmidt on the columns of each matrix in m [batch, rows, r], in place.
void orthogonalize(const at::Tensor& m, double epsilon) {
  const int64_t r = m.size(2);
  for (int64_t i = 0; i < r; ++i) {
    at::Tensor col = m.select(2, i);  // [batch, rows]
    at::Tensor norm = col.norm(2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      norm = at::where(norm == 0, at::ones_like(norm), norm);
    } else {
      norm = norm + epsilon;
    }
    col.div_(norm);
    if (i + 1 < r) {
      at::Tensor rest = m.narrow(2, i + 1, r - i - 1);
      rest.sub_(col.unsqueeze(2) * at::bmm(col.unsqueeze(1), rest));
    }
  }
}

// The options a checkpoint must agree on, as saved.
std::vector<double> saved_options(const PowerSGDOptions& o) {
  return {static_cast<double>(o.matrix_approximation_rank), static_cast<double>(o.start_powerSGD_iter),
          o.min_compression_rate, static_cast<double>(o.use_error_feedback), static_cast<double>(o.warm_start),
          o.orthogonalization_epsilon, static_cast<double>(o.batch_tensors_with_same_shape)};
}

// Gradients in the bucket buffer: element offset, shape.
struct Slot {
  int64_t offset;
  at::IntArrayRef sizes;
  int64_t numel;
};

std::vector<Slot> slots_of(const GradBucket& bucket) {
  std::vector<Slot> slots;
  int64_t offset = 0;
  for (const auto& g : bucket.gradients()) {
    slots.push_back({offset, g.sizes(), g.numel()});
    offset += g.numel();
  }
  if (offset != bucket.buffer().numel()) {
    throw UsageError("PowerSGD: the bucket's gradients hold " + std::to_string(offset) +
                     " elements but its buffer " + std::to_string(bucket.buffer().numel()));
  }
  return slots;
}

}  // namespace

struct PowerSGDAccess {
  // Returns the bucket's memories (fresh ones if the bucket's size changed)
  // and counts the step; nullptr while still in the plain all-reduce phase.
  static std::shared_ptr<PowerSGDState::Bucket> begin(PowerSGDState& s, const GradBucket& bucket,
                                                      int64_t padded_numel, int64_t numel_after,
                                                      int64_t bytes_sent, at::ScalarType wdt, int64_t& iter) {
    std::lock_guard<std::mutex> lock(s.mu_);
    iter = s.iter_;
    const bool compressing = s.iter_ >= s.options_.start_powerSGD_iter;
    const int64_t es = static_cast<int64_t>(c10::elementSize(bucket.buffer().scalar_type()));
    std::shared_ptr<PowerSGDState::Bucket> mem;
    if (compressing) {
      auto& slot = s.buckets_[bucket.index()];
      if (slot && slot->error.defined() && slot->error.numel() != padded_numel) {
        log_line("PowerSGD: bucket " + std::to_string(bucket.index()) + " changed size (" +
                 std::to_string(slot->error.numel()) + " -> " + std::to_string(padded_numel) +
                 " elements); its error feedback and Q memory start afresh");
        slot.reset();
      }
      if (!slot) slot = std::make_shared<PowerSGDState::Bucket>();
      mem = slot;
      // Memories loaded from a checkpoint are CPU tensors of the saved
      // dtype: onto the bucket's device, in the working dtype.
      const auto adapt = [&](at::Tensor& t) {
        if (t.defined() && (t.device() != bucket.buffer().device() || t.scalar_type() != wdt)) {
          t = t.to(bucket.buffer().device(), wdt);
        }
      };
      adapt(mem->error);
      adapt(mem->q);
      if (s.options_.use_error_feedback && !mem->error.defined()) {
        mem->error = at::zeros({padded_numel}, bucket.buffer().options().dtype(wdt));
      }
      s.stats_.numel_before += bucket.buffer().numel();
      s.stats_.numel_after += numel_after;
      s.stats_.bytes_before += bucket.buffer().numel() * es;
      s.stats_.bytes_after += bytes_sent;
      s.stats_.bytes_communicated += bytes_sent;
    } else {
      s.stats_.bytes_communicated += bucket.buffer().numel() * es;
    }
    if (bucket.is_last()) {
      ++s.iter_;
      if (s.iter_ == s.options_.start_powerSGD_iter && s.iter_ > 0) {
        log_line("PowerSGD: compression starts after " + std::to_string(s.iter_) + " iterations");
      }
      if (compressing && s.iter_ >= s.next_stats_report_) {
        std::ostringstream os;
        os << "PowerSGD: compression rate " << static_cast<double>(s.stats_.numel_before) / s.stats_.numel_after
           << " (" << s.stats_.bytes_before << " bytes before, " << s.stats_.bytes_after << " after) at iteration "
           << s.iter_;
        log_line(os.str());
        s.next_stats_report_ = s.iter_ + s.options_.compression_stats_logging_frequency;
      }
    }
    return mem;
  }

  // A fresh random Q, the same on every rank.
  static at::Tensor random(PowerSGDState& s, at::IntArrayRef sizes, const at::TensorOptions& o) {
    std::lock_guard<std::mutex> lock(s.mu_);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s.rng_());
    // Drawn on the CPU (the generator's device) and moved: the same Q on
    // every rank and every device.
    return at::randn(sizes, gen, o.device(at::kCPU)).to(o.device());
  }

  static void fell_back(PowerSGDState& s, size_t bucket, int64_t iter) {
    {
      std::lock_guard<std::mutex> lock(s.mu_);
      ++s.stats_.nonfinite_fallbacks;
    }
    log_line("PowerSGD: a gradient in bucket " + std::to_string(bucket) + " at iteration " + std::to_string(iter) +
             " is not finite on some rank; this step uses plain all-reduce and leaves the error feedback as it was");
  }

  static const PowerSGDOptions& options(const PowerSGDState& s) { return s.options_; }
  static std::shared_ptr<ProcessGroup> group(const PowerSGDState& s) { return detail::group_or_default(s.group_, "PowerSGD"); }
};

PowerSGDState::PowerSGDState(std::shared_ptr<ProcessGroup> group, PowerSGDOptions options)
    : group_(std::move(group)), options_(options), rng_(options.random_seed) {
  if (options_.matrix_approximation_rank < 1) throw UsageError("PowerSGDState: matrix_approximation_rank must be >= 1");
  if (options_.min_compression_rate < 0) throw UsageError("PowerSGDState: min_compression_rate must be >= 0");
  if (options_.compression_stats_logging_frequency < 1) {
    throw UsageError("PowerSGDState: compression_stats_logging_frequency must be >= 1");
  }
  if ((options_.use_error_feedback || options_.warm_start) && options_.start_powerSGD_iter <= 1) {
    throw UsageError("PowerSGDState: start_powerSGD_iter must be > 1 with use_error_feedback or warm_start, "
                     "because DDP rebuilds its buckets after the first iteration");
  }
  next_stats_report_ = options_.start_powerSGD_iter;
}

int64_t PowerSGDState::iter() const {
  std::lock_guard<std::mutex> lock(mu_);
  return iter_;
}

CompressionStats PowerSGDState::compression_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  CompressionStats s = stats_;
  s.compression_rate = s.numel_after > 0 ? static_cast<double>(s.numel_before) / s.numel_after : 0;
  return s;
}

at::Tensor PowerSGDState::error_feedback(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buckets_.find(index);
  if (it == buckets_.end() || !it->second->error.defined()) return at::Tensor();
  return it->second->error.clone();
}

// ---- the per-gradient hook --------------------------------------------------

namespace {

// One product job: k matrices of one shape [k, n, m], with their P [k, n, r]
// and Q [k, m, r] in the bucket's P and Q memories.
struct Job {
  std::vector<int64_t> offsets;  // where each matrix lives in the buffer
  int64_t n, m, r;
  at::Tensor mats;  // [k, n, m]: views of the corrected gradient, or a stacked copy
  at::Tensor p, q;
};

struct Step {
  std::shared_ptr<PowerSGDState> state;
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<PowerSGDState::Bucket> mem;
  size_t index;
  int64_t iter;
  at::Tensor buffer;     // the bucket's buffer: receives the result
  at::Tensor corrected;  // gradient + error feedback, working dtype
  at::Tensor uncompressed;  // packed uncompressed gradients + the non-finite flag
  std::vector<std::pair<int64_t, int64_t>> plain;  // (offset, numel) of the uncompressed gradients
  std::vector<Job> jobs;
  bool fallback = false;
  int world = 1;

  std::shared_ptr<Work> after_uncompressed() {
    const int64_t flag_at = uncompressed.numel() - 1;
    if (uncompressed[flag_at].item<double>() > 0) {
      fallback = true;
      PowerSGDAccess::fell_back(*state, index, iter);
      return group->all_reduce(buffer, {ReduceOp::AVG});
    }
    uncompressed.narrow(0, 0, flag_at).div_(world);
    int64_t at_ = 0;
    for (const auto& [offset, numel] : plain) {
      buffer.narrow(0, offset, numel).copy_(uncompressed.narrow(0, at_, numel));
      at_ += numel;
    }
    const double eps = PowerSGDAccess::options(*state).orthogonalization_epsilon;
    for (auto& j : jobs) {
      orthogonalize(j.q, eps);
      at::bmm_out(j.p, j.mats, j.q);
    }
    return group->all_reduce(mem->p);
  }

  std::shared_ptr<Work> after_p() {
    if (fallback) return Work::completed({});
    const double eps = PowerSGDAccess::options(*state).orthogonalization_epsilon;
    for (auto& j : jobs) {
      orthogonalize(j.p, eps);
      at::bmm_out(j.q, j.mats.transpose(1, 2), j.p);
    }
    return group->all_reduce(mem->q);
  }

  std::vector<at::Tensor> decompress() {
    if (fallback) return {buffer};
    mem->q.div_(world);
    for (auto& j : jobs) {
      at::Tensor approx = at::bmm(j.p, j.q.transpose(1, 2));  // [k, n, m]
      for (size_t k = 0; k < j.offsets.size(); ++k) {
        buffer.narrow(0, j.offsets[k], j.n * j.m).view({j.n, j.m}).copy_(approx[static_cast<int64_t>(k)]);
      }
    }
    const auto& o = PowerSGDAccess::options(*state);
    if (o.use_error_feedback) at::sub_out(mem->error, corrected, buffer.to(corrected.scalar_type()));
    if (!o.warm_start) mem->q = at::Tensor();
    return {buffer};
  }
};

}  // namespace

std::shared_ptr<Work> powerSGD_hook(const std::shared_ptr<PowerSGDState>& state, GradBucket& bucket) {
  if (!state) throw UsageError("powerSGD_hook: the state is null");
  const auto& o = PowerSGDAccess::options(*state);
  auto group = PowerSGDAccess::group(*state);
  at::Tensor buffer = bucket.buffer();
  const auto wdt = working_dtype(buffer.scalar_type());
  const auto slots = slots_of(bucket);

  // Plan: which gradients are worth compressing.
  std::vector<std::pair<int64_t, int64_t>> plain;
  struct Mat {
    int64_t offset, n, m, r;
  };
  std::vector<Mat> mats;
  int64_t numel_after = 0, plain_numel = 0, p_numel = 0, q_numel = 0;
  for (const auto& s : slots) {
    if (s.sizes.size() >= 2 && s.numel > 0) {
      const int64_t n = s.sizes[0], m = s.numel / n;
      const int64_t r = std::min({n, m, o.matrix_approximation_rank});
      if (static_cast<double>((n + m) * r) * o.min_compression_rate < static_cast<double>(n * m)) {
        mats.push_back({s.offset, n, m, r});
        numel_after += (n + m) * r;
        p_numel += n * r;
        q_numel += m * r;
        continue;
      }
    }
    plain.emplace_back(s.offset, s.numel);
    numel_after += s.numel;
    plain_numel += s.numel;
  }
  const int64_t wes = static_cast<int64_t>(c10::elementSize(wdt));
  const int64_t bytes_sent = (plain_numel + 1 + p_numel + q_numel) * wes;
  int64_t iter = 0;
  auto mem = PowerSGDAccess::begin(*state, bucket, buffer.numel(), numel_after, bytes_sent, wdt, iter);
  if (!mem) return group->all_reduce(buffer, {ReduceOp::AVG});

  auto step = std::make_shared<Step>();
  step->state = state;
  step->group = group;
  step->mem = mem;
  step->index = bucket.index();
  step->iter = iter;
  step->buffer = buffer;
  step->world = group->size();
  step->plain = plain;
  const auto wopt = buffer.options().dtype(wdt);
  step->corrected = buffer.to(wdt, /*non_blocking=*/false, /*copy=*/true).view({-1});
  if (o.use_error_feedback) step->corrected.add_(mem->error);

  // Group the matrices into product jobs.
  std::vector<std::vector<size_t>> groups;
  if (o.batch_tensors_with_same_shape) {
    std::map<std::pair<int64_t, int64_t>, size_t> by_shape;
    for (size_t i = 0; i < mats.size(); ++i) {
      auto [it, fresh] = by_shape.emplace(std::make_pair(mats[i].n, mats[i].m), groups.size());
      if (fresh) groups.emplace_back();
      groups[it->second].push_back(i);
    }
  } else {
    for (size_t i = 0; i < mats.size(); ++i) groups.push_back({i});
  }
  if (!mem->p.defined() || mem->p.numel() != p_numel) mem->p = at::empty({p_numel}, wopt);
  if (!mem->q.defined() || mem->q.dim() != 1 || mem->q.numel() != q_numel) {
    mem->q = PowerSGDAccess::random(*state, {q_numel}, wopt);
  }
  int64_t p_at = 0, q_at = 0;
  for (const auto& g : groups) {
    Job j;
    const Mat& first = mats[g[0]];
    j.n = first.n;
    j.m = first.m;
    j.r = first.r;
    const int64_t k = static_cast<int64_t>(g.size());
    std::vector<at::Tensor> views;
    for (size_t i : g) {
      j.offsets.push_back(mats[i].offset);
      views.push_back(step->corrected.narrow(0, mats[i].offset, j.n * j.m).view({j.n, j.m}));
    }
    j.mats = k == 1 ? views[0].unsqueeze(0) : at::stack(views);
    j.p = mem->p.narrow(0, p_at, k * j.n * j.r).view({k, j.n, j.r});
    j.q = mem->q.narrow(0, q_at, k * j.m * j.r).view({k, j.m, j.r});
    p_at += k * j.n * j.r;
    q_at += k * j.m * j.r;
    step->jobs.push_back(std::move(j));
  }

  // The uncompressed gradients, packed, and one more element: whether this
  // rank's gradient is finite (summed over ranks, every rank decides alike).
  step->uncompressed = at::empty({plain_numel + 1}, wopt);
  int64_t at_ = 0;
  for (const auto& [offset, numel] : plain) {
    step->uncompressed.narrow(0, at_, numel).copy_(step->corrected.narrow(0, offset, numel));
    at_ += numel;
  }
  step->uncompressed[plain_numel].fill_(at::isfinite(step->corrected).all().item<bool>() ? 0 : 1);

  return group->all_reduce(step->uncompressed)
      ->chain([step](Work&) { return step->after_uncompressed(); })
      ->chain([step](Work&) { return step->after_p(); })
      ->then([step](Work&) { return step->decompress(); });
}

// ---- the batched hook -------------------------------------------------------

namespace {

struct BatchedStep {
  std::shared_ptr<PowerSGDState> state;
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<PowerSGDState::Bucket> mem;
  size_t index;
  int64_t iter;
  at::Tensor buffer;
  at::Tensor corrected;  // padded, [side * side]
  at::Tensor p_and_flag;  // P [side, r], then the non-finite flag
  at::Tensor p;
  int64_t side;
  bool fallback = false;
  int world = 1;

  std::shared_ptr<Work> after_p() {
    if (p_and_flag[p_and_flag.numel() - 1].item<double>() > 0) {
      fallback = true;
      PowerSGDAccess::fell_back(*state, index, iter);
      return group->all_reduce(buffer, {ReduceOp::AVG});
    }
    const double eps = PowerSGDAccess::options(*state).orthogonalization_epsilon;
    at::Tensor p3 = p.unsqueeze(0);
    orthogonalize(p3, eps);
    at::Tensor matrix = corrected.view({side, side});
    at::mm_out(mem->q, matrix.t(), p);
    return group->all_reduce(mem->q);
  }

  std::vector<at::Tensor> decompress() {
    if (fallback) return {buffer};
    mem->q.div_(world);
    at::Tensor approx = at::mm(p, mem->q.t()).view({-1});
    buffer.copy_(approx.narrow(0, 0, buffer.numel()));
    const auto& o = PowerSGDAccess::options(*state);
    if (o.use_error_feedback) at::sub_out(mem->error, corrected, approx);
    if (!o.warm_start) mem->q = at::Tensor();
    return {buffer};
  }
};

}  // namespace

std::shared_ptr<Work> batched_powerSGD_hook(const std::shared_ptr<PowerSGDState>& state, GradBucket& bucket) {
  if (!state) throw UsageError("batched_powerSGD_hook: the state is null");
  const auto& o = PowerSGDAccess::options(*state);
  auto group = PowerSGDAccess::group(*state);
  at::Tensor buffer = bucket.buffer();
  const auto wdt = working_dtype(buffer.scalar_type());
  const int64_t total = buffer.numel();
  const int64_t side = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total)))));
  const int64_t padded = side * side;
  const int64_t r = std::min(side, o.matrix_approximation_rank);
  const int64_t wes = static_cast<int64_t>(c10::elementSize(wdt));
  int64_t iter = 0;
  auto mem = PowerSGDAccess::begin(*state, bucket, padded, 2 * side * r, (2 * side * r + 1) * wes, wdt, iter);
  if (!mem) return group->all_reduce(buffer, {ReduceOp::AVG});

  auto step = std::make_shared<BatchedStep>();
  step->state = state;
  step->group = group;
  step->mem = mem;
  step->index = bucket.index();
  step->iter = iter;
  step->buffer = buffer;
  step->side = side;
  step->world = group->size();
  const auto wopt = buffer.options().dtype(wdt);
  step->corrected = at::zeros({padded}, wopt);
  step->corrected.narrow(0, 0, total).copy_(buffer.view({-1}));
  if (o.use_error_feedback) step->corrected.add_(mem->error);
  if (!mem->q.defined() || mem->q.dim() != 2 || mem->q.size(0) != side || mem->q.size(1) != r) {
    mem->q = PowerSGDAccess::random(*state, {side, r}, wopt);
  }
  at::Tensor q3 = mem->q.unsqueeze(0);
  orthogonalize(q3, o.orthogonalization_epsilon);
  step->p_and_flag = at::empty({side * r + 1}, wopt);
  step->p = step->p_and_flag.narrow(0, 0, side * r).view({side, r});
  at::mm_out(step->p, step->corrected.view({side, side}), mem->q);
  step->p_and_flag[side * r].fill_(at::isfinite(step->corrected).all().item<bool>() ? 0 : 1);

  return group->all_reduce(step->p_and_flag)
      ->chain([step](Work&) { return step->after_p(); })
      ->then([step](Work&) { return step->decompress(); });
}

// ---- checkpoints ------------------------------------------------------------

namespace {

// The longest random state load_state_dict parses: std::mt19937_64 writes
// 312 numbers of at most 20 digits and a separator each (about 6.5 KB).
constexpr size_t kMaxRngText = 16 << 10;

void check_memory(const at::Tensor& t, size_t index, const char* what, bool matrix_allowed) {
  if (!t.defined()) return;
  const std::string where = "PowerSGDState::load_state_dict: bucket " + std::to_string(index) + "'s " + what;
  if (t.layout() != at::kStrided || !at::isFloatingType(t.scalar_type())) {
    throw UsageError(where + " is not a dense floating-point tensor (" + std::string(c10::toString(t.scalar_type())) +
                     ")");
  }
  if (t.dim() != 1 && !(matrix_allowed && t.dim() == 2)) {
    throw UsageError(where + " has " + std::to_string(t.dim()) + " dimensions (" +
                     (matrix_allowed ? "1 or 2" : "1") + " expected)");
  }
  if (t.numel() == 0) throw UsageError(where + " is empty");
}

}  // namespace

PowerSGDStateDict PowerSGDState::state_dict() const {
  std::lock_guard<std::mutex> lock(mu_);
  PowerSGDStateDict out;
  out.options = options_;
  out.iter = iter_;
  std::ostringstream rng;
  rng << rng_;
  out.rng = rng.str();
  out.next_stats_report = next_stats_report_;
  out.stats = stats_;
  out.stats.compression_rate = 0;
  for (const auto& [index, mem] : buckets_) {
    PowerSGDStateDict::Bucket b;
    if (mem->error.defined()) b.error = mem->error.detach().clone();
    if (mem->q.defined()) b.q = mem->q.detach().clone();
    out.buckets.emplace(index, std::move(b));
  }
  return out;
}

void PowerSGDState::load_state_dict(const PowerSGDStateDict& state) {
  const char* what = "PowerSGDState::load_state_dict";
  if (saved_options(state.options) != saved_options(options_)) {
    throw UsageError(std::string(what) + ": the checkpoint was written with different options "
                     "(matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, use_error_feedback, "
                     "warm_start, orthogonalization_epsilon or batch_tensors_with_same_shape)");
  }
  if (state.iter < 0 || state.next_stats_report < 0) {
    throw UsageError(std::string(what) + ": a negative iteration count (" + std::to_string(state.iter) + ", " +
                     std::to_string(state.next_stats_report) + ")");
  }
  const CompressionStats& st = state.stats;
  for (const int64_t v : {st.numel_before, st.numel_after, st.bytes_before, st.bytes_after, st.bytes_communicated,
                          st.nonfinite_fallbacks}) {
    if (v < 0) throw UsageError(std::string(what) + ": a negative compression statistic (" + std::to_string(v) + ")");
  }
  if (state.rng.size() > kMaxRngText) {
    throw UsageError(std::string(what) + ": the random state has " + std::to_string(state.rng.size()) +
                     " characters (at most " + std::to_string(kMaxRngText) + ")");
  }
  std::istringstream rng_text(state.rng);
  std::mt19937_64 rng;
  rng_text >> rng;
  if (rng_text.fail() || !(rng_text >> std::ws).eof()) throw UsageError(std::string(what) + ": the random state is corrupt");
  std::map<size_t, std::shared_ptr<Bucket>> buckets;
  for (const auto& [index, b] : state.buckets) {
    check_memory(b.error, index, "error feedback", /*matrix_allowed=*/false);
    check_memory(b.q, index, "Q memory", /*matrix_allowed=*/true);
    auto mem = std::make_shared<Bucket>();
    if (b.error.defined()) mem->error = b.error.detach().clone();
    if (b.q.defined()) mem->q = b.q.detach().clone();
    buckets.emplace(index, std::move(mem));
  }
  std::lock_guard<std::mutex> lock(mu_);
  iter_ = state.iter;
  rng_ = rng;
  next_stats_report_ = state.next_stats_report;
  stats_ = state.stats;
  stats_.compression_rate = 0;
  buckets_ = std::move(buckets);
}

void PowerSGDState::save(torch::serialize::OutputArchive& archive) const {
  const PowerSGDStateDict s = state_dict();
  archive.write("iter", c10::IValue(s.iter));
  archive.write("rng", c10::IValue(s.rng));
  archive.write("next_stats_report", c10::IValue(s.next_stats_report));
  archive.write("options", c10::IValue(saved_options(s.options)));
  archive.write("stats", c10::IValue(std::vector<int64_t>{s.stats.numel_before, s.stats.numel_after,
                                                          s.stats.bytes_before, s.stats.bytes_after,
                                                          s.stats.bytes_communicated, s.stats.nonfinite_fallbacks}));
  std::vector<int64_t> indices;
  for (const auto& [index, mem] : s.buckets) {
    indices.push_back(static_cast<int64_t>(index));
    torch::serialize::OutputArchive b(archive.compilation_unit());
    if (mem.error.defined()) b.write("error", mem.error, /*is_buffer=*/true);
    if (mem.q.defined()) b.write("q", mem.q, /*is_buffer=*/true);
    archive.write("bucket_" + std::to_string(index), b);
  }
  archive.write("buckets", c10::IValue(indices));
}

void PowerSGDState::load(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  auto read = [&](const char* key) -> c10::IValue& {
    if (!archive.try_read(key, v)) {
      throw UsageError(std::string("PowerSGDState::load: the archive has no '") + key +
                       "' (not a PowerSGDState checkpoint?)");
    }
    return v;
  };
  PowerSGDStateDict s;
  s.options = options();
  const auto saved = read("options").toDoubleVector();
  if (saved != saved_options(options_)) {
    throw UsageError("PowerSGDState::load: the checkpoint was written with different options "
                     "(matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, use_error_feedback, "
                     "warm_start, orthogonalization_epsilon or batch_tensors_with_same_shape)");
  }
  s.iter = read("iter").toInt();
  s.rng = read("rng").toStringRef();
  s.next_stats_report = read("next_stats_report").toInt();
  const auto stats = read("stats").toIntVector();
  if (stats.size() != 6) throw UsageError("PowerSGDState::load: the saved statistics are corrupt");
  s.stats.numel_before = stats[0];
  s.stats.numel_after = stats[1];
  s.stats.bytes_before = stats[2];
  s.stats.bytes_after = stats[3];
  s.stats.bytes_communicated = stats[4];
  s.stats.nonfinite_fallbacks = stats[5];
  for (int64_t index : read("buckets").toIntVector()) {
    torch::serialize::InputArchive b;
    if (index < 0 || !archive.try_read("bucket_" + std::to_string(index), b)) {
      throw UsageError("PowerSGDState::load: bucket " + std::to_string(index) + " is missing");
    }
    PowerSGDStateDict::Bucket mem;
    at::Tensor t;
    if (b.try_read("error", t, /*is_buffer=*/true) && t.defined() && t.numel() > 0) mem.error = t;
    at::Tensor q;
    if (b.try_read("q", q, /*is_buffer=*/true) && q.defined() && q.numel() > 0) mem.q = q;
    s.buckets[static_cast<size_t>(index)] = std::move(mem);
  }
  load_state_dict(s);
}

}  // namespace tdist

// Per-rank checkpoint files: save and load (at the saving world size from
// the rank's own file, at another from the rows the files hold). The
// contract is in include/tdist/sharded_checkpoint.h; the files' layout in
// checkpoint_tree.h.
#include "tdist/sharded_checkpoint.h"

#include <ATen/ATen.h>
#include <sys/stat.h>

#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <unistd.h>

#include "checkpoint/dcp_load.h"
#include "formats/dcp_metadata.h"
#include "checkpoint/dcp_save.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/tensor_tree.h"
#include "process_group/agree.h"
#include "checkpoint/load_checks.h"
#include "checkpoint/model_entries.h"
#include "checkpoint/sharded_files.h"
#include "checkpoint/sharded_tensors.h"
#include "util/check.h"

namespace tdist {

namespace {

using checkpoint::PtReader;
using checkpoint::PtTensorRef;
using checkpoint::PtValue;
using checkpoint::PtWriter;

void check_group(const char* what, ProcessGroup& pg, torch::nn::Module& model) {
  if (const auto fsdp = detail::FsdpModel::of(model)) {
    const auto& units = fsdp->group();
    if (units->size() != pg.size() || units->rank() != pg.rank()) {
      throw UsageError(std::string(what) + ": the model's FSDP group is rank " + std::to_string(units->rank()) +
                       " of " + std::to_string(units->size()) + ", the group given rank " +
                       std::to_string(pg.rank()) + " of " + std::to_string(pg.size()) + ": pass the model's group");
    }
  }
}

// Every rank says how its part went ("" when well); the first failing
// rank's words (every rank gets the same), or "" when all went well. A
// rank that never answers (dead, stuck) is the collective's timeout error.
std::string first_error(const char* what, ProcessGroup& pg, const std::string& mine,
                        std::chrono::milliseconds timeout) {
  try {
    return detail::first_failure(pg, mine, timeout);
  } catch (const Error& e) {
    throw CheckpointError(std::string(what) + ": rank " + std::to_string(pg.rank()) +
                          " did not hear from every rank (nothing was replaced or loaded): " + e.what());
  }
}

int64_t agreed_save_id(ProcessGroup& pg, std::chrono::milliseconds timeout) {
  int64_t id = 0;
  if (pg.rank() == 0) {
    id = checkpoint::new_save_id();
  }
  return detail::rank0_value(pg, id, timeout);
}

// A PowerSGD hook's state as the rank file's "comm_hook" record (its
// layout in checkpoint_tree.h): plain values and tensors, nothing a loader
// would run.
PtValue powersgd_value(const PowerSGDStateDict& s, checkpoint::TensorSink& sink) {
  const PowerSGDOptions& o = s.options;
  const auto memory = [&](const at::Tensor& t) { return t.defined() ? sink.add(t.detach().to(at::kCPU)) : PtValue(); };
  std::vector<PtValue> buckets;
  for (const auto& [index, b] : s.buckets) {
    buckets.push_back(PtValue::dict({{"index", PtValue::integer(static_cast<int64_t>(index))},
                                     {"error", memory(b.error)},
                                     {"q", memory(b.q)}}));
  }
  return PtValue::dict(
      {{"kind", PtValue::string("PowerSGD")},
       {"version", PtValue::integer(1)},
       {"options", PtValue::dict({{"matrix_approximation_rank", PtValue::integer(o.matrix_approximation_rank)},
                                  {"start_powerSGD_iter", PtValue::integer(o.start_powerSGD_iter)},
                                  {"min_compression_rate", PtValue::floating(o.min_compression_rate)},
                                  {"use_error_feedback", PtValue::boolean(o.use_error_feedback)},
                                  {"warm_start", PtValue::boolean(o.warm_start)},
                                  {"orthogonalization_epsilon", PtValue::floating(o.orthogonalization_epsilon)},
                                  {"random_seed", PtValue::integer(static_cast<int64_t>(o.random_seed))},
                                  {"compression_stats_logging_frequency",
                                   PtValue::integer(o.compression_stats_logging_frequency)},
                                  {"batch_tensors_with_same_shape",
                                   PtValue::boolean(o.batch_tensors_with_same_shape)}})},
       {"iter", PtValue::integer(s.iter)},
       {"rng", PtValue::string(s.rng)},
       {"next_stats_report", PtValue::integer(s.next_stats_report)},
       {"stats", PtValue::dict({{"numel_before", PtValue::integer(s.stats.numel_before)},
                                {"numel_after", PtValue::integer(s.stats.numel_after)},
                                {"bytes_before", PtValue::integer(s.stats.bytes_before)},
                                {"bytes_after", PtValue::integer(s.stats.bytes_after)},
                                {"bytes_communicated", PtValue::integer(s.stats.bytes_communicated)},
                                {"nonfinite_fallbacks", PtValue::integer(s.stats.nonfinite_fallbacks)}})},
       {"buckets", PtValue::list(std::move(buckets))}});
}

// The record back (check_comm_hook has checked its layout); the tensors
// read with `read`, which checks their views and bytes.
PowerSGDStateDict powersgd_from(const PtValue& v, const std::function<at::Tensor(const PtTensorRef&)>& read) {
  PowerSGDStateDict s;
  const PtValue& o = v.at("options");
  s.options.matrix_approximation_rank = o.at("matrix_approximation_rank").as_int();
  s.options.start_powerSGD_iter = o.at("start_powerSGD_iter").as_int();
  s.options.min_compression_rate = o.at("min_compression_rate").as_float();
  s.options.use_error_feedback = o.at("use_error_feedback").as_bool();
  s.options.warm_start = o.at("warm_start").as_bool();
  s.options.orthogonalization_epsilon = o.at("orthogonalization_epsilon").as_float();
  s.options.random_seed = static_cast<uint64_t>(o.at("random_seed").as_int());
  s.options.compression_stats_logging_frequency = o.at("compression_stats_logging_frequency").as_int();
  s.options.batch_tensors_with_same_shape = o.at("batch_tensors_with_same_shape").as_bool();
  s.iter = v.at("iter").as_int();
  s.rng = v.at("rng").as_string();
  s.next_stats_report = v.at("next_stats_report").as_int();
  const PtValue& st = v.at("stats");
  s.stats.numel_before = st.at("numel_before").as_int();
  s.stats.numel_after = st.at("numel_after").as_int();
  s.stats.bytes_before = st.at("bytes_before").as_int();
  s.stats.bytes_after = st.at("bytes_after").as_int();
  s.stats.bytes_communicated = st.at("bytes_communicated").as_int();
  s.stats.nonfinite_fallbacks = st.at("nonfinite_fallbacks").as_int();
  for (const auto& b : v.at("buckets").items()) {
    PowerSGDStateDict::Bucket mem;
    if (!b.at("error").is_none()) mem.error = read(b.at("error").as_tensor());
    if (!b.at("q").is_none()) mem.q = read(b.at("q").as_tensor());
    s.buckets.emplace(static_cast<size_t>(b.at("index").as_int()), std::move(mem));
  }
  return s;
}

// What a load reads before it changes anything.
struct Staged {
  ShardedStateDict model;
  std::optional<OptimizerStateDict> optimizer;
  std::optional<PowerSGDStateDict> comm_hook;  // when the load wants it
  std::optional<std::vector<std::vector<size_t>>> ddp_buckets;
};

detail::DataParallel* ddp_of(torch::nn::Module& model) {
  auto* m = dynamic_cast<detail::DataParallelModule*>(&model);
  return m ? &m->data_parallel() : nullptr;
}

// DDP's bucket layout once rebuilt (parameter indices per bucket), so that
// a resumed run buckets its gradients alike (a hook's state is per bucket).
PtValue ddp_buckets_value(torch::nn::Module& model) {
  detail::DataParallel* ddp = ddp_of(model);
  if (!ddp || !ddp->buckets_rebuilt()) return PtValue();
  std::vector<PtValue> buckets;
  for (const auto& b : ddp->bucket_indices()) {
    std::vector<PtValue> ks;
    for (const size_t k : b) ks.push_back(PtValue::integer(static_cast<int64_t>(k)));
    buckets.push_back(PtValue::list(std::move(ks)));
  }
  return PtValue::list(std::move(buckets));
}

std::optional<std::vector<std::vector<size_t>>> ddp_buckets_from(const PtValue& tag) {
  const PtValue* v = tag.find("ddp_buckets");
  if (!v || v->is_none()) return std::nullopt;
  std::vector<std::vector<size_t>> out;
  for (const auto& b : v->items()) {
    out.emplace_back();
    for (const auto& k : b.items()) {
      if (k.as_int() < 0) throw CheckpointError("a negative parameter index in ddp_buckets");
      out.back().push_back(static_cast<size_t>(k.as_int()));
    }
  }
  return out;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The rank's own file, when it holds this model's layout (the same world
// size, rank and shards); else nothing.
std::optional<Staged> stage_own(const PtReader& reader, ProcessGroup& pg, torch::nn::Module& model,
                                bool want_optimizer, bool want_hook, int64_t& save_id) {
  const std::string& path = reader.path();
  const PtValue& root = reader.root();
  const PtValue& tag = checkpoint::field(root, "tdist", path);
  ShardMetadata saved = checkpoint::metadata_from(checkpoint::field(root, "shard_metadata", path));
  const auto fsdp = detail::FsdpModel::of(model);
  const ShardMetadata now = fsdp ? fsdp->metadata() : ShardMetadata{};
  if (tag.at("kind").as_string() != "sharded" || saved.world_size != pg.size() || saved.rank != pg.rank()) {
    return std::nullopt;
  }
  if (tag.at("format").as_int() != checkpoint::kFormatVersion) {
    throw CheckpointError(path + ": format " + std::to_string(tag.at("format").as_int()) + ", this tdist reads " +
                          std::to_string(checkpoint::kFormatVersion));
  }
  // The same shards: every unit parameter with the same rows here.
  std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t>> a, b;
  for (const auto& u : saved.units) {
    for (const auto& p : u.params) a.emplace_back(p.original_name, p.shard_shape, u.sharded ? p.first_row : -1);
  }
  for (const auto& u : now.units) {
    for (const auto& p : u.params) b.emplace_back(p.original_name, p.shard_shape, u.sharded ? p.first_row : -1);
  }
  if (a != b) return std::nullopt;
  save_id = tag.at("save_id").as_int();
  Staged s;
  s.ddp_buckets = ddp_buckets_from(tag);
  checkpoint::TensorReads reads(reader);  // each storage once, however often the file names it
  const auto read = [&](const PtTensorRef& ref) {
    checkpoint::check_whole(ref, path, "storage " + ref.storage_key);  // what tdist writes
    return reads(ref);
  };
  for (const auto& [name, v] : checkpoint::field(root, "model", path).entries()) {
    s.model.tensors.insert(name, read(v.as_tensor()));
  }
  s.model.metadata = fsdp ? now : ShardMetadata{};
  const PtValue& opt = checkpoint::field(root, "optimizer", path);
  if (want_optimizer) {
    if (opt.is_none()) throw CheckpointError(path + ": the checkpoint holds no optimizer state");
    checkpoint::check_optimizer_tree(opt);
    s.optimizer = checkpoint::optimizer_from(opt, read);
    s.optimizer->world_size = fsdp ? pg.size() : 1;
    s.optimizer->rank = fsdp ? pg.rank() : 0;
  }
  const PtValue* hook = root.find("comm_hook");
  const checkpoint::CommHookRecord kind = checkpoint::check_comm_hook(hook);
  if (want_hook) {
    if (kind == checkpoint::CommHookRecord::none) throw CheckpointError("the checkpoint holds no comm hook state");
    if (kind == checkpoint::CommHookRecord::legacy_archive) {
      throw CheckpointError("its comm_hook record is a LibTorch archive (what tdist wrote before it stored hook "
                            "states as plain values); such an archive can carry code that its loader runs, so it "
                            "is not loaded: load without comm_hook_state (the hook's memories start afresh), then "
                            "save again");
    }
    s.comm_hook = powersgd_from(*hook, read);
  }
  return s;
}

// stage_own with the file named in its errors.
std::optional<Staged> stage_own(const std::string& path, ProcessGroup& pg, torch::nn::Module& model,
                                bool want_optimizer, bool want_hook, int64_t& save_id) {
  if (!exists(path)) return std::nullopt;
  const PtReader reader(path);
  try {
    return stage_own(reader, pg, model, want_optimizer, want_hook, save_id);
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    throw CheckpointError(what.compare(0, path.size(), path) == 0 ? what : path + ": " + what);
  }
}

// This rank's rows of everything, from the files of another world size
// or layout.
Staged stage_resharded(const std::string& prefix, const ShardedCheckpointOptions& options, ProcessGroup& pg,
                       torch::nn::Module& model, bool want_optimizer, int64_t& save_id) {
  checkpoint::ShardedCheckpointFiles files(prefix, options.suffix);
  save_id = files.save_id();
  Staged s;
  s.ddp_buckets = ddp_buckets_from(files.reader(0).root().at("tdist"));
  const std::string where = "the checkpoint " + prefix + options.suffix;
  if (options.comm_hook_state) {
    throw CheckpointError(where + " was saved by " + std::to_string(files.world_size()) + " ranks in another layout: " +
                          "a comm hook's state resumes only from each rank's own file (the same world size, " +
                          "now " + std::to_string(pg.size()) + ", and the same sharding)");
  }
  const auto fsdp = detail::FsdpModel::of(model);
  std::map<std::string, detail::FsdpParamRecord> units;  // by name
  if (fsdp) {
    for (const auto& u : fsdp->params()) units.emplace(u.name, u);
  }
  std::map<std::string, const checkpoint::LogicalTensor*> saved;
  for (const auto& t : files.model()) saved[t.name] = &t;
  s.model.metadata = fsdp ? fsdp->metadata() : ShardMetadata{};
  std::set<std::string> names;
  // A tied tensor once, found under any of its names (the file has it under
  // its first; one from elsewhere may have another).
  for (const auto& e : checkpoint::unique_entries_of(model)) {
    names.insert(e.name);
    names.insert(e.aliases.begin(), e.aliases.end());
    auto it = saved.find(e.name);
    for (size_t i = 0; i < e.aliases.size() && it == saved.end(); ++i) it = saved.find(e.aliases[i]);
    if (it == saved.end()) throw CheckpointError(where + " has no '" + e.name + "'");
    const auto u = units.find(e.name);
    const std::vector<int64_t> full = u != units.end() ? u->second.full_shape : e.tensor.sizes().vec();
    if (it->second->shape != full) {
      throw CheckpointError(where + ": '" + e.name + "' is " + checkpoint::shape_string(it->second->shape) +
                            " there but " + checkpoint::shape_string(full) + " in the model");
    }
    s.model.tensors.insert(e.name, u != units.end() && u->second.sharded
                                       ? checkpoint::read_rows(files, *it->second, u->second.first_row, u->second.rows)
                                       : checkpoint::read_full(files, *it->second));
  }
  for (const auto& t : files.model()) {
    if (!names.count(t.name)) throw CheckpointError(where + ": its '" + t.name + "' is not in the model");
  }
  if (want_optimizer) {
    if (!files.has_optimizer()) throw CheckpointError(where + " holds no optimizer state");
    checkpoint::check_optimizer_tree(files.optimizer_tree(), files.paths()[0] + ": optimizer");
    OptimizerStateDict o = checkpoint::optimizer_from(files.optimizer_tree(), [](const PtTensorRef&) {
      return at::Tensor();  // filled below, by rows
    });
    o.world_size = fsdp ? pg.size() : 1;
    o.rank = fsdp ? pg.rank() : 0;
    for (const auto& t : files.optimizer()) {
      const auto u = units.find(t.param);
      // This rank's rows of state shaped like its parameter (a whole
      // parameter's state from a checkpoint without sharding too).
      const bool rows = u != units.end() && u->second.sharded && t.field != "step" && t.shape == u->second.full_shape;
      o.state[t.param][t.field] = rows ? checkpoint::read_rows(files, t, u->second.first_row, u->second.rows)
                                         : checkpoint::read_full(files, t);
    }
    s.optimizer = std::move(o);
  }
  return s;
}

}  // namespace

namespace detail {

RankFileContents build_rank_file(ProcessGroup& pg, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const ShardedCheckpointOptions& options, int64_t save_id, checkpoint::CopyPool* copies) {
  ShardedStateDict local = sharded_state_dict(model);
  local.metadata.world_size = pg.size();
  local.metadata.rank = pg.rank();
  RankFileContents file{checkpoint::TensorSink(copies), PtValue()};
  checkpoint::TensorSink& sink = file.sink;
  std::vector<std::pair<std::string, PtValue>> tensors;
  for (const auto& item : local.tensors) tensors.emplace_back(item.key(), sink.add(item.value()));
  std::vector<PtValue> buffers, modules;
  for (const auto& e : checkpoint::unique_entries_of(model)) {  // as sharded_state_dict names them
    if (!e.parameter) buffers.push_back(PtValue::string(e.name));
  }
  for (const auto& m : checkpoint::module_names(model)) modules.push_back(PtValue::string(m));
  PtValue opt;
  if (optimizer) {
    OptimizerStateDict o = sharded_optimizer_state_dict(model, *optimizer);
    o.world_size = pg.size();
    o.rank = pg.rank();
    opt = checkpoint::optimizer_value(o, sink);
  }
  PtValue hook;
  if (options.comm_hook_state) hook = powersgd_value(options.comm_hook_state->state_dict(), sink);
  file.root = PtValue::dict(
      {{"model", PtValue::dict(std::move(tensors))},
       {"shard_metadata", checkpoint::metadata_value(local.metadata)},
       {"optimizer", std::move(opt)},
       {"comm_hook", std::move(hook)},
       {"tdist", checkpoint::sharded_record(save_id, pg.size(), pg.rank(), PtValue::list(std::move(buffers)),
                                            PtValue::list(std::move(modules)), ddp_buckets_value(model))}});
  return file;
}

void commit_rank_files(const std::string& prefix, ProcessGroup& pg, RankFileContents* file, std::string error,
                       const ShardedCheckpointOptions& options, const WriteRunner& run_write) {
  const char* what = "save_sharded_checkpoint";
  std::optional<PtWriter> writer;
  if (error.empty()) {
    try {
      if (!file) throw std::logic_error("commit_rank_files: no file and no error");
      const auto write = [&] {
        writer.emplace(checkpoint::rank_file_path(prefix, options.suffix, pg.rank(), pg.size()));
        file->sink.write(*writer, file->root);
        writer->sync();
      };
      if (run_write) {
        run_write(write);
      } else {
        write();
      }
    } catch (const std::exception& e) {
      error = *e.what() ? e.what() : "an error without words";
    }
  }
  const std::string failed = first_error(what, pg, error, options.timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + ": " + failed + " (no file was replaced)");
  try {
    writer->commit();
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "the rename failed";
  }
  const std::string renamed = first_error(what, pg, error, options.timeout);
  if (!renamed.empty()) {
    throw CheckpointError(std::string(what) + ": " + renamed + ", after other ranks had renamed theirs: the files " +
                          "under " + prefix + " are from two saves now, which every load refuses; save again");
  }
  // Files of another world size under this prefix are an older save's:
  // rank 0 removes them (a load refuses a prefix holding two world sizes).
  if (pg.rank() == 0) {
    for (const auto& f : checkpoint::find_rank_files(prefix, options.suffix)) {
      if (f.world_size >= 0 && f.world_size != pg.size()) ::unlink(f.path.c_str());
    }
  }
  first_error(what, pg, "", options.timeout);  // every file in place when any rank returns
}

int64_t agree_on_save_id(ProcessGroup& pg, std::chrono::milliseconds timeout) { return agreed_save_id(pg, timeout); }

}  // namespace detail

namespace {


// Hybrid sharding: the replicas hold the same shards, so the files are
// those of one shard group, the first replica's (rank r of the shard
// group writes rank r's file); every replica loads them. `pg` may be the
// wrappers' whole group or their shard group. fn(shard group) runs the
// save or load where it applies; then every rank hears from the ranks
// holding its shards, so a failure anywhere fails every rank's call.
template <typename Fn>
bool across_replicas(const char* what, ProcessGroup& pg, torch::nn::Module& model, bool first_replica_only,
                     const ShardedCheckpointOptions& options, Fn&& fn) {
  const auto fsdp = detail::FsdpModel::of(model);
  const auto replicate = fsdp ? fsdp->replicate_group() : nullptr;
  if (!replicate) return false;
  const auto shard = fsdp->group();
  const auto world = fsdp->world_group();
  if (&pg != world.get() && &pg != shard.get()) {
    throw UsageError(std::string(what) + ": the model is hybrid-sharded over " + std::to_string(world->size()) +
                     " ranks (shard groups of " + std::to_string(shard->size()) +
                     "); pass its whole group (the device mesh's) or its shard group");
  }
  std::string error;
  if (!first_replica_only || replicate->rank() == 0) {
    try {
      fn(*shard);
    } catch (const std::exception& e) {
      error = *e.what() ? e.what() : "an error without words";
    }
  }
  const std::string failed = first_error(what, *replicate, error, options.timeout);
  if (!failed.empty()) throw CheckpointError(std::string(what) + ", hybrid sharding: replica " + failed);
  return true;
}

void save_on(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options) {
  if (options.format == ShardedFormat::dcp) {
    check_group("save_sharded_checkpoint", pg, model);  // the same on every rank: no rank goes on alone
    return checkpoint::save_dcp(prefix, pg, model, optimizer, options.timeout);
  }
  const int64_t save_id = agreed_save_id(pg, options.timeout);
  std::optional<detail::RankFileContents> file;
  std::string error;
  try {
    check_group("save_sharded_checkpoint", pg, model);
    file.emplace(detail::build_rank_file(pg, model, optimizer, options, save_id, /*copies=*/nullptr));
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "an error without words";
  }
  detail::commit_rank_files(prefix, pg, file ? &*file : nullptr, error, options);
}

// replicas (hybrid sharding): the ranks holding this rank's shards in the
// other shard groups, which must all succeed before any rank applies.
void load_on(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options,
             ProcessGroup* replicas = nullptr) {
  const char* what = "load_sharded_checkpoint";
  std::optional<Staged> staged;
  int64_t save_id = 0;
  std::string error;
  detail::DataParallel* ddp = ddp_of(model);
  try {
    check_group(what, pg, model);
    std::map<int64_t, std::string> worlds;
    for (const auto& f : checkpoint::find_rank_files(prefix, options.suffix)) {
      if (f.world_size >= 0) worlds.emplace(f.world_size, f.path);
    }
    if (worlds.size() > 1) {
      throw CheckpointError("files of different world sizes under " + prefix + ": " + worlds.begin()->second +
                            " and " + worlds.rbegin()->second + " (remove the older save's)");
    }
    const std::string own = checkpoint::rank_file_path(prefix, options.suffix, pg.rank(), pg.size());
    const bool want_hook = options.comm_hook_state != nullptr;
    if (checkpoint::dcp::is_dcp_folder(prefix)) {
      if (want_hook) throw CheckpointError(prefix + " is a DCP checkpoint: it holds no comm hook state");
      checkpoint::DcpStaged d = checkpoint::stage_dcp(prefix, pg, model, optimizer);
      staged = Staged{std::move(d.model), std::move(d.optimizer), std::nullopt, std::nullopt};
      save_id = d.save_id;
    } else {
      staged = stage_own(own, pg, model, optimizer != nullptr, want_hook, save_id);
    }
    if (!staged) staged = stage_resharded(prefix, options, pg, model, optimizer != nullptr, save_id);
    // Every part checked before any is applied.
    checkpoint::check_sharded_model_state(model, staged->model);
    if (ddp && staged->ddp_buckets) {
      try {
        ddp->check_bucket_indices(*staged->ddp_buckets);
      } catch (const UsageError& e) {
        throw CheckpointError(std::string("the checkpoint's DDP buckets do not fit this model: ") + e.what());
      }
    }
    if (optimizer) checkpoint::check_sharded_optimizer_state(model, *optimizer, *staged->optimizer);
    if (options.comm_hook_state) {  // on a probe
      TDIST_CHECK(staged->comm_hook.has_value());  // stage_resharded refuses a hook's state
      if (ddp && staged->ddp_buckets) {
        for (const auto& [index, b] : staged->comm_hook->buckets) {
          if (index >= staged->ddp_buckets->size()) {
            throw CheckpointError(own + ": its comm_hook record has bucket " + std::to_string(index) +
                                  " but its DDP layout " + std::to_string(staged->ddp_buckets->size()) + " buckets");
          }
        }
      }
      try {
        PowerSGDState probe(nullptr, options.comm_hook_state->options());
        probe.load_state_dict(*staged->comm_hook);
      } catch (const UsageError& e) {
        throw CheckpointError(own + ": its comm_hook record: " + e.what());
      }
    }
  } catch (const std::exception& e) {
    error = *e.what() ? e.what() : "an error without words";
  }
  std::string failed = first_error(what, pg, error, options.timeout);
  // Every replica's verdict before any rank applies: replicas that loaded
  // different things would train apart without noticing.
  if (replicas) {
    failed = first_error(what, *replicas, failed.empty() ? "" : "replica of " + failed, options.timeout);
  }
  if (!failed.empty()) throw CheckpointError(std::string(what) + ": " + failed + " (nothing was loaded)");
  // Every rank read the same save (its own files can be from different ones
  // when a save was cut short between renames).
  at::Tensor ids = at::full({2}, save_id, at::kLong);
  ids[1] = -save_id;
  AllreduceOptions o;
  o.op = ReduceOp::MAX;
  o.timeout = options.timeout;
  pg.all_reduce(ids, o)->wait();
  if (ids[0].item<int64_t>() != -ids[1].item<int64_t>()) {
    throw CheckpointError(std::string(what) + ": the ranks' files of " + prefix + options.suffix +
                          " come from different saves (one that did not finish?); nothing was loaded");
  }
  load_sharded_state_dict(model, staged->model);
  staged->model.tensors.clear();  // copied into the model's own tensors: freed before the optimizer's state is placed
  if (ddp && staged->ddp_buckets) ddp->set_bucket_indices(*staged->ddp_buckets);
  if (optimizer) checkpoint::adopt_sharded_optimizer_state(model, *optimizer, *staged->optimizer);
  if (options.comm_hook_state) options.comm_hook_state->load_state_dict(*staged->comm_hook);
}

}  // namespace

void save_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options) {
  if (options.format == ShardedFormat::dcp && options.comm_hook_state) {
    throw UsageError("save_sharded_checkpoint: a DCP checkpoint holds no comm hook state (use ShardedFormat::tdist)");
  }
  if (across_replicas("save_sharded_checkpoint", pg, model, /*first_replica_only=*/true, options,
                      [&](ProcessGroup& shard) { save_on(prefix, shard, model, optimizer, options); })) {
    return;
  }
  save_on(prefix, pg, model, optimizer, options);
}

void load_sharded_checkpoint(const std::string& prefix, ProcessGroup& pg, torch::nn::Module& model,
                             torch::optim::Optimizer* optimizer, const ShardedCheckpointOptions& options) {
  if (across_replicas("load_sharded_checkpoint", pg, model, /*first_replica_only=*/false, options,
                      [&](ProcessGroup& shard) {
                        const auto fsdp = detail::FsdpModel::of(model);
                        load_on(prefix, shard, model, optimizer, options, fsdp->replicate_group().get());
                      })) {
    return;
  }
  load_on(prefix, pg, model, optimizer, options);
}

}  // namespace tdist

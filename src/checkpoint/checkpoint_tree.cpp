// tdist's checkpoint trees: the layout is in checkpoint_tree.h.
#include "checkpoint/checkpoint_tree.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <set>

#include "tdist/errors.h"

namespace tdist::checkpoint {

namespace {

PtValue ints(const std::vector<int64_t>& v) {
  std::vector<PtValue> items;
  for (const int64_t i : v) items.push_back(PtValue::integer(i));
  return PtValue::list(std::move(items));
}

std::vector<int64_t> ints_from(const PtValue& v) {
  std::vector<int64_t> out;
  for (const auto& i : v.items()) out.push_back(i.as_int());
  return out;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(shape[d], 1);
  return strides;
}

// Tensors in pickling order: depth first, dict entries and items in order.
void collect(const PtValue& v, std::vector<std::string>& keys) {
  switch (v.kind()) {
    case PtValue::Kind::Tensor: keys.push_back(v.as_tensor().storage_key); break;
    case PtValue::Kind::List:
    case PtValue::Kind::Tuple:
      for (const auto& i : v.items()) collect(i, keys);
      break;
    case PtValue::Kind::Dict:
      for (const auto& e : v.entries()) collect(e.second, keys);
      break;
    default: break;
  }
}

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw CheckpointError(where + ": " + what);
}

// v's kind, or a CheckpointError naming `where` (PtValue's own message
// names no place).
const PtValue& of_kind(const PtValue& v, PtValue::Kind kind, const std::string& where) {
  if (v.kind() == kind) return v;
  try {
    switch (kind) {
      case PtValue::Kind::Bool: v.as_bool(); break;
      case PtValue::Kind::Int: v.as_int(); break;
      case PtValue::Kind::String: v.as_string(); break;
      case PtValue::Kind::Dict: v.entries(); break;
      case PtValue::Kind::Tensor: v.as_tensor(); break;
      case PtValue::Kind::List:
      case PtValue::Kind::Tuple: v.items(); return v;
      case PtValue::Kind::Float: v.as_float(); return v;  // an int is a number too
      case PtValue::Kind::None: break;  // not asked for
    }
  } catch (const CheckpointError& e) {
    bad(where, e.what());
  }
  return v;
}

// A dict with exactly `keys`, each checked by the caller.
const PtValue& exact_dict(const PtValue& v, const std::set<std::string>& keys, const std::string& where) {
  std::set<std::string> seen;
  for (const auto& [k, x] : of_kind(v, PtValue::Kind::Dict, where).entries()) {
    if (!keys.count(k)) bad(where, "an unexpected key '" + k + "'");
    if (!seen.insert(k).second) bad(where, "the key '" + k + "' twice");
  }
  for (const auto& k : keys) {
    if (!seen.count(k)) bad(where, "no key '" + k + "'");
  }
  return v;
}

int64_t int_in(const PtValue& v, int64_t lo, int64_t hi, const std::string& where) {
  const int64_t i = of_kind(v, PtValue::Kind::Int, where).as_int();
  if (i < lo || i > hi) bad(where, std::to_string(i) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return i;
}

double finite(const PtValue& v, const std::string& where) {
  const double d = v.kind() == PtValue::Kind::Bool ? (v.as_bool() ? 1 : 0) : of_kind(v, PtValue::Kind::Float, where).as_float();
  if (!std::isfinite(d)) bad(where, "not a finite number");
  return d;
}

// A tensor (or None, when allowed) of a floating dtype with `dims` dimensions.
void memory_tensor(const PtValue& v, std::initializer_list<size_t> dims, const std::string& where) {
  if (v.is_none()) return;
  const PtTensorRef& t = of_kind(v, PtValue::Kind::Tensor, where).as_tensor();
  if (!c10::isFloatingType(t.dtype)) bad(where, std::string("a ") + c10::toString(t.dtype) + " tensor, not floating point");
  if (std::find(dims.begin(), dims.end(), t.sizes.size()) == dims.end()) {
    bad(where, "a tensor of " + std::to_string(t.sizes.size()) + " dimensions");
  }
  for (const int64_t d : t.sizes) {
    if (d <= 0) bad(where, "an empty tensor " + shape_string(t.sizes));
  }
}

}  // namespace

CommHookRecord check_comm_hook(const PtValue* record) {
  if (!record || record->is_none()) return CommHookRecord::none;
  const std::string w = "comm_hook";
  if (record->kind() == PtValue::Kind::Tensor) {
    if (record->as_tensor().dtype != c10::kByte || record->as_tensor().sizes.size() != 1) {
      bad(w, "a " + std::string(c10::toString(record->as_tensor().dtype)) + " tensor of " +
                 std::to_string(record->as_tensor().sizes.size()) + " dimensions, not a hook's state");
    }
    return CommHookRecord::legacy_archive;
  }
  constexpr int64_t kMax = INT64_MAX;
  exact_dict(*record, {"kind", "version", "options", "iter", "rng", "next_stats_report", "stats", "buckets"}, w);
  const std::string& kind = of_kind(record->at("kind"), PtValue::Kind::String, w + ".kind").as_string();
  if (kind != "PowerSGD") bad(w + ".kind", "'" + kind.substr(0, 64) + "', not a hook state this tdist reads (PowerSGD)");
  int_in(record->at("version"), 1, 1, w + ".version");
  const std::string o = w + ".options";
  const PtValue& opts = exact_dict(record->at("options"),
                                   {"matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                                    "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
                                    "compression_stats_logging_frequency", "batch_tensors_with_same_shape"},
                                   o);
  int_in(opts.at("matrix_approximation_rank"), 1, kMax, o + ".matrix_approximation_rank");
  int_in(opts.at("start_powerSGD_iter"), 0, kMax, o + ".start_powerSGD_iter");
  if (finite(opts.at("min_compression_rate"), o + ".min_compression_rate") < 0) bad(o + ".min_compression_rate", "negative");
  finite(opts.at("orthogonalization_epsilon"), o + ".orthogonalization_epsilon");
  int_in(opts.at("random_seed"), INT64_MIN, kMax, o + ".random_seed");
  int_in(opts.at("compression_stats_logging_frequency"), 1, kMax, o + ".compression_stats_logging_frequency");
  for (const char* b : {"use_error_feedback", "warm_start", "batch_tensors_with_same_shape"}) {
    of_kind(opts.at(b), PtValue::Kind::Bool, o + "." + b);
  }
  int_in(record->at("iter"), 0, kMax, w + ".iter");
  int_in(record->at("next_stats_report"), 0, kMax, w + ".next_stats_report");
  const std::string& rng = of_kind(record->at("rng"), PtValue::Kind::String, w + ".rng").as_string();
  if (rng.size() > kMaxRngText) bad(w + ".rng", std::to_string(rng.size()) + " characters, over " + std::to_string(kMaxRngText));
  const PtValue& stats = exact_dict(record->at("stats"),
                                    {"numel_before", "numel_after", "bytes_before", "bytes_after",
                                     "bytes_communicated", "nonfinite_fallbacks"},
                                    w + ".stats");
  for (const auto& [k, v] : stats.entries()) int_in(v, 0, kMax, w + ".stats." + k);
  std::set<int64_t> indices;
  const auto& buckets = of_kind(record->at("buckets"), PtValue::Kind::List, w + ".buckets").items();
  for (size_t i = 0; i < buckets.size(); ++i) {
    const std::string b = w + ".buckets[" + std::to_string(i) + "]";
    exact_dict(buckets[i], {"index", "error", "q"}, b);
    if (!indices.insert(int_in(buckets[i].at("index"), 0, INT32_MAX, b + ".index")).second) {
      bad(b + ".index", "bucket " + std::to_string(buckets[i].at("index").as_int()) + " twice");
    }
    memory_tensor(buckets[i].at("error"), {1}, b + ".error");
    memory_tensor(buckets[i].at("q"), {1, 2}, b + ".q");
  }
  return CommHookRecord::powersgd;
}

namespace {

// The parts optimizer_tree copies: the kind and the groups.
void check_kind_and_groups(const PtValue& v, const std::string& where) {
  const PtValue* kind = of_kind(v, PtValue::Kind::Dict, where).find("optimizer");
  if (!kind) bad(where, "no key 'optimizer'");
  of_kind(*kind, PtValue::Kind::String, where + ".optimizer");
  const PtValue* param_groups = v.find("param_groups");
  if (!param_groups) bad(where, "no key 'param_groups'");
  const auto& groups = of_kind(*param_groups, PtValue::Kind::List, where + ".param_groups").items();
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string w = where + ".param_groups[" + std::to_string(g) + "]";
    bool params = false;
    for (const auto& [name, value] : of_kind(groups[g], PtValue::Kind::Dict, w).entries()) {
      if (name == "params") {
        params = true;
        const auto& names = of_kind(value, PtValue::Kind::List, w + ".params").items();
        for (size_t i = 0; i < names.size(); ++i) {
          of_kind(names[i], PtValue::Kind::String, w + ".params[" + std::to_string(i) + "]");
        }
      } else {
        finite(value, w + "." + name);
      }
    }
    if (!params) bad(w, "no key 'params'");
  }
}

}  // namespace

void check_optimizer_tree(const PtValue& v, const std::string& where) {
  exact_dict(v, {"optimizer", "world_size", "rank", "state", "param_groups"}, where);
  check_kind_and_groups(v, where);
  const int64_t world = int_in(v.at("world_size"), 1, INT32_MAX, where + ".world_size");
  int_in(v.at("rank"), 0, world - 1, where + ".rank");
  for (const auto& [param, fields] : of_kind(v.at("state"), PtValue::Kind::Dict, where + ".state").entries()) {
    const std::string p = where + ".state['" + param + "']";
    for (const auto& [name, t] : of_kind(fields, PtValue::Kind::Dict, p).entries()) {
      of_kind(t, PtValue::Kind::Tensor, p + "." + name);
    }
  }
}

PtValue StorageKeys::add(c10::ScalarType dtype, std::vector<int64_t> shape) {
  PtTensorRef ref;
  ref.storage_key = std::to_string(next_++);
  ref.dtype = dtype;
  ref.storage_numel = 1;
  for (const int64_t d : shape) ref.storage_numel *= d;
  ref.strides = contiguous_strides(shape);
  ref.sizes = std::move(shape);
  return PtValue::tensor(std::move(ref));
}

std::vector<std::string> tensor_keys(const PtValue& root) {
  std::vector<std::string> keys;
  collect(root, keys);
  return keys;
}

std::string shape_string(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

const PtValue& field(const PtValue& v, std::string_view key, const std::string& path) {
  try {
    return v.at(std::string(key));
  } catch (const CheckpointError& e) {
    throw CheckpointError(path + ": " + e.what() + " (not a tdist checkpoint, or another version's?)");
  }
}

int64_t new_save_id() {
  std::random_device rd;
  return static_cast<int64_t>((static_cast<uint64_t>(rd()) << 31) ^ rd()) & INT64_MAX;
}

PtValue sharded_record(int64_t save_id, int world_size, int rank, PtValue buffers, PtValue modules,
                       PtValue ddp_buckets) {
  return PtValue::dict({{"format", PtValue::integer(kFormatVersion)},
                        {"kind", PtValue::string("sharded")},
                        {"save_id", PtValue::integer(save_id)},
                        {"world_size", PtValue::integer(world_size)},
                        {"rank", PtValue::integer(rank)},
                        {"buffers", std::move(buffers)},
                        {"modules", std::move(modules)},
                        {"ddp_buckets", std::move(ddp_buckets)}});
}

PtValue metadata_value(const ShardMetadata& md) {
  std::vector<PtValue> units;
  for (const auto& u : md.units) {
    std::vector<PtValue> params;
    for (const auto& p : u.params) {
      params.push_back(PtValue::dict({{"name", PtValue::string(p.name)},
                                      {"original_name", PtValue::string(p.original_name)},
                                      {"shape", ints(p.shape)},
                                      {"shard_shape", ints(p.shard_shape)},
                                      {"numel", PtValue::integer(p.numel)},
                                      {"first_row", PtValue::integer(p.first_row)},
                                      {"rows_per_rank", PtValue::integer(p.rows_per_rank)},
                                      {"padding_rows", PtValue::integer(p.padding_rows)},
                                      {"requires_grad", PtValue::boolean(p.requires_grad)}}));
    }
    units.push_back(PtValue::dict({{"prefix", PtValue::string(u.prefix)},
                                   {"sharded", PtValue::boolean(u.sharded)},
                                   {"params", PtValue::list(std::move(params))}}));
  }
  return PtValue::dict({{"world_size", PtValue::integer(md.world_size)},
                        {"rank", PtValue::integer(md.rank)},
                        {"units", PtValue::list(std::move(units))}});
}

ShardMetadata metadata_from(const PtValue& v) {
  ShardMetadata md;
  md.world_size = static_cast<int>(int_in(v.at("world_size"), 1, INT32_MAX, "shard_metadata.world_size"));
  md.rank = static_cast<int>(int_in(v.at("rank"), 0, md.world_size - 1, "shard_metadata.rank"));
  for (const auto& u : v.at("units").items()) {
    ShardedUnitInfo unit;
    unit.prefix = u.at("prefix").as_string();
    unit.sharded = u.at("sharded").as_bool();
    for (const auto& p : u.at("params").items()) {
      ShardedParamInfo info;
      info.name = p.at("name").as_string();
      info.original_name = p.at("original_name").as_string();
      info.shape = ints_from(p.at("shape"));
      info.shard_shape = ints_from(p.at("shard_shape"));
      info.numel = p.at("numel").as_int();
      info.first_row = p.at("first_row").as_int();
      info.rows_per_rank = p.at("rows_per_rank").as_int();
      info.padding_rows = p.at("padding_rows").as_int();
      info.requires_grad = p.at("requires_grad").as_bool();
      unit.params.push_back(std::move(info));
    }
    md.units.push_back(std::move(unit));
  }
  return md;
}

PtValue optimizer_tree(const PtValue& like, PtValue state, int world_size, int rank) {
  check_kind_and_groups(like, "optimizer");  // copied as they are: a name, and numbers and names in the groups
  return PtValue::dict({{"optimizer", like.at("optimizer")},
                        {"world_size", PtValue::integer(world_size)},
                        {"rank", PtValue::integer(rank)},
                        {"state", std::move(state)},
                        {"param_groups", like.at("param_groups")}});
}

}  // namespace tdist::checkpoint

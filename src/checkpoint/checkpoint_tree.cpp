// tdist's checkpoint trees: the layout is in checkpoint_tree.h.
#include "checkpoint/checkpoint_tree.h"

#include <algorithm>

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

}  // namespace

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
  md.world_size = static_cast<int>(v.at("world_size").as_int());
  md.rank = static_cast<int>(v.at("rank").as_int());
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
  return PtValue::dict({{"optimizer", like.at("optimizer")},
                        {"world_size", PtValue::integer(world_size)},
                        {"rank", PtValue::integer(rank)},
                        {"state", std::move(state)},
                        {"param_groups", like.at("param_groups")}});
}

}  // namespace tdist::checkpoint

// Test helper: rewrites a .pt file's tree, as a hostile or odd writer
// would, keeping its storages' bytes (they go through PtWriter again, so
// the file stays a well-formed zip with correct CRCs).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

#include "checkpoint/checkpoint_tree.h"
#include "formats/pt_file.h"

namespace tdist::test {

// `edit` changes the tree; tensors it adds name storage keys of `extra`
// (written from those tensors); every other tensor keeps its bytes.
inline void rewrite_pt(const std::string& path, const std::function<void(checkpoint::PtValue&)>& edit,
                       const std::map<std::string, at::Tensor>& extra = {}) {
  using checkpoint::PtValue;
  PtValue root;
  std::map<std::string, std::string> bytes;
  {
    const checkpoint::PtReader r(path);
    root = r.root();
    for (const auto& key : checkpoint::tensor_keys(root)) {
      std::string b(r.storage_bytes(key), '\0');
      r.read_storage_into(key, b.data(), b.size());
      bytes[key] = std::move(b);
    }
  }
  edit(root);
  checkpoint::PtWriter w(path);
  w.begin(root);
  for (const auto& key : checkpoint::tensor_keys(root)) {
    const auto it = extra.find(key);
    if (it != extra.end()) {
      w.write_storage(key, it->second);
      continue;
    }
    const std::string& b = bytes.at(key);
    w.begin_storage(key);
    w.append(b.data(), b.size());
    w.end_storage();
  }
  w.finish();
}

// The dict entry `key` of v (added as None when absent), to assign to.
inline checkpoint::PtValue& entry(checkpoint::PtValue& v, const std::string& key) {
  for (auto& [k, x] : v.mutable_entries()) {
    if (k == key) return x;
  }
  v.mutable_entries().emplace_back(key, checkpoint::PtValue());
  return v.mutable_entries().back().second;
}

// A tensor value of `t`'s dtype and shape (contiguous) in storage `key`.
inline checkpoint::PtValue tensor_value(const std::string& key, const at::Tensor& t) {
  checkpoint::PtTensorRef r;
  r.storage_key = key;
  r.dtype = t.scalar_type();
  r.storage_numel = t.numel();
  r.sizes = t.sizes().vec();
  r.strides = t.contiguous().strides().vec();
  return checkpoint::PtValue::tensor(std::move(r));
}

}  // namespace tdist::test

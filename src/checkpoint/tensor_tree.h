// LibTorch tensors into and out of tdist's checkpoint trees
// (checkpoint_tree.h has the layout).
//
// Tensors go into a tree through a TensorSink, which hands out storage keys
// and remembers how to produce each tensor when its turn comes to be
// written: so a writer can stream them (one in memory at a time).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_tree.h"
#include "tdist/state_dict.h"

namespace tdist::checkpoint {

class TensorSink {
 public:
  using Make = std::function<at::Tensor()>;
  // copy: add(t) keeps a private copy of t in host memory (pinned when t
  // is on a GPU), so that t may change before write (an asynchronous save).
  explicit TensorSink(bool copy = false) : copy_(copy) {}
  // A tensor value of that dtype and shape whose bytes `make` will produce.
  PtValue add(at::ScalarType dtype, std::vector<int64_t> shape, Make make);
  // A tensor in memory.
  PtValue add(const at::Tensor& t);
  // Writes root (built from this sink's values) and every tensor, in the
  // order root pickles them; finish() is the caller's.
  void write(PtWriter& writer, const PtValue& root);

 private:
  bool copy_;
  StorageKeys keys_;
  std::vector<std::pair<std::string, Make>> pending_;
};

// Reads a file's tensors with PtReader::read_tensor's checks (the record
// against the file, the view inside it and naming each element once),
// each storage record once: tensors that view one storage (a pickle's memo
// can name one any number of times) share its memory, so together they
// hold at most the file's records. Each tensor is a view of its storage.
// One per reader and load.
class TensorReads {
 public:
  explicit TensorReads(const PtReader& reader) : reader_(reader) {}
  at::Tensor operator()(const PtTensorRef& ref);

 private:
  const PtReader& reader_;
  std::map<std::string, at::Tensor> storages_;
};

PtValue optimizer_value(const OptimizerStateDict& s, TensorSink& sink);
// Everything but the tensors' bytes: the state's tensors are read with
// `read` (given the ref).
OptimizerStateDict optimizer_from(const PtValue& v, const std::function<at::Tensor(const PtTensorRef&)>& read);

}  // namespace tdist::checkpoint

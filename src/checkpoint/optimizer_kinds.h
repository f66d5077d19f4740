// What optimizer state dicts need to know of each LibTorch optimizer: a
// parameter's state as named tensors ("exp_avg", ..., and "step" as a 0-d
// int64 tensor) and back, and a param group's options as named numbers and
// back. Adam, AdamW, SGD, RMSprop and Adagrad; any other optimizer is a
// UsageError naming it.
//
// Tensors a state holds only sometimes (Adam's max_exp_avg_sq without
// amsgrad, SGD's momentum_buffer without momentum) are left out when
// undefined. State tensors have their parameter's shape, so under FSDP
// they are shards like their parameter.
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>

#include "tdist/state_dict.h"

namespace tdist::checkpoint {

class OptimizerKind {
 public:
  virtual ~OptimizerKind() = default;
  virtual const char* name() const = 0;
  virtual StateDict read_state(const torch::optim::OptimizerParamState& s) const = 0;
  // A state from read_state's tensors (CheckpointError naming a missing
  // one), each a copy on `param`'s device and, where both are floating
  // point, in its dtype (as Python's Optimizer.load_state_dict does): a
  // state read from a file is on the CPU, the parameter maybe on a GPU.
  // adopt: the tensors are the caller's to give (a load's staged state):
  // one already on that device in that dtype becomes the state itself, no
  // copy. An undefined `param` (a check before anything changes): the
  // tensors as they are, never copied (the state is thrown away).
  virtual std::unique_ptr<torch::optim::OptimizerParamState> make_state(const StateDict& fields,
                                                                        const std::string& name,
                                                                        const at::Tensor& param,
                                                                        bool adopt = false) const = 0;
  virtual std::map<std::string, double> read_options(const torch::optim::OptimizerOptions& o) const = 0;
  // Sets the options read_options names (others are left as they are).
  virtual void write_options(torch::optim::OptimizerOptions& o, const std::map<std::string, double>& values) const = 0;
};

// The kind of `opt`, or UsageError.
const OptimizerKind& kind_of(const torch::optim::Optimizer& opt);

}  // namespace tdist::checkpoint

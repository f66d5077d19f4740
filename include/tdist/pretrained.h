// Weights from the Python world, into any model and back out in its
// layout: Hugging Face directories (config.json + model.safetensors, or
// shards + model.safetensors.index.json; pytorch_model.bin and its index
// too), single safetensors files, and state dicts written by Python's
// torch.save (the zip format of PyTorch ≥ 1.6).
//
//   tdist::load_pretrained(*model, "gpt2-dir");           // plain, DDP or FSDP, any world size
//   tdist::SavePretrainedOptions o;
//   o.config_json = config.dump(2);
//   o.max_shard_size = 2LL << 30;
//   tdist::save_pretrained(*model, "out-dir", o);        // collective under FSDP; rank 0 writes
//
// Names are the unwrapped model's (tdist/state_dict.h): no "module." steps
// of FSDP, DDP or checkpoint_module. A tied parameter (one tensor
// registered under several names, as GPT-2's lm_head.weight is its
// transformer.wte.weight) is one entry: any one of its names in the file
// loads it, and save_pretrained writes it once, under its first name in
// the model's order (as Hugging Face does).
//
// Loading is local (no collective: each rank reads the files itself) and
// reads only what the rank keeps: under FSDP each parameter's rows of this
// rank (a safetensors file: those rows' bytes; a .pt file: the tensor's
// storage, then its rows; memory: the shard plus at most one tensor's
// bytes); everything is checked (every file opened and its header or zip
// directory checked, every entry found, shapes equal, dtypes convertible,
// .pt views inside their storage, with strict nothing unexpected) before
// the model changes. Only damage that reading itself finds (a checksum
// that does not match) is raised after earlier entries were copied. Values
// are converted to the model's dtypes (floating point to floating point,
// integers to integers) and copied in under NoGradGuard: the parameters
// stay the same tensors, so optimizers built on them stay valid. A tied
// entry whose file holds several of its names (Python's state_dict has
// both) checks each and loads the first in the model's order.
// Values of a .pt state dict that are not tensors are skipped (listed in
// the report's `ignored`).
// Errors: CheckpointError naming the file and the entry (a name or shape
// that does not match: both names, both shapes); UsageError for bad
// options. A corrupt, truncated or hostile file is refused with bounded
// memory and time, as every reader in tdist (docs/security.md).
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tdist/errors.h"

namespace tdist {

struct LoadPretrainedOptions {
  // Every entry of the model must be in the file(s) and, with strict,
  // every tensor of the file(s) must be an entry of the model (or match
  // ignore_unexpected).
  bool strict = true;
  // Hugging Face's base_model_prefix ("transformer" for GPT-2): a file
  // written from the base model (keys "h.0.attn.c_attn.weight") loads into
  // the model with the head ("transformer.h.0.attn.c_attn.weight"), and the
  // reverse.
  std::string base_model_prefix;
  // ECMAScript regular expressions of file keys that are skipped, each
  // matched against the whole key (std::regex_match: ".*\\.attn\\.bias", not
  // "\\.attn\\.bias$"; GPT-2's old checkpoints carry the attention masks
  // "h.0.attn.bias" and "h.0.attn.masked_bias"). Keys longer than 1 KiB
  // never match.
  std::vector<std::string> ignore_unexpected;
};

// What a load did, for a message or a check.
struct LoadPretrainedReport {
  std::vector<std::string> files;       // the files read
  std::vector<std::string> loaded;      // model entries loaded (a tied one once)
  std::vector<std::string> ignored;     // file keys skipped (ignore_unexpected, or any unexpected one without strict)
  std::vector<std::string> missing;     // model entries not found (only without strict)
};

// path: a directory (model.safetensors.index.json, model.safetensors,
// pytorch_model.bin.index.json or pytorch_model.bin, in that order of
// preference), a .safetensors file, or a file written by torch.save whose
// root is a dict of tensors (a state_dict; also {"model": state_dict} or
// {"state_dict": state_dict}).
LoadPretrainedReport load_pretrained(torch::nn::Module& model, const std::string& path,
                                     const LoadPretrainedOptions& options = {});

struct SavePretrainedOptions {
  // A shard holds at most this many bytes of tensor data (a tensor larger
  // than it gets a shard of its own). One file: model.safetensors; more:
  // model-00001-of-0000N.safetensors and model.safetensors.index.json.
  int64_t max_shard_size = int64_t{5} << 30;
  // Written as config.json when not empty (the caller's JSON text).
  std::string config_json;
  // Entries of the model left out of the files (by name), e.g. buffers a
  // Python model does not persist.
  std::vector<std::string> skip;
};

// Writes `dir` (created if missing; files of an earlier save there are
// replaced, crash-safe one file at a time): each tensor in the model's
// dtype (a buffer FSDP converted: in its own), shards filled in the
// model's order, with the "format": "pt" metadata transformers requires.
// Shards are written first, then the index ({"metadata": {"total_size":
// bytes}, "weight_map": {name: file}}), then config.json; last, files of
// an earlier save that this one does not name (model-*-of-*.safetensors,
// model.safetensors beside an index, the index beside one file) are
// removed, so a later load never reads a stale one. Under FSDP collective
// (every rank calls it): units are gathered one at a time and rank 0
// writes as they come (memory: one unit's full parameters; within a file
// the units' tensors come first, in the order they are gathered); every
// rank returns once the files are in place, or throws rank 0's error (a
// CheckpointError "rank 0 failed: ..." on the others). Without
// FSDP only the caller writes; under DDP call it on one rank.
void save_pretrained(torch::nn::Module& model, const std::string& dir, const SavePretrainedOptions& options = {});

// ---- an optimizer's state as Python's Optimizer.state_dict() has it ----------
// torch.save(optimizer.state_dict(), path) keys "state" by each
// parameter's index (0, 1, ... through the optimizer's groups in order) and
// lists those indices as each param group's "params", with PyTorch's
// option names ("betas" a tuple, flags as bools).
//
// load_optimizer_state_dict_file reads such a file (its root, or the dict
// under "optimizer", "optim" or "optimizer_state_dict" of a training
// checkpoint) into `opt`, index i being the i-th parameter `opt` steps, as
// Optimizer.load_state_dict pairs them: the groups' count and sizes must
// match, each state tensor its parameter's shape; every check before
// anything changes (CheckpointError naming the file and what differs).
// `model` is the module whose parameters `opt` steps, plain, DDP or FSDP
// (each rank keeps its rows of the full state: call it on every rank).
// Adam, AdamW, SGD, RMSprop, Adagrad.
//
// save_optimizer_state_dict_file writes one that Python's
// optimizer.load_state_dict(torch.load(path)) takes for the same
// parameters in the same order: "step" a float32 0-d tensor as PyTorch
// keeps it, the groups with every key PyTorch's optimizer of that kind has.
// Under FSDP collective (the state is gathered; rank 0 writes); written
// aside and renamed.
void load_optimizer_state_dict_file(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt);
void save_optimizer_state_dict_file(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& opt);

}  // namespace tdist

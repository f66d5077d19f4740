// What a DCP checkpoint's keys mean: the model's tensors, the optimizer's
// state and param groups, and the rest, whichever of Python's usual
// layouts the save was given:
//   {"model": model.state_dict(), "optim"|"optimizer": get_optimizer_state_dict(...)}
//                                       (FSDP2 recipes, torchtitan)
//   model.state_dict() alone            (keys at the top: torchtitan's model-only save)
//   the optimizer's state keyed by parameter name (get_state_dict) or by
//   index (optimizer.state_dict()), or flattened ("state.<param>.<field>",
//   "param_groups.<param>.<key>": flatten_optimizer_state_dict=True).
// Model names lose the wrappers PyTorch adds ("_orig_mod." of
// torch.compile, "_checkpoint_wrapped_module." of activation
// checkpointing, "_fsdp_wrapped_module." of FSDP1, a leading "module." of
// DDP), as tdist's names have none.
//
// No LibTorch (c10 only).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "formats/dcp_metadata.h"
#include "formats/pt_file.h"

namespace tdist::checkpoint::dcp {

struct OptimizerEntry {
  std::string param;  // its name, or its index (by_index) among the groups' params in order
  bool by_index = false;
  std::string field;  // "exp_avg", "step", ...
  const Item* item = nullptr;
};

struct ParamGroupEntries {
  std::map<std::string, const Item*> options;  // "lr", "betas", ... (also "params")
};

struct Layout {
  std::vector<std::pair<std::string, const Item*>> model;  // name (wrappers removed) -> item, in file order
  std::string model_root;                                  // "model", or "" for keys at the top
  std::vector<OptimizerEntry> optimizer;
  std::string optimizer_root;  // "optim", "optimizer", or "" without one
  std::vector<ParamGroupEntries> param_groups;
  // Per-parameter options of a flattened optimizer state dict ("lr" of
  // each parameter), by parameter name (as the files name it, wrappers
  // and all).
  std::map<std::string, std::map<std::string, const Item*>> param_options;
  std::vector<const Item*> other;  // lr_scheduler, dataloader, train_state, ...
};

Layout classify(const Metadata& m);

// A model name without PyTorch's wrapper parts.
std::string unwrapped_name(const std::string& name);

// ---- param groups: PyTorch's keys and tdist's options ----------------------
// PyTorch's keys and values of a param group of the optimizer `kind`
// ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad") from tdist's options: what
// its state_dict() holds, "betas" a tuple, flags as bools, the ones tdist
// has no use for at PyTorch's defaults (maximize False, foreach None, ...;
// AdamW's decoupled_weight_decay True). Without "params". UsageError for
// another kind.
std::vector<std::pair<std::string, PtValue>> python_options(const std::string& kind,
                                                            const std::map<std::string, double>& options);
// One PyTorch key and value into tdist's options ("betas" as beta1 and
// beta2, bools as 0/1; None, which tdist has no use for, adds nothing).
// CheckpointError (`where` first) for an option of tdist's that is not a
// number, and for maximize True (tdist's optimizers only minimize); another
// key whose value is not a number is left out.
void add_tdist_option(const std::string& key, const PtValue& v, std::map<std::string, double>& options,
                      const std::string& where);
// The optimizer kind PyTorch's state fields and groups say ("AdamW" when
// Adam's fields come with decoupled_weight_decay True); "" when unknown.
std::string kind_of_state(const std::vector<std::string>& fields, bool decoupled_weight_decay);

}  // namespace tdist::checkpoint::dcp

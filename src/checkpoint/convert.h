// `tdist-ckpt convert --from FMT:PATH --to FMT:PATH`: a checkpoint moved
// between the formats of both worlds, one whole tensor at a time. No
// LibTorch (c10 only): tdist-ckpt runs it in a process of a few MiB plus
// the largest tensor.
//
// Formats (FMT):
//   dcp          PyTorch's Distributed Checkpoint folder (dcp_metadata.h);
//                read: model keys under "model." or at the top, the
//                optimizer's under "optim."/"optimizer." by parameter
//                name; written: one rank file, "model.<name>",
//                "optim.state.<param>.<field>", "optim.param_groups.<i>.<key>"
//                as get_state_dict names them (dcp.load reads it)
//   tdist        tdist's sharded files: PATH is the prefix of
//                PATH_rank-*-of-*.pt; written at world size 1
//                (PATH_rank-0-of-1.pt, every tensor whole, as a plain
//                model saves), which loads at any world size and
//                `tdist-ckpt reshard` rewrites; a prefix holding files
//                of another world size is refused
//   pt           one torch.save file: read, {"model": {name: tensor}} (a
//                consolidated or Python file; "optimizer" of tdist's
//                layout when there), {"state_dict": sd}, or a state dict
//                itself; written, tdist's consolidated layout
//                ({"model", "optimizer", "tdist"}), which torch.load reads
//   safetensors  one .safetensors file; or a directory of Hugging Face
//                shards (model.safetensors.index.json and the files it
//                names, or model.safetensors): read; written when PATH
//                ends in '/' or is a directory (shards of at most
//                max_shard_size and the index). The optimizer state goes
//                in one file only, as "optimizer/<param>/<field>" with the
//                groups in the metadata (what consolidate writes).
//
// The optimizer state moves when `optimizer` is set (UsageError when the
// input has none). Memory: the largest tensor + a few MiB. The output is
// written aside and renamed into place once whole; an output that is, or
// would overwrite, one of the input's files is a UsageError.
//
// Errors: CheckpointError for a damaged input (naming the file);
// UsageError for bad arguments.
#pragma once

#include <cstdint>
#include <string>

namespace tdist::checkpoint {

struct ConvertOptions {
  bool optimizer = false;
  int64_t max_shard_size = int64_t{5} * 1000 * 1000 * 1000;  // Hugging Face's default, 5 GB
};

// from and to: "FMT:PATH". Returns what was written ("4 model tensors, 3
// optimizer tensors -> PATH").
std::string convert_checkpoint(const std::string& from, const std::string& to, const ConvertOptions& options = {});

}  // namespace tdist::checkpoint

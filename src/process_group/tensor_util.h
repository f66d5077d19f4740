// Tensor checks and reshaping shared by the collectives. Every check raises
// UsageError naming the op, the argument and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/types.h"

namespace tdist::detail {

// Defined, dense, contiguous, on a device the backend serves (the CPU, or
// CUDA when allow_cuda), of a dtype the comm layer moves.
comm::DataType check_tensor(const at::Tensor& t, const char* op, const char* what = "tensor", bool allow_cuda = false);
comm::DataType to_comm_dtype(at::ScalarType s, const char* op, const char* what);
void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op);
void check_numel(const at::Tensor& t, int64_t want, const char* op, const char* what);
// n tensors, each checked and shaped/typed like `like`.
void check_list(const std::vector<at::Tensor>& list, int n, const at::Tensor& like, const char* op, const char* what,
                bool allow_cuda = false);

// All tensors' bytes, back to back, in a new 1-D tensor of their dtype.
at::Tensor flatten(const std::vector<at::Tensor>& list);
// Copies consecutive pieces of flat into each tensor of outs.
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& outs);

struct Splits {
  std::vector<size_t> bytes;
  std::vector<size_t> offsets;
};
// Byte sizes and offsets of dim-0 splits of t (equal when sizes is empty).
Splits split_bytes(const at::Tensor& t, const std::vector<int64_t>& sizes, int n, const char* op, const char* what);

}  // namespace tdist::detail

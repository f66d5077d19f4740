// Tensor checks and dtype mapping for ProcessGroup's ops. The contract
// is in tensor_util.h.
#include "process_group/tensor_util.h"

#include <ATen/ATen.h>

#include <cstring>
#include <sstream>

#include "tdist/errors.h"
#include "util/bytes.h"

namespace tdist::detail {

namespace {

std::string shape(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

}  // namespace

comm::DataType to_comm_dtype(at::ScalarType s, const char* op, const char* what) {
  switch (s) {
    case at::kFloat: return comm::DataType::kFloat32;
    case at::kDouble: return comm::DataType::kFloat64;
    case at::kHalf: return comm::DataType::kFloat16;
    case at::kBFloat16: return comm::DataType::kBFloat16;
    case at::kChar: return comm::DataType::kInt8;
    case at::kByte: return comm::DataType::kUInt8;
    case at::kInt: return comm::DataType::kInt32;
    case at::kLong: return comm::DataType::kInt64;
    case at::kBool: return comm::DataType::kBool;
    default: break;
  }
  throw UsageError(std::string(op) + ": " + what + " has dtype " + c10::toString(s) +
                   ", which tdist does not support (float32, float64, float16, bfloat16, int8, uint8, int32, "
                   "int64, bool)");
}

comm::DataType check_tensor(const at::Tensor& t, const char* op, const char* what, bool allow_cuda) {
  if (!t.defined()) throw UsageError(std::string(op) + ": " + what + " is an undefined tensor");
  if (!(t.device().is_cpu() || (allow_cuda && t.device().is_cuda()))) {
    throw UsageError(std::string(op) + ": " + what + " is on " + t.device().str() + "; this group's backend moves " +
                     (allow_cuda ? "CPU and CUDA" : "CPU") + " tensors");
  }
  if (!t.is_contiguous()) {
    throw UsageError(std::string(op) + ": " + what + " of shape " + shape(t) +
                     " is not contiguous; call .contiguous() first");
  }
  if (t.is_sparse()) throw UsageError(std::string(op) + ": " + what + " is sparse; only dense tensors are supported");
  return to_comm_dtype(t.scalar_type(), op, what);
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  if (a.scalar_type() != b.scalar_type()) {
    throw UsageError(std::string(op) + ": tensors have different dtypes (" + c10::toString(a.scalar_type()) +
                     " and " + c10::toString(b.scalar_type()) + ")");
  }
}

void check_numel(const at::Tensor& t, int64_t want, const char* op, const char* what) {
  if (t.numel() != want) {
    throw UsageError(std::string(op) + ": " + what + " must have " + std::to_string(want) + " elements, has " +
                     std::to_string(t.numel()) + " (shape " + shape(t) + ")");
  }
}

void check_list(const std::vector<at::Tensor>& list, int n, const at::Tensor& like, const char* op, const char* what,
                bool allow_cuda) {
  if (static_cast<int>(list.size()) != n) {
    throw UsageError(std::string(op) + ": " + what + " must hold " + std::to_string(n) + " tensors (one per rank), holds " +
                     std::to_string(list.size()));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string name = std::string(what) + "[" + std::to_string(i) + "]";
    check_tensor(list[i], op, name.c_str(), allow_cuda);
    check_same_dtype(list[i], like, op);
    if (list[i].numel() != like.numel()) {
      throw UsageError(std::string(op) + ": " + name + " has shape " + shape(list[i]) + " but must match " + shape(like));
    }
  }
}

at::Tensor flatten(const std::vector<at::Tensor>& list) {
  if (!list.at(0).device().is_cpu()) {  // on the current stream
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.reshape({-1}));
    return at::cat(flat);
  }
  int64_t total = 0;
  for (const auto& t : list) total += t.numel();
  at::Tensor flat = at::empty({total}, list.at(0).options());
  size_t off = 0;
  for (const auto& t : list) {
    detail::copy_bytes(static_cast<uint8_t*>(flat.data_ptr()) + off, t.data_ptr(), t.nbytes());
    off += t.nbytes();
  }
  return flat;
}

void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& outs) {
  if (!flat.device().is_cpu()) {  // on the current stream
    const at::Tensor bytes = flat.view({-1}).view(at::kByte);
    int64_t off = 0;
    for (const auto& t : outs) {
      const auto n = static_cast<int64_t>(t.nbytes());
      if (n > 0) t.view({-1}).view(at::kByte).copy_(bytes.narrow(0, off, n));
      off += n;
    }
    return;
  }
  size_t off = 0;
  for (const auto& t : outs) {
    detail::copy_bytes(t.data_ptr(), static_cast<const uint8_t*>(flat.data_ptr()) + off, t.nbytes());
    off += t.nbytes();
  }
}

Splits split_bytes(const at::Tensor& t, const std::vector<int64_t>& sizes, int n, const char* op, const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : t.nbytes() / static_cast<size_t>(rows);
  Splits s;
  if (sizes.empty()) {
    if (rows % n != 0) {
      throw UsageError(std::string(op) + ": " + what + " has " + std::to_string(rows) + " rows, which do not split evenly over " +
                       std::to_string(n) + " ranks; pass split sizes");
    }
    for (int r = 0; r < n; ++r) {
      s.bytes.push_back(static_cast<size_t>(rows / n) * row_bytes);
      s.offsets.push_back(static_cast<size_t>(r * (rows / n)) * row_bytes);
    }
    return s;
  }
  if (static_cast<int>(sizes.size()) != n) {
    throw UsageError(std::string(op) + ": " + what + " split sizes list " + std::to_string(sizes.size()) +
                     " entries for a group of " + std::to_string(n));
  }
  int64_t sum = 0;
  for (int64_t v : sizes) {
    if (v < 0) throw UsageError(std::string(op) + ": negative split size " + std::to_string(v));
    s.offsets.push_back(static_cast<size_t>(sum) * row_bytes);
    s.bytes.push_back(static_cast<size_t>(v) * row_bytes);
    sum += v;
  }
  if (sum != rows) {
    throw UsageError(std::string(op) + ": " + what + " split sizes add up to " + std::to_string(sum) + " rows but the tensor has " +
                     std::to_string(rows));
  }
  return s;
}

}  // namespace tdist::detail

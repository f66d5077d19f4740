// Element types and reduction ops of the comm layer. The comm layer moves raw
// buffers (pointer, count, dtype) and knows nothing of LibTorch; the dist
// layer maps at::ScalarType onto these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdist::comm {

enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
};
inline constexpr int kNumDataTypes = 9;

enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kProduct = 2,
  kMin = 3,
  kMax = 4,
  kBand = 5,
  kBor = 6,
  kBxor = 7,
};

size_t dtype_size(DataType t);
const char* dtype_name(DataType t);
const char* reduce_op_name(ReduceOp op);
bool is_floating(DataType t);

// Throws UsageError when op cannot reduce t (AVG on integers, bitwise ops
// on floating types), naming both.
void check_reduction(DataType t, ReduceOp op);

}  // namespace tdist::comm

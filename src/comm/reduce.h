// Reduction kernels: out[i] = op(in_0[i], in_1[i], ..., in_{n-1}[i]).
//
// All n inputs are reduced in one pass, and float16/bfloat16 accumulate in
// float32 and round once at the end, so a sum over n ranks is as exact as
// the output type allows. AVG divides the sum by `avg_divisor` (the world
// size) before the final rounding. `out` may alias any input. Inputs are
// visited in index order for every element, so every rank that reduces the
// same inputs gets bit-identical results.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/types.h"

namespace tdist::comm {

// also_out, when given, receives the result too (in the same pass for
// float sums), and must not overlap out.
void reduce_many(void* out, const void* const* inputs, int n, size_t count, DataType t, ReduceOp op,
                 int avg_divisor, void* also_out = nullptr);

// Converts count elements from `from` to `to` (float32 <-> float16/bfloat16,
// or a copy when they are the same type): the bits at::Tensor::to gives,
// float32 narrowed with round to nearest even (NaN stays NaN). dst and src
// must not overlap unless they are the same pointer and type.
void convert(void* dst, DataType to, const void* src, DataType from, size_t count);
// Whether convert() handles this pair.
bool can_convert(DataType to, DataType from);

// Scalar conversions, exposed for tests and for the compression hooks.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);     // round to nearest even
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f); // round to nearest even; NaN stays NaN

}  // namespace tdist::comm

#include "comm/reduce.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "tdist/errors.h"

// Kernels are compiled for several ISAs and picked at load time (ifunc).
// ThreadSanitizer's runtime is not up when ifunc resolvers run, so a TSan
// build uses the default ISA only.
#if defined(__SANITIZE_THREAD__)
#define TDIST_CLONES
#else
#define TDIST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace tdist::comm {

namespace {

constexpr size_t kBlock = 512;  // elements per block: accumulators stay in L1

// ---- scalar conversions ----------------------------------------------------

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0x1f) return from_bits(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return from_bits(sign);
    // Subnormal: normalise.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while (!(mant & 0x400));
    mant &= 0x3ff;
    return from_bits(sign | uint32_t(127 - 15 - e) << 23 | mant << 13);
  }
  return from_bits(sign | (exp + (127 - 15)) << 23 | mant << 13);
}

uint16_t float_to_half(float f) {
  const uint32_t u = bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 | ((abs >> 13) & 0x3ff) : 0);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to inf
  if (abs < 0x38800000u) {                        // subnormal or zero in half
    if (abs < 0x33000000u) return sign;           // below half the smallest subnormal
    // The result is a multiple of 2^-24: shift the full mantissa down.
    const uint32_t exp = abs >> 23;  // 102..112 here
    const uint32_t mant = (abs & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (v & 1))) ++v;
    return sign | static_cast<uint16_t>(v);
  }
  // Normal: rebias exponent, round mantissa to nearest even.
  uint32_t v = abs - ((127u - 15u) << 23);
  const uint32_t rem = v & 0x1fff;
  v >>= 13;
  if (rem > 0x1000 || (rem == 0x1000 && (v & 1))) ++v;  // may carry into the exponent: correct
  return sign | static_cast<uint16_t>(v);
}

float bfloat16_to_float(uint16_t b) { return from_bits(uint32_t(b) << 16); }

uint16_t float_to_bfloat16(float f) {
  uint32_t u = bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet nan
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

namespace {

// ---- element-wise combine rules -------------------------------------------

template <typename T>
T nan_min(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b < a ? b : a;
}

template <typename T>
T nan_max(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return a < b ? b : a;
}

// Integer arithmetic wraps (two's complement), as in PyTorch; done in the
// unsigned type so it is defined behaviour.
template <typename T>
T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

template <typename T>
T wrap_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;  // no int promotion
    return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
  } else {
    return a * b;
  }
}

template <typename T>
T combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return wrap_add(a, b);
    case ReduceOp::kProduct: return wrap_mul(a, b);
    case ReduceOp::kMin: return nan_min(a, b);
    case ReduceOp::kMax: return nan_max(a, b);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::kBand) return a & b;
        if (op == ReduceOp::kBor) return a | b;
        return a ^ b;
      }
      break;
  }
  return a;
}

// ---- fast paths: float32 / float64 sum and average --------------------------

template <typename T>
TDIST_CLONES
void sum_float(T* out, T* also_out, const T* const* inputs, int n, size_t count, T scale, bool do_scale) {
  T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    const T* in0 = inputs[0] + base;
    for (size_t j = 0; j < m; ++j) acc[j] = in0[j];
    for (int k = 1; k < n; ++k) {
      const T* in = inputs[k] + base;
      for (size_t j = 0; j < m; ++j) acc[j] += in[j];
    }
    if (do_scale) {
      for (size_t j = 0; j < m; ++j) acc[j] *= scale;
    }
    T* o = out + base;
    for (size_t j = 0; j < m; ++j) o[j] = acc[j];
    if (also_out) {
      T* o2 = also_out + base;
      for (size_t j = 0; j < m; ++j) o2[j] = acc[j];
    }
  }
}

// ---- reduced-precision floats: accumulate in float32 -----------------------

__attribute__((target("avx2,f16c,fma")))
void sum_half_f16c(uint16_t* out, const uint16_t* const* inputs, int n, size_t count, float scale, bool do_scale) {
  size_t i = 0;
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; i + 8 <= count; i += 8) {
    __m256 acc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(inputs[0] + i)));
    for (int k = 1; k < n; ++k) {
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(inputs[k] + i))));
    }
    if (do_scale) acc = _mm256_mul_ps(acc, vscale);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) {
    float acc = half_to_float(inputs[0][i]);
    for (int k = 1; k < n; ++k) acc += half_to_float(inputs[k][i]);
    if (do_scale) acc *= scale;
    out[i] = float_to_half(acc);
  }
}

// bfloat16 is the top half of a float32: widen by shifting, narrow by
// rounding to nearest even (NaNs stay quiet NaNs), 8 lanes at a time.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

__attribute__((target("avx2,fma"), always_inline)) inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x400000);
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, half_ulp));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
  const __m256i top = _mm256_srli_epi32(r, 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

__attribute__((target("avx2,fma")))
void sum_bf16_avx2(uint16_t* out, const uint16_t* const* inputs, int n, size_t count, float scale, bool do_scale) {
  const __m256 vscale = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 acc = load_bf16x8(inputs[0] + i);
    for (int k = 1; k < n; ++k) acc = _mm256_add_ps(acc, load_bf16x8(inputs[k] + i));
    if (do_scale) acc = _mm256_mul_ps(acc, vscale);
    store_bf16x8(out + i, acc);
  }
  for (; i < count; ++i) {
    float acc = bfloat16_to_float(inputs[0][i]);
    for (int k = 1; k < n; ++k) acc += bfloat16_to_float(inputs[k][i]);
    if (do_scale) acc *= scale;
    out[i] = float_to_bfloat16(acc);
  }
}

bool have_f16c() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                          __builtin_cpu_supports("fma");
  return yes;
}

template <bool kBf16>
TDIST_CLONES
void reduce_16bit_block(uint16_t* out, const uint16_t* const* inputs, int n, size_t base, size_t m, ReduceOp op,
                        float scale, bool do_scale) {
  float acc[kBlock];
  auto load = [](uint16_t v) { return kBf16 ? bfloat16_to_float(v) : half_to_float(v); };
  for (size_t j = 0; j < m; ++j) acc[j] = load(inputs[0][base + j]);
  for (int k = 1; k < n; ++k) {
    const uint16_t* in = inputs[k] + base;
    if (op == ReduceOp::kSum || op == ReduceOp::kAvg) {
      for (size_t j = 0; j < m; ++j) acc[j] += load(in[j]);
    } else {
      for (size_t j = 0; j < m; ++j) acc[j] = combine(acc[j], load(in[j]), op);
    }
  }
  if (do_scale) {
    for (size_t j = 0; j < m; ++j) acc[j] *= scale;
  }
  for (size_t j = 0; j < m; ++j) out[base + j] = kBf16 ? float_to_bfloat16(acc[j]) : float_to_half(acc[j]);
}

template <bool kBf16>
void reduce_16bit(uint16_t* out, const uint16_t* const* inputs, int n, size_t count, ReduceOp op, float scale,
                  bool do_scale) {
  if (have_f16c() && (op == ReduceOp::kSum || op == ReduceOp::kAvg)) {
    if (kBf16) sum_bf16_avx2(out, inputs, n, count, scale, do_scale);
    else sum_half_f16c(out, inputs, n, count, scale, do_scale);
    return;
  }
  for (size_t base = 0; base < count; base += kBlock) {
    reduce_16bit_block<kBf16>(out, inputs, n, base, std::min(kBlock, count - base), op, scale, do_scale);
  }
}

// ---- everything else ---------------------------------------------------------

template <typename T>
void reduce_generic(T* out, const T* const* inputs, int n, size_t count, ReduceOp op, double scale, bool do_scale) {
  T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    for (size_t j = 0; j < m; ++j) acc[j] = inputs[0][base + j];
    for (int k = 1; k < n; ++k) {
      const T* in = inputs[k] + base;
      for (size_t j = 0; j < m; ++j) acc[j] = combine(acc[j], in[j], op);
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (do_scale) {
        for (size_t j = 0; j < m; ++j) acc[j] = static_cast<T>(acc[j] * scale);
      }
    }
    for (size_t j = 0; j < m; ++j) out[base + j] = acc[j];  // a loop, not memcpy: CMakeLists.txt says why
  }
}

void reduce_bool(uint8_t* out, const uint8_t* const* inputs, int n, size_t count, ReduceOp op) {
  // SUM, MAX and BOR are "any"; PRODUCT, MIN and BAND are "all"; BXOR is parity.
  for (size_t i = 0; i < count; ++i) {
    uint8_t acc = inputs[0][i] != 0;
    for (int k = 1; k < n; ++k) {
      const uint8_t v = inputs[k][i] != 0;
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMax:
        case ReduceOp::kBor: acc |= v; break;
        case ReduceOp::kProduct:
        case ReduceOp::kMin:
        case ReduceOp::kBand: acc &= v; break;
        case ReduceOp::kBxor: acc ^= v; break;
        case ReduceOp::kAvg: break;  // rejected by check_reduction
      }
    }
    out[i] = acc;
  }
}

template <typename T>
const T* const* as(const void* const* p) {
  return reinterpret_cast<const T* const*>(p);
}

}  // namespace

namespace {

// ---- float32 <-> float16 / bfloat16 ------------------------------------------

__attribute__((target("avx2,f16c,fma")))
void narrow_half_f16c(uint16_t* out, const float* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) out[i] = float_to_half(in[i]);
}

__attribute__((target("avx2,f16c,fma")))
void widen_half_f16c(float* out, const uint16_t* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < count; ++i) out[i] = half_to_float(in[i]);
}

__attribute__((target("avx2,fma")))
void narrow_bf16_avx2(uint16_t* out, const float* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) store_bf16x8(out + i, _mm256_loadu_ps(in + i));
  for (; i < count; ++i) out[i] = float_to_bfloat16(in[i]);
}

__attribute__((target("avx2,fma")))
void widen_bf16_avx2(float* out, const uint16_t* in, size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load_bf16x8(in + i));
  for (; i < count; ++i) out[i] = bfloat16_to_float(in[i]);
}

bool is_16bit_float(DataType t) { return t == DataType::kFloat16 || t == DataType::kBFloat16; }

}  // namespace

bool can_convert(DataType to, DataType from) {
  return to == from || (from == DataType::kFloat32 && is_16bit_float(to)) ||
         (to == DataType::kFloat32 && is_16bit_float(from));
}

void convert(void* dst, DataType to, const void* src, DataType from, size_t count) {
  if (!can_convert(to, from)) {
    throw UsageError(std::string("convert: no conversion from ") + dtype_name(from) + " to " + dtype_name(to));
  }
  if (count == 0) return;
  if (to == from) {
    if (dst != src) std::memcpy(dst, src, count * dtype_size(to));
    return;
  }
  const bool simd = have_f16c();
  if (from == DataType::kFloat32) {
    auto* o = static_cast<uint16_t*>(dst);
    const auto* in = static_cast<const float*>(src);
    if (to == DataType::kFloat16) {
      if (simd) return narrow_half_f16c(o, in, count);
      for (size_t i = 0; i < count; ++i) o[i] = float_to_half(in[i]);
    } else {
      if (simd) return narrow_bf16_avx2(o, in, count);
      for (size_t i = 0; i < count; ++i) o[i] = float_to_bfloat16(in[i]);
    }
    return;
  }
  auto* o = static_cast<float*>(dst);
  const auto* in = static_cast<const uint16_t*>(src);
  if (from == DataType::kFloat16) {
    if (simd) return widen_half_f16c(o, in, count);
    for (size_t i = 0; i < count; ++i) o[i] = half_to_float(in[i]);
  } else {
    if (simd) return widen_bf16_avx2(o, in, count);
    for (size_t i = 0; i < count; ++i) o[i] = bfloat16_to_float(in[i]);
  }
}

void reduce_many(void* out, const void* const* inputs, int n, size_t count, DataType t, ReduceOp op,
                 int avg_divisor, void* also_out) {
  check_reduction(t, op);
  if (n < 1) throw UsageError("reduce_many: needs at least one input");
  if (count == 0) return;
  const bool scale = op == ReduceOp::kAvg;
  if (scale && avg_divisor < 1) throw UsageError("reduce_many: AVG needs a positive divisor");
  const double inv = scale ? 1.0 / avg_divisor : 1.0;
  const bool plain_sum = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  // Float sums store also_out in the same pass; the rest copy it after.
  if (plain_sum && t == DataType::kFloat32) {
    return sum_float<float>(static_cast<float*>(out), static_cast<float*>(also_out), as<float>(inputs), n, count,
                            float(inv), scale);
  }
  if (plain_sum && t == DataType::kFloat64) {
    return sum_float<double>(static_cast<double*>(out), static_cast<double*>(also_out), as<double>(inputs), n,
                             count, inv, scale);
  }
  switch (t) {
    case DataType::kFloat32:
      reduce_generic<float>(static_cast<float*>(out), as<float>(inputs), n, count, op, inv, scale);
      break;
    case DataType::kFloat64:
      reduce_generic<double>(static_cast<double*>(out), as<double>(inputs), n, count, op, inv, scale);
      break;
    case DataType::kFloat16:
      reduce_16bit<false>(static_cast<uint16_t*>(out), as<uint16_t>(inputs), n, count, op, float(inv), scale);
      break;
    case DataType::kBFloat16:
      reduce_16bit<true>(static_cast<uint16_t*>(out), as<uint16_t>(inputs), n, count, op, float(inv), scale);
      break;
    case DataType::kInt8:
      reduce_generic<int8_t>(static_cast<int8_t*>(out), as<int8_t>(inputs), n, count, op, 1, false);
      break;
    case DataType::kUInt8:
      reduce_generic<uint8_t>(static_cast<uint8_t*>(out), as<uint8_t>(inputs), n, count, op, 1, false);
      break;
    case DataType::kInt32:
      reduce_generic<int32_t>(static_cast<int32_t*>(out), as<int32_t>(inputs), n, count, op, 1, false);
      break;
    case DataType::kInt64:
      reduce_generic<int64_t>(static_cast<int64_t*>(out), as<int64_t>(inputs), n, count, op, 1, false);
      break;
    case DataType::kBool:
      reduce_bool(static_cast<uint8_t*>(out), as<uint8_t>(inputs), n, count, op);
      break;
  }
  if (also_out) std::memcpy(also_out, out, count * dtype_size(t));
}

}  // namespace tdist::comm

// Reduction kernels and 16-bit float conversions.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <random>

#include "comm/reduce.h"
#include "tdist/errors.h"

using namespace tdist::comm;

namespace {

__attribute__((target("f16c"))) uint16_t hw_float_to_half(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_half_to_float(uint16_t h) { return _cvtsh_ss(h); }

bool same_float(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

TEST(HalfConversion, EveryHalfMatchesTheHardware) {
  ASSERT_TRUE(__builtin_cpu_supports("f16c"));
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    ASSERT_TRUE(same_float(f, hw_half_to_float(static_cast<uint16_t>(h)))) << "half 0x" << std::hex << h;
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_half(f), h) << "round trip of 0x" << std::hex << h;
    }
  }
}

TEST(HalfConversion, RoundingMatchesTheHardware) {
  std::mt19937 rng(42);
  std::vector<float> cases = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.98023224e-8f, 5.96e-8f,
                              6.1035e-5f, 6.09e-5f, INFINITY, -INFINITY, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048};
  for (int i = 0; i < 1'000'000; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    if (!std::isnan(f)) cases.push_back(f);
    // Bias towards the half range, where rounding matters.
    cases.push_back(std::ldexp(static_cast<float>(rng() % 100000) / 100000.0f, static_cast<int>(rng() % 40) - 26));
  }
  for (float f : cases) {
    ASSERT_EQ(float_to_half(f), hw_float_to_half(f)) << "float " << f;
  }
}

TEST(BFloat16Conversion, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bfloat16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bfloat16 values: ties to even.
  EXPECT_EQ(float_to_bfloat16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(float_to_bfloat16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(bfloat16_to_float(0x3f81), 1.0f + 1.0f / 128);
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(NAN))));
  EXPECT_EQ(float_to_bfloat16(INFINITY), 0x7f80);
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bfloat16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_bfloat16(f), b);
    }
  }
}

// A naive reference over doubles / int64.
template <typename T>
std::vector<T> naive(const std::vector<std::vector<T>>& in, ReduceOp op) {
  std::vector<T> out = in[0];
  for (size_t k = 1; k < in.size(); ++k) {
    for (size_t i = 0; i < out.size(); ++i) {
      T a = out[i], b = in[k][i];
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: out[i] = static_cast<T>(a + b); break;
        case ReduceOp::kProduct: out[i] = static_cast<T>(a * b); break;
        case ReduceOp::kMin: out[i] = std::min(a, b); break;
        case ReduceOp::kMax: out[i] = std::max(a, b); break;
        case ReduceOp::kBand: if constexpr (std::is_integral_v<T>) out[i] = a & b; break;
        case ReduceOp::kBor: if constexpr (std::is_integral_v<T>) out[i] = a | b; break;
        case ReduceOp::kBxor: if constexpr (std::is_integral_v<T>) out[i] = a ^ b; break;
      }
    }
  }
  if (op == ReduceOp::kAvg) {
    if constexpr (std::is_floating_point_v<T>) {
      for (auto& v : out) v = static_cast<T>(v * (T(1) / static_cast<T>(in.size())));
    }
  }
  return out;
}

template <typename T>
void check_type(DataType t, std::vector<ReduceOp> ops) {
  std::mt19937 rng(7);
  for (ReduceOp op : ops) {
    for (int n : {1, 2, 3, 5}) {
      for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(513), size_t(5000)}) {
        std::vector<std::vector<T>> in(n, std::vector<T>(count));
        for (auto& v : in)
          for (auto& x : v) x = static_cast<T>(static_cast<int>(rng() % 9) - (std::is_signed_v<T> ? 4 : 0));
        std::vector<const void*> ptrs;
        for (auto& v : in) ptrs.push_back(v.data());
        std::vector<T> out(count);
        reduce_many(out.data(), ptrs.data(), n, count, t, op, n);
        EXPECT_EQ(out, naive(in, op)) << dtype_name(t) << " " << reduce_op_name(op) << " n=" << n << " count=" << count;
        // In place: the output aliases the first input.
        std::vector<T> first = in[0];
        ptrs[0] = first.data();
        reduce_many(first.data(), ptrs.data(), n, count, t, op, n);
        EXPECT_EQ(first, out) << "aliased output";
      }
    }
  }
}

TEST(ReduceMany, MatchesANaiveLoopForEveryType) {
  const std::vector<ReduceOp> float_ops = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax};
  const std::vector<ReduceOp> int_ops = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                                         ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};
  check_type<float>(DataType::kFloat32, float_ops);
  check_type<double>(DataType::kFloat64, float_ops);
  check_type<int8_t>(DataType::kInt8, int_ops);
  check_type<uint8_t>(DataType::kUInt8, int_ops);
  check_type<int32_t>(DataType::kInt32, int_ops);
  check_type<int64_t>(DataType::kInt64, int_ops);
}

TEST(ReduceMany, IntegersWrapAround) {
  int8_t a[] = {120, -128}, b[] = {10, -1};
  const void* in[] = {a, b};
  int8_t out[2];
  reduce_many(out, in, 2, 2, DataType::kInt8, ReduceOp::kSum, 2);
  EXPECT_EQ(out[0], static_cast<int8_t>(-126));
  EXPECT_EQ(out[1], static_cast<int8_t>(127));
}

TEST(ReduceMany, HalfSumsAccumulateInFloat32) {
  // 2048 + 1 + 1: rounding after each add (half spacing is 2 at 2048) gives
  // 2048; accumulating in float32 and rounding once gives 2050.
  const uint16_t big = float_to_half(2048.0f), one = float_to_half(1.0f);
  for (size_t count : {size_t(1), size_t(8), size_t(19)}) {  // scalar and vector paths
    std::vector<uint16_t> a(count, big), b(count, one), c(count, one), out(count);
    const void* in[] = {a.data(), b.data(), c.data()};
    reduce_many(out.data(), in, 3, count, DataType::kFloat16, ReduceOp::kSum, 3);
    for (uint16_t v : out) EXPECT_EQ(half_to_float(v), 2050.0f);
    reduce_many(out.data(), in, 3, count, DataType::kBFloat16, ReduceOp::kSum, 3);
  }
  // bfloat16 at 256 has spacing 2: 256 + 1 + 1 = 258 only with one rounding.
  std::vector<uint16_t> a(5, float_to_bfloat16(256.0f)), b(5, float_to_bfloat16(1.0f)), out(5);
  const void* in[] = {a.data(), b.data(), b.data()};
  reduce_many(out.data(), in, 3, 5, DataType::kBFloat16, ReduceOp::kSum, 3);
  for (uint16_t v : out) EXPECT_EQ(bfloat16_to_float(v), 258.0f);
  reduce_many(out.data(), in, 3, 5, DataType::kBFloat16, ReduceOp::kAvg, 3);
  for (uint16_t v : out) EXPECT_EQ(bfloat16_to_float(v), 86.0f);
}

TEST(ReduceMany, VectorBFloat16SumMatchesTheScalarRoundingBitForBit) {
  // Random bit patterns (NaNs, infinities, subnormals, ties included), sums
  // and averages of three inputs, on lengths that use both the 8-lane loop
  // and the scalar tail; the reference rounds once with float_to_bfloat16.
  std::mt19937 rng(7);
  const size_t count = 4099;
  std::vector<std::vector<uint16_t>> in(3, std::vector<uint16_t>(count));
  for (auto& v : in) {
    for (auto& x : v) x = static_cast<uint16_t>(rng());
  }
  in[0][0] = 0x7fc0;                                  // NaN
  in[0][1] = 0x7f80;                                  // +inf
  in[0][2] = float_to_bfloat16(1.0f), in[1][2] = float_to_bfloat16(1.0f / 256), in[2][2] = 0;  // a tie
  const void* ptrs[] = {in[0].data(), in[1].data(), in[2].data()};
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    std::vector<uint16_t> out(count);
    reduce_many(out.data(), ptrs, 3, count, DataType::kBFloat16, op, 3);
    for (size_t i = 0; i < count; ++i) {
      float acc = bfloat16_to_float(in[0][i]) + bfloat16_to_float(in[1][i]) + bfloat16_to_float(in[2][i]);
      if (op == ReduceOp::kAvg) acc *= 1.0f / 3;
      const uint16_t want = float_to_bfloat16(acc);
      if (std::isnan(acc)) {
        ASSERT_TRUE(std::isnan(bfloat16_to_float(out[i]))) << "element " << i;
      } else {
        ASSERT_EQ(out[i], want) << "element " << i << " op " << static_cast<int>(op);
      }
    }
  }
}

TEST(ReduceMany, MinAndMaxPropagateNaN) {
  float a[] = {1.0f, NAN}, b[] = {NAN, 2.0f}, out[2];
  const void* in[] = {a, b};
  reduce_many(out, in, 2, 2, DataType::kFloat32, ReduceOp::kMin, 2);
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1]));
  reduce_many(out, in, 2, 2, DataType::kFloat32, ReduceOp::kMax, 2);
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1]));
}

TEST(ReduceMany, BoolOps) {
  uint8_t a[] = {0, 0, 1, 1}, b[] = {0, 1, 0, 1}, out[4];
  const void* in[] = {a, b};
  reduce_many(out, in, 2, 4, DataType::kBool, ReduceOp::kSum, 2);
  EXPECT_EQ(std::vector<uint8_t>(out, out + 4), (std::vector<uint8_t>{0, 1, 1, 1}));
  reduce_many(out, in, 2, 4, DataType::kBool, ReduceOp::kMin, 2);
  EXPECT_EQ(std::vector<uint8_t>(out, out + 4), (std::vector<uint8_t>{0, 0, 0, 1}));
  reduce_many(out, in, 2, 4, DataType::kBool, ReduceOp::kBxor, 2);
  EXPECT_EQ(std::vector<uint8_t>(out, out + 4), (std::vector<uint8_t>{0, 1, 1, 0}));
}

TEST(ReduceMany, RejectsMeaninglessCombinations) {
  float f = 0;
  const void* in[] = {&f};
  EXPECT_THROW(reduce_many(&f, in, 1, 1, DataType::kFloat32, ReduceOp::kBxor, 1), tdist::UsageError);
  int32_t i = 0;
  const void* iin[] = {&i};
  EXPECT_THROW(reduce_many(&i, iin, 1, 1, DataType::kInt32, ReduceOp::kAvg, 1), tdist::UsageError);
}

}  // namespace

// convert() is what the shm backend narrows and widens with
// (AllreduceOptions::wire_dtype): its vector paths give the scalar
// conversions' bits, at every length (tails included).
TEST(Convert, VectorPathsMatchTheScalarConversions) {
  std::mt19937 rng(7);
  std::vector<float> in;
  for (int i = 0; i < 4099; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    in.push_back(i % 3 == 0 ? f : std::ldexp(static_cast<float>(rng() % 100000) / 100000.0f, int(rng() % 40) - 26));
  }
  for (float special : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 65520.0f, 1.0f + 1.0f / 2048, 1.0f + 1.0f / 256}) {
    in.push_back(special);
  }
  for (size_t len : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), in.size()}) {
    std::vector<uint16_t> h(len), b(len);
    convert(h.data(), DataType::kFloat16, in.data(), DataType::kFloat32, len);
    convert(b.data(), DataType::kBFloat16, in.data(), DataType::kFloat32, len);
    std::vector<float> hw(len), bw(len);
    convert(hw.data(), DataType::kFloat32, h.data(), DataType::kFloat16, len);
    convert(bw.data(), DataType::kFloat32, b.data(), DataType::kBFloat16, len);
    for (size_t i = 0; i < len; ++i) {
      if (std::isnan(in[i])) {
        EXPECT_TRUE(std::isnan(half_to_float(h[i])) && std::isnan(bfloat16_to_float(b[i]))) << i;
        EXPECT_TRUE(std::isnan(hw[i]) && std::isnan(bw[i])) << i;
        continue;
      }
      ASSERT_EQ(h[i], float_to_half(in[i])) << "float16 of " << in[i] << " at " << i << " of " << len;
      ASSERT_EQ(b[i], float_to_bfloat16(in[i])) << "bfloat16 of " << in[i] << " at " << i << " of " << len;
      ASSERT_TRUE(same_float(hw[i], half_to_float(h[i]))) << i;
      ASSERT_TRUE(same_float(bw[i], bfloat16_to_float(b[i]))) << i;
    }
  }
}

TEST(Convert, SameTypeCopiesAndOtherPairsAreRefused) {
  const std::vector<int64_t> src = {1, -2, 3};
  std::vector<int64_t> dst(3);
  convert(dst.data(), DataType::kInt64, src.data(), DataType::kInt64, 3);
  EXPECT_EQ(dst, src);
  EXPECT_FALSE(can_convert(DataType::kFloat16, DataType::kFloat64));
  EXPECT_FALSE(can_convert(DataType::kFloat16, DataType::kBFloat16));
  float f = 1;
  double d = 0;
  EXPECT_THROW(convert(&d, DataType::kFloat64, &f, DataType::kFloat32, 1), tdist::UsageError);
}

// also_out receives the same result as out: in the float sums' own pass,
// by a copy for the rest.
TEST(ReduceMany, AlsoOutGetsTheResultToo) {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 1e-3f, 7.0f}, b = {0.5f, 4.0f, -1.25f, 2e-3f, 9.0f};
  const void* fin[] = {a.data(), b.data()};
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    std::vector<float> out(a.size()), also(a.size(), -99.0f), plain(a.size());
    reduce_many(out.data(), fin, 2, a.size(), DataType::kFloat32, op, 2, also.data());
    reduce_many(plain.data(), fin, 2, a.size(), DataType::kFloat32, op, 2);
    EXPECT_EQ(out, plain);
    EXPECT_EQ(also, plain);
  }
  const std::vector<int64_t> x = {1, -5, 9}, y = {4, 2, -9};
  const void* iin[] = {x.data(), y.data()};
  std::vector<int64_t> out(3), also(3);
  reduce_many(out.data(), iin, 2, 3, DataType::kInt64, ReduceOp::kSum, 1, also.data());
  EXPECT_EQ(out, (std::vector<int64_t>{5, -3, 0}));
  EXPECT_EQ(also, out);
}

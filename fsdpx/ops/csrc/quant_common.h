// Shared by the CPU quantization kernels (quant.cpp: int8 / fp8; quant_int4.cpp: int4 and
// the fused dequantize-accumulate): the per-block driver and what it needs. Everything is in
// an anonymous namespace on purpose: each translation unit gets its own copy of the
// target_clones functions (and of their ifunc resolvers), so no clone is shared across
// units and the one-definition rule never applies to them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

// Runtime CPU dispatch, as in adam.cpp: the per-block loops are GCC target_clones functions
// (AVX-512, AVX2, SSE2 baseline) and the dynamic loader picks one for the running CPU. IEEE
// division, min/max and the rounding below give the same bits at every vector width.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPX_QUANT_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDPX_QUANT_CLONES
#endif

namespace fsdpx::quant {
namespace {

// Adding then subtracting 1.5 * 2^23 rounds |y| < 2^22 to the nearest integer, ties to even
// (the hardware's default mode), exactly like torch.round. Unlike std::nearbyint it
// vectorises with plain SSE2, which is all a build without -march flags may assume.
constexpr float kRoundMagic = 12582912.0f;
// Elements per parallel task: small enough to use every core on a 1M-element bucket, big
// enough that the scheduling cost is noise.
constexpr int64_t kGrainElements = 1 << 16;

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

inline float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

struct BlockStats {
  float absmax;
  bool finite;
};

// |x| of a non-NaN float orders like its bit pattern, so the max is taken on integers: a
// float max reduction does not vectorise without -ffast-math, an integer one does. Any
// exponent of all ones (inf or NaN) marks the block non-finite.
template <typename scalar_t>
FSDPX_QUANT_CLONES BlockStats block_stats(const scalar_t* x, int64_t n) {
  uint32_t amax = 0;
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits_of(static_cast<float>(x[i])) & 0x7fffffffu;
    amax = b > amax ? b : amax;
    bad |= static_cast<uint32_t>(b >= 0x7f800000u);
  }
  return {float_of(amax), bad == 0};
}

int64_t num_blocks(int64_t numel, int64_t block_size) {
  return (numel + block_size - 1) / block_size;
}

void check_input(const at::Tensor& x, int64_t block_size, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": expected a CPU tensor, got device ", x.device());
  TORCH_CHECK(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
          x.scalar_type() == at::kHalf,
      op, ": expected float32, bfloat16 or float16 input, got ", x.scalar_type());
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
}

// Shared driver of every format: per block of `x` (contiguous), writes its scale and calls
// `store(x_block, n, divisor, start)` for a finite block or `poison(start, n)` for one with
// inf/nan, `start` being the block's first element index.
template <typename Store, typename Poison>
void quantize_blocks(const at::Tensor& x, int64_t block_size, float qmax, float* s_ptr,
                     Store store, Poison poison) {
  const int64_t n = x.numel();
  const int64_t nb = num_blocks(n, block_size);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  const auto dtype = x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_quantize", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * block_size;
        const int64_t len = std::min(block_size, n - start);
        const BlockStats st = block_stats(x_ptr + start, len);
        if (!st.finite) {
          // Non-finite blocks are poisoned, not clipped: the NaN scale makes the whole block
          // dequantize to NaN so an overflow check downstream (loss scaling) still fires.
          s_ptr[b] = std::numeric_limits<float>::quiet_NaN();
          poison(start, len);
          continue;
        }
        const float scale = st.absmax / qmax;
        s_ptr[b] = scale;
        // A zero scale (all zeros, or an absmax so small that absmax / qmax underflows)
        // divides by one instead, which rounds every element to (signed) zero.
        store(x_ptr + start, len, scale == 0.0f ? 1.0f : scale, start);
      }
    });
  });
}

}  // namespace
}  // namespace fsdpx::quant

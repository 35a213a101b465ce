// Blockwise symmetric quantization on CPU: int8 (scale = absmax / 127), fp8 e4m3fn
// (scale = absmax / 448) and packed int4 (scale = absmax / 7, two values per byte), one fp32
// scale per `block_size` consecutive elements of the flattened input, the last block partial;
// and the fused dequantize-accumulate (acc += q * scale, fp32) that qgZ sums with. The
// contract (rounding, non-finite blocks, packing, error bound) is written once, in
// fsdpx/ops/quant.py and fsdpx/ops/quant_int4.py; their pure-PyTorch references are the spec
// and these kernels are bitwise equal to them. Schemas are in schemas.cpp.
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

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;
constexpr float kInt4Max = 7.0f;
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

// The one-byte formats: q has x's shape.
template <typename q_t, typename Store>
std::tuple<at::Tensor, at::Tensor> quantize_bytes(
    const at::Tensor& input, int64_t block_size, float qmax, at::ScalarType q_dtype,
    Store store) {
  const at::Tensor x = input.contiguous();
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(q_dtype));
  at::Tensor scales =
      at::empty({num_blocks(x.numel(), block_size)}, x.options().dtype(at::kFloat));
  q_t* q_ptr = static_cast<q_t*>(q.data_ptr());
  quantize_blocks(
      x, block_size, qmax, scales.data_ptr<float>(),
      [&](const auto* p, int64_t len, float d, int64_t start) { store(p, len, d, q_ptr + start); },
      [&](int64_t start, int64_t len) { std::memset(q_ptr + start, 0, len * sizeof(q_t)); });
  return {q, scales};
}

template <typename scalar_t>
FSDPX_QUANT_CLONES void store_int8(const scalar_t* __restrict x, int64_t n, float divisor,
                                   int8_t* __restrict q) {
  for (int64_t i = 0; i < n; ++i) {
    float y = static_cast<float>(x[i]) / divisor;
    y = (y + kRoundMagic) - kRoundMagic;
    y = std::min(std::max(y, -kInt8Max), kInt8Max);
    q[i] = static_cast<int8_t>(y);
  }
}

// clamp(f, -448, 448) then c10::detail::fp8e4m3fn_from_fp32_value (the routine behind
// Tensor.to(float8_e4m3fn)), for finite f, written without branches so the loop vectorises
// (the float clamp plus c10's branches defeat GCC's if-conversion). The clamp is done on the
// magnitude's bits, which order like the magnitudes; after it c10's overflow and NaN cases
// cannot occur, and the remaining two cases become one select. Same bits as the reference
// (checked exhaustively over [-448, 448] at a stride of 16 ulps, and by the tests).
inline uint8_t fp8_e4m3fn_bits_clamped(float f) {
  constexpr uint32_t kMaxBits = UINT32_C(0x43E00000);     // 448.0f
  constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // ((127 - 7) + (23 - 3) + 1) << 23
  constexpr uint32_t kMinNormal = UINT32_C(121) << 23;    // 2^-6, the smallest normal e4m3
  uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  u &= 0x7FFFFFFFu;
  u = u < kMaxBits ? u : kMaxBits;
  // Below 2^-6: adding 2^14 as a float rounds onto the subnormal grid (ties to even).
  const uint32_t subnormal = bits_of(float_of(u) + float_of(kDenormMagic)) - kDenormMagic;
  // Normal: rebias the exponent and round the mantissa to 3 bits, ties to even.
  const uint32_t normal =
      (u + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(((u < kMinNormal ? subnormal : normal) & 0xFFu) | sign);
}

template <typename scalar_t>
FSDPX_QUANT_CLONES void store_fp8(const scalar_t* __restrict x, int64_t n, float divisor,
                                  c10::Float8_e4m3fn* __restrict q) {
  uint8_t* out = reinterpret_cast<uint8_t*>(q);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = fp8_e4m3fn_bits_clamped(static_cast<float>(x[i]) / divisor);
  }
}

// One int4 value as its stored nibble q + 8 (1..15), by the int8 rule with qmax 7: clamping
// to +-7 before or after rounding to an integer gives the same integer.
inline uint32_t int4_nibble(float v, float divisor) {
  float y = v / divisor;
  y = (y + kRoundMagic) - kRoundMagic;
  y = std::min(std::max(y, -kInt4Max), kInt4Max);
  return static_cast<uint32_t>(static_cast<int32_t>(y) + 8);
}

// Element 2i is the low nibble of byte i, 2i + 1 the high one; an odd tail (only the last
// block of an odd-length tensor: blocks are even-sized) gets a zero (8) high nibble.
template <typename scalar_t>
FSDPX_QUANT_CLONES void store_int4(const scalar_t* __restrict x, int64_t n, float divisor,
                                   uint8_t* __restrict packed) {
  const int64_t pairs = n / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint32_t lo = int4_nibble(static_cast<float>(x[2 * i]), divisor);
    const uint32_t hi = int4_nibble(static_cast<float>(x[2 * i + 1]), divisor);
    packed[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (n % 2) {
    packed[pairs] =
        static_cast<uint8_t>(int4_nibble(static_cast<float>(x[n - 1]), divisor) | (8u << 4));
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size) {
  check_input(x, block_size, "fsdpx::quantize_int8");
  return quantize_bytes<int8_t>(
      x, block_size, kInt8Max, at::kChar,
      [](auto* p, int64_t n, float d, int8_t* q) { store_int8(p, n, d, q); });
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cpu(const at::Tensor& x, int64_t block_size) {
  check_input(x, block_size, "fsdpx::quantize_fp8");
  return quantize_bytes<c10::Float8_e4m3fn>(
      x, block_size, kFp8Max, at::kFloat8_e4m3fn,
      [](auto* p, int64_t n, float d, c10::Float8_e4m3fn* q) { store_fp8(p, n, d, q); });
}

template <typename q_t, typename out_t>
FSDPX_QUANT_CLONES void dequantize_block(const q_t* __restrict q, int64_t n, float scale,
                                         out_t* __restrict out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<out_t>(static_cast<float>(q[i]) * scale);
  }
}

template <typename q_t>
at::Tensor dequantize_blocks(
    const at::Tensor& q_in, const at::Tensor& scales_in, int64_t block_size,
    at::ScalarType dtype, at::ScalarType q_dtype, const char* op) {
  TORCH_CHECK(q_in.device().is_cpu() && scales_in.device().is_cpu(), op,
              ": expected CPU tensors, got q on ", q_in.device(), " and scales on ",
              scales_in.device());
  TORCH_CHECK(q_in.scalar_type() == q_dtype, op, ": expected q of dtype ", q_dtype, ", got ",
              q_in.scalar_type());
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat, op, ": expected float32 scales, got ",
              scales_in.scalar_type());
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": expected output dtype float32, bfloat16 or float16, got ", dtype);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  const int64_t n = q.numel();
  const int64_t nb = num_blocks(n, block_size);
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == nb, op, ": expected ", nb,
              " scales for ", n, " elements in blocks of ", block_size, ", got shape ",
              scales.sizes(), "; pass the block_size used to quantize");
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  const q_t* q_ptr = static_cast<const q_t*>(q.data_ptr());
  const float* s_ptr = scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_dequantize", [&] {
    scalar_t* o_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * block_size;
        const int64_t len = std::min(block_size, n - start);
        dequantize_block(q_ptr + start, len, s_ptr[b], o_ptr + start);
      }
    });
  });
  return out;
}

at::Tensor dequantize_int8_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               at::ScalarType dtype) {
  return dequantize_blocks<int8_t>(q, scales, block_size, dtype, at::kChar,
                                   "fsdpx::dequantize_int8");
}

at::Tensor dequantize_fp8_cpu(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                              at::ScalarType dtype) {
  return dequantize_blocks<c10::Float8_e4m3fn>(q, scales, block_size, dtype,
                                               at::kFloat8_e4m3fn, "fsdpx::dequantize_fp8");
}

std::tuple<at::Tensor, at::Tensor> quantize_int4_cpu(const at::Tensor& input,
                                                     int64_t block_size) {
  check_input(input, block_size, "fsdpx::quantize_int4");
  TORCH_CHECK(block_size % 2 == 0, "fsdpx::quantize_int4: block_size must be even (two values "
              "share a byte), got ", block_size);
  const at::Tensor x = input.contiguous();
  const int64_t n = x.numel();
  // Blocks start at even elements, so each owns whole bytes and the tasks never share one.
  at::Tensor packed = at::empty({(n + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  uint8_t* p_ptr = packed.data_ptr<uint8_t>();
  quantize_blocks(
      x, block_size, kInt4Max, scales.data_ptr<float>(),
      [&](const auto* p, int64_t len, float d, int64_t start) {
        store_int4(p, len, d, p_ptr + start / 2);
      },
      // A poisoned block stores q = 0 for every value: nibbles 8, bytes 0x88.
      [&](int64_t start, int64_t len) { std::memset(p_ptr + start / 2, 0x88, (len + 1) / 2); });
  return {packed, scales};
}

inline float int4_value(uint32_t nibble) {
  return static_cast<float>(static_cast<int32_t>(nibble) - 8);
}

template <typename out_t>
FSDPX_QUANT_CLONES void dequantize_int4_block(const uint8_t* __restrict packed, int64_t n,
                                              float scale, out_t* __restrict out) {
  const int64_t pairs = n / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    out[2 * i] = static_cast<out_t>(int4_value(packed[i] & 0xFu) * scale);
    out[2 * i + 1] = static_cast<out_t>(int4_value(packed[i] >> 4) * scale);
  }
  if (n % 2) out[n - 1] = static_cast<out_t>(int4_value(packed[pairs] & 0xFu) * scale);
}

// The checks shared by dequantize_int4 and the accumulate ops: a uint8 payload of
// ceil(numel / 2) bytes (int4) or an int8 one of numel (int8), and ceil(numel / block_size)
// contiguous-able float32 scales, all on the CPU.
void check_payload(const at::Tensor& q, const at::Tensor& scales, int64_t numel,
                   int64_t block_size, bool int4, const char* op) {
  TORCH_CHECK(q.device().is_cpu() && scales.device().is_cpu(), op,
              ": expected CPU tensors, got q on ", q.device(), " and scales on ",
              scales.device());
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
  TORCH_CHECK(!int4 || block_size % 2 == 0, op,
              ": int4 block_size must be even (two values share a byte), got ", block_size);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  const at::ScalarType q_dtype = int4 ? at::kByte : at::kChar;
  const int64_t q_numel = int4 ? (numel + 1) / 2 : numel;
  TORCH_CHECK(q.scalar_type() == q_dtype && q.numel() == q_numel, op, ": expected a ",
              q_dtype, " payload of ", q_numel, " elements for ", numel, " values, got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t nb = num_blocks(numel, block_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == nb,
              op, ": expected ", nb, " float32 scales for ", numel, " values in blocks of ",
              block_size, ", got ", scales.scalar_type(), " ", scales.sizes(),
              "; pass the block_size used to quantize");
}

at::Tensor dequantize_int4_cpu(const at::Tensor& packed_in, const at::Tensor& scales_in,
                               int64_t numel, int64_t block_size, at::ScalarType dtype) {
  const char* op = "fsdpx::dequantize_int4";
  check_payload(packed_in, scales_in, numel, block_size, true, op);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": expected output dtype float32, bfloat16 or float16, got ", dtype);
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  const uint8_t* p_ptr = packed.data_ptr<uint8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_dequantize_int4", [&] {
    scalar_t* o_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_blocks(numel, block_size), grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = b * block_size;
        dequantize_int4_block(p_ptr + start / 2, std::min(block_size, numel - start), s_ptr[b],
                              o_ptr + start);
      }
    });
  });
  return out;
}

// acc += q * scale in float32: the product is rounded to float32 first and then added, one
// rounding each (-ffp-contract=off keeps them apart), as in `acc += dequantize(...)`.
FSDPX_QUANT_CLONES void accumulate_int8_block(const int8_t* __restrict q, int64_t n, float scale,
                                              float* __restrict acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] + static_cast<float>(q[i]) * scale;
}

FSDPX_QUANT_CLONES void accumulate_int4_block(const uint8_t* __restrict packed, int64_t n,
                                              float scale, float* __restrict acc) {
  const int64_t pairs = n / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    acc[2 * i] = acc[2 * i] + int4_value(packed[i] & 0xFu) * scale;
    acc[2 * i + 1] = acc[2 * i + 1] + int4_value(packed[i] >> 4) * scale;
  }
  if (n % 2) acc[n - 1] = acc[n - 1] + int4_value(packed[pairs] & 0xFu) * scale;
}

template <bool kInt4>
void dequantize_accumulate(const at::Tensor& acc, const at::Tensor& q_in,
                           const at::Tensor& scales_in, int64_t block_size, const char* op) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kFloat && acc.is_contiguous(),
              op, ": expected a contiguous float32 CPU accumulator, got a ",
              acc.is_contiguous() ? "contiguous " : "non-contiguous ", acc.scalar_type(),
              " tensor on ", acc.device());
  const int64_t n = acc.numel();
  check_payload(q_in, scales_in, n, block_size, kInt4, op);
  const at::Tensor q = q_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  float* a_ptr = acc.data_ptr<float>();
  const float* s_ptr = scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  at::parallel_for(0, num_blocks(n, block_size), grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block_size;
      const int64_t len = std::min(block_size, n - start);
      if constexpr (kInt4) {
        accumulate_int4_block(q.data_ptr<uint8_t>() + start / 2, len, s_ptr[b], a_ptr + start);
      } else {
        accumulate_int8_block(q.data_ptr<int8_t>() + start, len, s_ptr[b], a_ptr + start);
      }
    }
  });
}

void dequantize_accumulate_int8_cpu(const at::Tensor& acc, const at::Tensor& q,
                                    const at::Tensor& scales, int64_t block_size) {
  dequantize_accumulate<false>(acc, q, scales, block_size, "fsdpx::dequantize_accumulate_int8");
}

void dequantize_accumulate_int4_cpu(const at::Tensor& acc, const at::Tensor& packed,
                                    const at::Tensor& scales, int64_t block_size) {
  dequantize_accumulate<true>(acc, packed, scales, block_size,
                              "fsdpx::dequantize_accumulate_int4");
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpx, CPU, m) {
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("quantize_fp8", &quantize_fp8_cpu);
  m.impl("dequantize_fp8", &dequantize_fp8_cpu);
  m.impl("quantize_int4", &quantize_int4_cpu);
  m.impl("dequantize_int4", &dequantize_int4_cpu);
  m.impl("dequantize_accumulate_int8", &dequantize_accumulate_int8_cpu);
  m.impl("dequantize_accumulate_int4", &dequantize_accumulate_int4_cpu);
}

}  // namespace fsdpx::quant

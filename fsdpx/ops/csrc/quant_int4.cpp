// Packed int4 quantization on CPU (scale = absmax / 7, two values per byte, even block
// sizes) and the fused dequantize-accumulate of int8 and int4 payloads into a float32 buffer
// (acc += q * scale) that qgZ sums with. The contracts are in fsdpx/ops/quant_int4.py and
// fsdpx/ops/quant.py; these kernels are bitwise equal to their pure-PyTorch references.
// Schemas are in schemas.cpp; the shared per-block driver in quant_common.h.
#include "quant_common.h"

namespace fsdpx::quant {
namespace {

constexpr float kInt4Max = 7.0f;

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
  m.impl("quantize_int4", &quantize_int4_cpu);
  m.impl("dequantize_int4", &dequantize_int4_cpu);
  m.impl("dequantize_accumulate_int8", &dequantize_accumulate_int8_cpu);
  m.impl("dequantize_accumulate_int4", &dequantize_accumulate_int4_cpu);
}

}  // namespace fsdpx::quant

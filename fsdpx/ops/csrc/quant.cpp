// Blockwise symmetric quantization on CPU: int8 (scale = absmax / 127) and fp8 e4m3fn
// (scale = absmax / 448), one fp32 scale per `block_size` consecutive elements of the
// flattened input, the last block partial. The contract (rounding, non-finite blocks, error
// bound) is written once, in fsdpx/ops/quant.py; its pure-PyTorch reference is the spec and
// this kernel is bitwise equal to it. Schemas are in schemas.cpp; the per-block driver is
// shared with the int4 kernels (quant_int4.cpp) in quant_common.h.
#include "quant_common.h"

namespace fsdpx::quant {
namespace {

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;

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

}  // namespace

TORCH_LIBRARY_IMPL(fsdpx, CPU, m) {
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("quantize_fp8", &quantize_fp8_cpu);
  m.impl("dequantize_fp8", &dequantize_fp8_cpu);
}

}  // namespace fsdpx::quant

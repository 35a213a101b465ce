// Blockwise symmetric quantization on CUDA: the twin of csrc/quant.cpp (int8, fp8, packed
// int4 and the fused dequantize-accumulate), with the contracts (and the references they
// are bitwise equal to) in fsdpx/ops/quant.py and fsdpx/ops/quant_int4.py. One thread block per
// quantization block (grid-stride over blocks): a block-wide reduction gives absmax and the
// non-finite flag, then every thread converts its strided elements. Only c10/cuda headers:
// ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers that a minimal toolkit lacks.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace fsdpx::quant_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 1 << 20;
constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;
constexpr float kInt4Max = 7.0f;

enum class Format { kInt8, kFp8 };

// |x| of a non-NaN float orders like its bit pattern, so the block max is an integer max
// (as on the CPU); an exponent of all ones (inf/NaN) sets the non-finite flag.
__device__ __forceinline__ void reduce_block(uint32_t& amax, uint32_t& bad) {
  __shared__ uint32_t s_amax[kThreads / 32];
  __shared__ uint32_t s_bad[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    bad |= __shfl_xor_sync(0xffffffffu, bad, o);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    s_amax[warp] = amax;
    s_bad[warp] = bad;
  }
  __syncthreads();
  amax = 0;
  bad = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    amax = max(amax, s_amax[w]);
    bad |= s_bad[w];
  }
  __syncthreads();  // s_amax/s_bad are reused by the next grid-stride iteration
}

template <Format F, typename scalar_t, typename q_t>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t block_size,
                    int64_t n_blocks, q_t* __restrict__ q, float* __restrict__ scales) {
  constexpr float qmax = F == Format::kInt8 ? kInt8Max : kFp8Max;
  for (int64_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    const int64_t start = b * block_size;
    const int64_t len = min(block_size, n - start);
    uint32_t amax = 0;
    uint32_t bad = 0;
    for (int64_t i = threadIdx.x; i < len; i += kThreads) {
      const uint32_t bits = __float_as_uint(static_cast<float>(x[start + i])) & 0x7fffffffu;
      amax = max(amax, bits);
      bad |= static_cast<uint32_t>(bits >= 0x7f800000u);
    }
    reduce_block(amax, bad);
    // Every thread computes the same scale from the same reduced values: no broadcast needed.
    const float scale = __fdiv_rn(__uint_as_float(amax), qmax);
    if (threadIdx.x == 0) scales[b] = bad ? __int_as_float(0x7fc00000) : scale;
    const float divisor = scale == 0.0f ? 1.0f : scale;
    for (int64_t i = threadIdx.x; i < len; i += kThreads) {
      if (bad) {
        q[start + i] = q_t(0);  // poisoned block: NaN scale, zero payload (see quant.py)
        continue;
      }
      const float y = __fdiv_rn(static_cast<float>(x[start + i]), divisor);
      const float clamped = fminf(fmaxf(y, -qmax), qmax);
      if constexpr (F == Format::kInt8) {
        q[start + i] = static_cast<int8_t>(static_cast<int>(rintf(clamped)));  // ties to even
      } else {
        q[start + i] = c10::Float8_e4m3fn(clamped);  // the rounding routine of Tensor.to()
      }
    }
  }
}

template <typename q_t, typename out_t>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const q_t* __restrict__ q, const float* __restrict__ scales, int64_t n,
                      int64_t block_size, out_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += stride) {
    out[i] = static_cast<out_t>(__fmul_rn(static_cast<float>(q[i]), scales[i / block_size]));
  }
}

// One int4 value as its stored nibble q + 8 (the int8 rule with qmax 7).
__device__ __forceinline__ uint32_t int4_nibble(float v, float divisor) {
  const float y = fminf(fmaxf(__fdiv_rn(v, divisor), -kInt4Max), kInt4Max);
  return static_cast<uint32_t>(static_cast<int>(rintf(y)) + 8);
}

__device__ __forceinline__ float int4_value(uint32_t nibble) {
  return static_cast<float>(static_cast<int>(nibble) - 8);
}

// Blocks are even-sized, so block b owns bytes [b * block_size / 2, ...): each thread packs
// whole bytes (element 2i low nibble, 2i + 1 high; an odd tail gets a zero high nibble).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    quantize_int4_kernel(const scalar_t* __restrict__ x, int64_t n, int64_t block_size,
                         int64_t n_blocks, uint8_t* __restrict__ packed,
                         float* __restrict__ scales) {
  for (int64_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    const int64_t start = b * block_size;
    const int64_t len = min(block_size, n - start);
    uint32_t amax = 0;
    uint32_t bad = 0;
    for (int64_t i = threadIdx.x; i < len; i += kThreads) {
      const uint32_t bits = __float_as_uint(static_cast<float>(x[start + i])) & 0x7fffffffu;
      amax = max(amax, bits);
      bad |= static_cast<uint32_t>(bits >= 0x7f800000u);
    }
    reduce_block(amax, bad);
    const float scale = __fdiv_rn(__uint_as_float(amax), kInt4Max);
    if (threadIdx.x == 0) scales[b] = bad ? __int_as_float(0x7fc00000) : scale;
    const float divisor = scale == 0.0f ? 1.0f : scale;
    for (int64_t j = threadIdx.x; 2 * j < len; j += kThreads) {
      const int64_t i = start + 2 * j;
      uint32_t byte = 0x88u;  // poisoned block: q = 0 everywhere (see quant_int4.py)
      if (!bad) {
        const uint32_t hi =
            2 * j + 1 < len ? int4_nibble(static_cast<float>(x[i + 1]), divisor) : 8u;
        byte = int4_nibble(static_cast<float>(x[i]), divisor) | (hi << 4);
      }
      packed[start / 2 + j] = static_cast<uint8_t>(byte);
    }
  }
}

// One thread per byte: both of its values lie in the same block (blocks are even-sized).
template <typename out_t>
__global__ void __launch_bounds__(kThreads)
    dequantize_int4_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                           int64_t n, int64_t block_size, out_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t n_bytes = (n + 1) / 2;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; j < n_bytes;
       j += stride) {
    const uint32_t byte = packed[j];
    const float s = scales[2 * j / block_size];
    out[2 * j] = static_cast<out_t>(__fmul_rn(int4_value(byte & 0xFu), s));
    if (2 * j + 1 < n) out[2 * j + 1] = static_cast<out_t>(__fmul_rn(int4_value(byte >> 4), s));
  }
}

// acc += q * scale: __fmul_rn then __fadd_rn, never one FMA, as `acc += dequantize(...)`.
__global__ void __launch_bounds__(kThreads)
    accumulate_int8_kernel(float* __restrict__ acc, const int8_t* __restrict__ q,
                           const float* __restrict__ scales, int64_t n, int64_t block_size) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += stride) {
    acc[i] = __fadd_rn(acc[i], __fmul_rn(static_cast<float>(q[i]), scales[i / block_size]));
  }
}

__global__ void __launch_bounds__(kThreads)
    accumulate_int4_kernel(float* __restrict__ acc, const uint8_t* __restrict__ packed,
                           const float* __restrict__ scales, int64_t n, int64_t block_size) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t n_bytes = (n + 1) / 2;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; j < n_bytes;
       j += stride) {
    const uint32_t byte = packed[j];
    const float s = scales[2 * j / block_size];
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(int4_value(byte & 0xFu), s));
    if (2 * j + 1 < n) {
      acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(int4_value(byte >> 4), s));
    }
  }
}

void check_input(const at::Tensor& x, int64_t block_size, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": expected a CUDA tensor, got device ", x.device());
  TORCH_CHECK(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
          x.scalar_type() == at::kHalf,
      op, ": expected float32, bfloat16 or float16 input, got ", x.scalar_type());
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
}

template <Format F, typename q_t>
std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& input, int64_t block_size,
                                                 at::ScalarType q_dtype, const char* op) {
  check_input(input, block_size, op);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const int64_t n = x.numel();
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(q_dtype));
  at::Tensor scales = at::empty({nb}, x.options().dtype(at::kFloat));
  if (nb == 0) return {q, scales};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = static_cast<unsigned>(std::min(nb, kMaxGrid));
  const auto dtype = x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_quantize_cuda", [&] {
    quantize_kernel<F, scalar_t, q_t><<<grid, kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), n, block_size, nb, static_cast<q_t*>(q.data_ptr()),
        scales.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, scales};
}

template <typename q_t>
at::Tensor dequantize_cuda(const at::Tensor& q_in, const at::Tensor& scales_in,
                           int64_t block_size, at::ScalarType dtype, at::ScalarType q_dtype,
                           const char* op) {
  TORCH_CHECK(q_in.is_cuda() && scales_in.device() == q_in.device(), op,
              ": expected q and scales on one CUDA device, got ", q_in.device(), " and ",
              scales_in.device());
  TORCH_CHECK(q_in.scalar_type() == q_dtype, op, ": expected q of dtype ", q_dtype, ", got ",
              q_in.scalar_type());
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat, op, ": expected float32 scales, got ",
              scales_in.scalar_type());
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": expected output dtype float32, bfloat16 or float16, got ", dtype);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  const int64_t n = q.numel();
  const int64_t nb = (n + block_size - 1) / block_size;
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == nb, op, ": expected ", nb, " scales for ",
              n, " elements in blocks of ", block_size, ", got shape ", scales.sizes(),
              "; pass the block_size used to quantize");
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  if (n == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid =
      static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxGrid));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_dequantize_cuda", [&] {
    dequantize_kernel<q_t, scalar_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const q_t*>(q.data_ptr()), scales.data_ptr<float>(), n, block_size,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, int64_t block_size) {
  return quantize_cuda<Format::kInt8, int8_t>(x, block_size, at::kChar, "fsdpx::quantize_int8");
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& x, int64_t block_size) {
  return quantize_cuda<Format::kFp8, c10::Float8_e4m3fn>(x, block_size, at::kFloat8_e4m3fn,
                                                         "fsdpx::quantize_fp8");
}

at::Tensor dequantize_int8(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                           at::ScalarType dtype) {
  return dequantize_cuda<int8_t>(q, scales, block_size, dtype, at::kChar,
                                 "fsdpx::dequantize_int8");
}

at::Tensor dequantize_fp8(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                          at::ScalarType dtype) {
  return dequantize_cuda<c10::Float8_e4m3fn>(q, scales, block_size, dtype, at::kFloat8_e4m3fn,
                                             "fsdpx::dequantize_fp8");
}

unsigned elementwise_grid(int64_t n) {
  return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxGrid));
}

std::tuple<at::Tensor, at::Tensor> quantize_int4(const at::Tensor& input, int64_t block_size) {
  const char* op = "fsdpx::quantize_int4";
  check_input(input, block_size, op);
  TORCH_CHECK(block_size % 2 == 0, op, ": block_size must be even (two values share a byte), "
              "got ", block_size);
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const int64_t n = x.numel();
  const int64_t nb = (n + block_size - 1) / block_size;
  at::Tensor packed = at::empty({(n + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nb}, x.options().dtype(at::kFloat));
  if (nb == 0) return {packed, scales};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = static_cast<unsigned>(std::min(nb, kMaxGrid));
  const auto dtype = x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_quantize_int4", [&] {
    quantize_int4_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), n, block_size, nb, packed.data_ptr<uint8_t>(),
        scales.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {packed, scales};
}

// The checks shared by dequantize_int4 and the accumulate ops (as check_payload in
// csrc/quant.cpp): the payload and scales for `numel` values, on `device`.
void check_payload(const at::Tensor& q, const at::Tensor& scales, int64_t numel,
                   int64_t block_size, bool int4, const c10::Device& device, const char* op) {
  TORCH_CHECK(device.is_cuda() && q.device() == device && scales.device() == device, op,
              ": expected every tensor on one CUDA device, got q on ", q.device(),
              " and scales on ", scales.device(), " for ", device);
  TORCH_CHECK(block_size > 0, op, ": block_size must be positive, got ", block_size);
  TORCH_CHECK(!int4 || block_size % 2 == 0, op,
              ": int4 block_size must be even (two values share a byte), got ", block_size);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  const at::ScalarType q_dtype = int4 ? at::kByte : at::kChar;
  const int64_t q_numel = int4 ? (numel + 1) / 2 : numel;
  TORCH_CHECK(q.scalar_type() == q_dtype && q.numel() == q_numel, op, ": expected a ",
              q_dtype, " payload of ", q_numel, " elements for ", numel, " values, got ",
              q.scalar_type(), " ", q.sizes());
  const int64_t nb = (numel + block_size - 1) / block_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == nb,
              op, ": expected ", nb, " float32 scales for ", numel, " values in blocks of ",
              block_size, ", got ", scales.scalar_type(), " ", scales.sizes(),
              "; pass the block_size used to quantize");
}

at::Tensor dequantize_int4(const at::Tensor& packed_in, const at::Tensor& scales_in,
                           int64_t numel, int64_t block_size, at::ScalarType dtype) {
  const char* op = "fsdpx::dequantize_int4";
  check_payload(packed_in, scales_in, numel, block_size, true, packed_in.device(), op);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": expected output dtype float32, bfloat16 or float16, got ", dtype);
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  if (numel == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = elementwise_grid((numel + 1) / 2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fsdpx_dequantize_int4", [&] {
    dequantize_int4_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), numel, block_size,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

template <bool kInt4>
void dequantize_accumulate(const at::Tensor& acc, const at::Tensor& q_in,
                           const at::Tensor& scales_in, int64_t block_size, const char* op) {
  TORCH_CHECK(acc.is_cuda() && acc.scalar_type() == at::kFloat && acc.is_contiguous(), op,
              ": expected a contiguous float32 CUDA accumulator, got a ",
              acc.is_contiguous() ? "contiguous " : "non-contiguous ", acc.scalar_type(),
              " tensor on ", acc.device());
  const int64_t n = acc.numel();
  check_payload(q_in, scales_in, n, block_size, kInt4, acc.device(), op);
  const c10::cuda::CUDAGuard guard(acc.device());
  const at::Tensor q = q_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  if (n == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if constexpr (kInt4) {
    accumulate_int4_kernel<<<elementwise_grid((n + 1) / 2), kThreads, 0, stream>>>(
        acc.data_ptr<float>(), q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block_size);
  } else {
    accumulate_int8_kernel<<<elementwise_grid(n), kThreads, 0, stream>>>(
        acc.data_ptr<float>(), q.data_ptr<int8_t>(), scales.data_ptr<float>(), n, block_size);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_accumulate_int8(const at::Tensor& acc, const at::Tensor& q,
                                const at::Tensor& scales, int64_t block_size) {
  dequantize_accumulate<false>(acc, q, scales, block_size, "fsdpx::dequantize_accumulate_int8");
}

void dequantize_accumulate_int4(const at::Tensor& acc, const at::Tensor& packed,
                                const at::Tensor& scales, int64_t block_size) {
  dequantize_accumulate<true>(acc, packed, scales, block_size,
                              "fsdpx::dequantize_accumulate_int4");
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpx, CUDA, m) {
  m.impl("quantize_int8", &quantize_int8);
  m.impl("dequantize_int8", &dequantize_int8);
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("dequantize_fp8", &dequantize_fp8);
  m.impl("quantize_int4", &quantize_int4);
  m.impl("dequantize_int4", &dequantize_int4);
  m.impl("dequantize_accumulate_int8", &dequantize_accumulate_int8);
  m.impl("dequantize_accumulate_int4", &dequantize_accumulate_int4);
}

}  // namespace fsdpx::quant_cuda

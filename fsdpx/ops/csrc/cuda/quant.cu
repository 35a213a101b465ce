// Blockwise symmetric quantization on CUDA: the twin of csrc/quant.cpp, with the contract
// (and the reference it is bitwise equal to) in fsdpx/ops/quant.py. One thread block per
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

}  // namespace

TORCH_LIBRARY_IMPL(fsdpx, CUDA, m) {
  m.impl("quantize_int8", &quantize_int8);
  m.impl("dequantize_int8", &dequantize_int8);
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("dequantize_fp8", &dequantize_fp8);
}

}  // namespace fsdpx::quant_cuda

// fsdpx::adam_step on CUDA: the element math of ../adam_common.h (shared with the CPU kernel
// and equal to the reference in fsdpx/ops/adam.py; built with --fmad=false), launched over
// many tensors at once: one launch covers up to kMaxTensors tensors and kMaxBlocks blocks,
// each block one kChunk slice of one tensor (the multi-tensor-apply layout of torch's fused
// optimizers, so a model's hundreds of small tensors cost a few launches, not hundreds).
//
// check_finite runs a first kernel that sets a device flag on any non-finite gradient; the
// update kernels read it and return at once, so skipping a step needs no host sync and the
// returned found_inf tensor is that flag.
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../adam_common.h"

namespace fsdpx::adam {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct NoCopy {};

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float load(__half x) { return __half2float(x); }

// Round to nearest even, NaN -> 0x7FC0, as c10::BFloat16 and the CPU kernel do.
__device__ __forceinline__ void store(__nv_bfloat16* out, float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}
__device__ __forceinline__ void store(__half* out, float f) { *out = __float2half_rn(f); }

template <typename G, typename O>
struct Meta {
  float* p[kMaxTensors];
  const G* g[kMaxTensors];
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  float* vmax[kMaxTensors];
  O* out[kMaxTensors];
  int64_t n[kMaxTensors];
  unsigned char block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};

template <typename G, typename O, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const Meta<G, O> meta, const Scalars s, const int* __restrict__ skip) {
  if (skip != nullptr && *skip != 0) {
    return;
  }
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, meta.n[t]);
  float* __restrict__ p = meta.p[t];
  const G* __restrict__ g = meta.g[t];
  float* __restrict__ m = meta.m[t];
  float* __restrict__ v = meta.v[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float mi = m[i];
    float vi = v[i];
    float vm = kAmsgrad ? meta.vmax[t][i] : 0.0f;
    const float np = update<kAmsgrad>(s, load(g[i]), p[i], mi, vi, vm);
    p[i] = np;
    m[i] = mi;
    v[i] = vi;
    if (kAmsgrad) {
      meta.vmax[t][i] = vm;
    }
    if constexpr (!std::is_same_v<O, NoCopy>) {
      store(&meta.out[t][i], np);
    }
  }
}

template <typename G>
__global__ void finite_kernel(const G* __restrict__ g, int64_t n, float scale, int* flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = load(g[i]) * scale;
    bad |= !(fabsf(x) <= 3.402823466e38f);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) {
    *flag = 1;
  }
}

// Launches the update over tensors `idx` (all with grad type G and copy type O), packing as
// many as fit into each launch.
template <typename G, typename O, bool kAmsgrad>
void launch(const std::vector<size_t>& idx, at::TensorList params, at::TensorList grads,
            at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
            at::TensorList param_copies, const Scalars& s, const int* skip) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Meta<G, O> meta{};
  int tensors = 0;
  int blocks = 0;
  auto flush = [&]() {
    if (blocks > 0) {
      adam_kernel<G, O, kAmsgrad><<<blocks, kThreads, 0, stream>>>(meta, s, skip);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    tensors = 0;
    blocks = 0;
  };
  for (size_t i : idx) {
    const int64_t n = params[i].numel();
    if (n == 0) {
      continue;
    }
    if (tensors == kMaxTensors) {
      flush();
    }
    meta.p[tensors] = params[i].data_ptr<float>();
    meta.g[tensors] = static_cast<const G*>(grads[i].const_data_ptr());
    meta.m[tensors] = exp_avgs[i].data_ptr<float>();
    meta.v[tensors] = exp_avg_sqs[i].data_ptr<float>();
    meta.vmax[tensors] = kAmsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    if constexpr (!std::is_same_v<O, NoCopy>) {
      meta.out[tensors] = static_cast<O*>(param_copies[i].data_ptr());
    }
    meta.n[tensors] = n;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[blocks] = static_cast<unsigned char>(tensors);
      meta.block_chunk[blocks] = static_cast<int>(c);
      if (++blocks == kMaxBlocks && c + 1 < chunks) {
        // The tensor continues in the next launch: re-enter it as that launch's first.
        const int keep = tensors;
        adam_kernel<G, O, kAmsgrad><<<blocks, kThreads, 0, stream>>>(meta, s, skip);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        meta.p[0] = meta.p[keep];
        meta.g[0] = meta.g[keep];
        meta.m[0] = meta.m[keep];
        meta.v[0] = meta.v[keep];
        meta.vmax[0] = meta.vmax[keep];
        meta.out[0] = meta.out[keep];
        meta.n[0] = meta.n[keep];
        tensors = 0;
        blocks = 0;
      }
    }
    ++tensors;
    if (blocks == kMaxBlocks) {
      flush();
    }
  }
  flush();
}

template <typename G, typename O>
void launch_amsgrad(bool amsgrad, const std::vector<size_t>& idx, at::TensorList params,
                    at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList param_copies,
                    const Scalars& s, const int* skip) {
  if (amsgrad) {
    launch<G, O, true>(idx, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies,
                       s, skip);
  } else {
    launch<G, O, false>(idx, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                        param_copies, s, skip);
  }
}

template <typename G>
void launch_copy(at::ScalarType copy, bool amsgrad, const std::vector<size_t>& idx,
                 at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                 at::TensorList param_copies, const Scalars& s, const int* skip) {
  if (copy == at::kBFloat16) {
    launch_amsgrad<G, __nv_bfloat16>(amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                                     max_exp_avg_sqs, param_copies, s, skip);
  } else if (copy == at::kHalf) {
    launch_amsgrad<G, __half>(amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                              max_exp_avg_sqs, param_copies, s, skip);
  } else {
    launch_amsgrad<G, NoCopy>(amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                              max_exp_avg_sqs, param_copies, s, skip);
  }
}

void check_inputs(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                  at::TensorList param_copies, int64_t step) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fsdpx.adam_step: params, grads, exp_avgs and exp_avg_sqs must have one entry per "
              "parameter; got ", n, ", ", grads.size(), ", ", exp_avgs.size(), ", ",
              exp_avg_sqs.size());
  TORCH_CHECK(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n,
              "fsdpx.adam_step: max_exp_avg_sqs must be empty or have ", n, " entries");
  TORCH_CHECK(param_copies.empty() || param_copies.size() == n,
              "fsdpx.adam_step: param_copies must be empty or have ", n, " entries");
  TORCH_CHECK(step >= 1, "fsdpx.adam_step: step counts from 1; got ", step);
  const at::Device device = params[0].device();
  auto check = [&](const at::Tensor& t, bool fp32_only, bool copy, const char* what, size_t i) {
    const auto dt = t.scalar_type();
    const bool dtype_ok = copy ? (dt == at::kBFloat16 || dt == at::kHalf)
                               : (dt == at::kFloat ||
                                  (!fp32_only && (dt == at::kBFloat16 || dt == at::kHalf)));
    TORCH_CHECK(t.device() == device && t.is_contiguous() && t.numel() == params[i].numel() &&
                    dtype_ok,
                "fsdpx.adam_step: ", what, "[", i, "] must be a contiguous tensor on ", device,
                " with ", params[i].numel(), " elements and a supported dtype; got ", dt,
                " on ", t.device(), " with ", t.numel(), " elements");
  };
  for (size_t i = 0; i < n; ++i) {
    check(params[i], true, false, "params", i);
    check(grads[i], false, false, "grads", i);
    check(exp_avgs[i], true, false, "exp_avgs", i);
    check(exp_avg_sqs[i], true, false, "exp_avg_sqs", i);
    if (!max_exp_avg_sqs.empty()) {
      check(max_exp_avg_sqs[i], true, false, "max_exp_avg_sqs", i);
    }
    if (!param_copies.empty()) {
      check(param_copies[i], false, true, "param_copies", i);
    }
  }
}

at::Tensor adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                          at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                          at::TensorList param_copies, double lr, double beta1, double beta2,
                          double eps, double weight_decay, int64_t step,
                          bool decoupled_weight_decay, bool maximize, double inv_grad_scale,
                          bool check_finite, bool bias_correction) {
  TORCH_CHECK(!params.empty(), "fsdpx.adam_step (CUDA): needs at least one parameter");
  check_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, step);
  const c10::cuda::CUDAGuard guard(params[0].device());
  const Scalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, step,
                                 decoupled_weight_decay, maximize, inv_grad_scale,
                                 bias_correction);
  at::Tensor flag = at::zeros({}, params[0].options().dtype(at::kInt));
  int* skip = nullptr;
  if (check_finite) {
    skip = flag.data_ptr<int>();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t n = grads[i].numel();
      if (n == 0) {
        continue;
      }
      const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
      switch (grads[i].scalar_type()) {
        case at::kFloat:
          finite_kernel<float><<<blocks, kThreads, 0, stream>>>(
              grads[i].const_data_ptr<float>(), n, s.grad_scale, skip);
          break;
        case at::kBFloat16:
          finite_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
              static_cast<const __nv_bfloat16*>(grads[i].const_data_ptr()), n, s.grad_scale,
              skip);
          break;
        default:
          finite_kernel<__half><<<blocks, kThreads, 0, stream>>>(
              static_cast<const __half*>(grads[i].const_data_ptr()), n, s.grad_scale, skip);
          break;
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  // One multi-tensor launch sequence per (grad dtype, copy dtype) group, in parameter order.
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const at::ScalarType grad_types[] = {at::kFloat, at::kBFloat16, at::kHalf};
  const at::ScalarType copy_types[] = {at::kBFloat16, at::kHalf, at::kFloat};  // kFloat: none
  for (at::ScalarType gt : grad_types) {
    for (at::ScalarType ct : copy_types) {
      std::vector<size_t> idx;
      for (size_t i = 0; i < params.size(); ++i) {
        const at::ScalarType my_ct = param_copies.empty() ? at::kFloat : param_copies[i].scalar_type();
        if (grads[i].scalar_type() == gt && my_ct == ct) {
          idx.push_back(i);
        }
      }
      if (idx.empty()) {
        continue;
      }
      if (gt == at::kFloat) {
        launch_copy<float>(ct, amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                           max_exp_avg_sqs, param_copies, s, skip);
      } else if (gt == at::kBFloat16) {
        launch_copy<__nv_bfloat16>(ct, amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                                   max_exp_avg_sqs, param_copies, s, skip);
      } else {
        launch_copy<__half>(ct, amsgrad, idx, params, grads, exp_avgs, exp_avg_sqs,
                            max_exp_avg_sqs, param_copies, s, skip);
      }
    }
  }
  return flag.to(at::kBool);
}

}  // namespace
}  // namespace fsdpx::adam

TORCH_LIBRARY_IMPL(fsdpx, CUDA, m) { m.impl("adam_step", &fsdpx::adam::adam_step_cuda); }

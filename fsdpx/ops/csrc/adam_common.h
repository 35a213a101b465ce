// The Adam/AdamW update shared by the CPU (adam.cpp) and CUDA (cuda/adam.cu) kernels, so both
// run the very same fp32 operations in the very same order as the pure-PyTorch reference in
// fsdpx/ops/adam.py (that file documents the order; change all three together). No FMA: the
// CPU flags carry -ffp-contract=off and nvcc gets --fmad=false.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FSDPX_HD __host__ __device__ __forceinline__
#else
#define FSDPX_HD inline __attribute__((always_inline))
#endif

namespace fsdpx::adam {

// The per-step scalars, computed once on the host in double precision (Python floats in the
// reference) and rounded to fp32 once, as torch does when a Python float meets an fp32 tensor.
struct Scalars {
  float grad_scale;  // inv_grad_scale, negated for maximize
  float l2;  // Adam's L2 weight decay (0 and unused for AdamW)
  bool use_l2;
  float decay;  // AdamW's decoupled decay 1 - lr * weight_decay (1 for Adam)
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;  // lr / (1 - beta1^step); lr without bias correction
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step): a multiply where torch divides; 1 without
  float eps;
};

inline Scalars make_scalars(double lr, double beta1, double beta2, double eps,
                            double weight_decay, int64_t step, bool decoupled, bool maximize,
                            double inv_grad_scale, bool bias_correction) {
  Scalars s;
  // Negating the rounded factor equals negating the product: round-to-nearest is symmetric.
  const float scale = static_cast<float>(inv_grad_scale);
  s.grad_scale = maximize ? -scale : scale;
  s.use_l2 = !decoupled && weight_decay != 0.0;
  s.l2 = static_cast<float>(weight_decay);
  s.decay = static_cast<float>(decoupled ? 1.0 - lr * weight_decay : 1.0);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double steps = static_cast<double>(step);
  // Without bias correction both corrections are 1: sqrt(v) * 1 + eps is exactly
  // sqrt(v) + eps, so the element math below needs no second variant.
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, steps) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, steps) : 1.0;
  s.step_size = static_cast<float>(lr / bc1);
  s.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(eps);
  return s;
}

// One element. `g` is the gradient already converted to fp32; returns the new parameter and
// updates the moments in place. Step numbers refer to the order documented in adam.py.
template <bool kAmsgrad>
FSDPX_HD float update(const Scalars& s, float g, float p, float& m, float& v, float& vmax) {
  g = g * s.grad_scale;  // 1
  if (s.use_l2) {
    g = g + p * s.l2;  // 2
  }
  p = p * s.decay;  // 3
  m = m * s.beta1 + g * s.one_minus_beta1;  // 4
  v = v * s.beta2 + (g * s.one_minus_beta2) * g;  // 5
  float vhat = v;
  if (kAmsgrad) {
    vmax = (v > vmax || v != v) ? v : vmax;  // 6: torch.maximum, NaN propagating
    vhat = vmax;
  }
  const float denom = sqrtf(vhat) * s.inv_bc2_sqrt + s.eps;  // 7
  return p - (m * s.step_size) / denom;  // 8
}

}  // namespace fsdpx::adam

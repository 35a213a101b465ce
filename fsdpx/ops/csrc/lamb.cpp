// fsdpx::lamb_moments and fsdpx::lamb_apply on CPU: DeepSpeed's FusedLamb step split in the
// two passes its CUDA kernel makes (deepspeed/ops/csrc/lamb/fused_lamb_cuda_kernel.cu), so the
// per-tensor norms can be summed over the shards of a sharded parameter in between (the
// Python wrapper in fsdpx/ops/lamb.py does that, and documents the formula order; change both
// together). Pass 1 updates the moments and returns, per tensor, sum(p^2) and sum(u^2) in
// double; pass 2 recomputes the update u from the new moments (bit for bit the pass-1 value)
// and applies p -= (step_size * coeff) * u with the caller's trust ratio coeff.
//
// Every loop is a GCC target_clones function, as in adam.cpp (runtime ISA dispatch, plain
// scalar C++ the compiler vectorises; -ffp-contract=off keeps it bitwise equal to the
// reference). The sums run over fixed chunks of kGrain elements added in chunk order, so the
// result does not depend on the number of threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPX_LAMB_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDPX_LAMB_CLONES
#endif

namespace fsdpx::lamb {
namespace {

constexpr int64_t kGrain = 1 << 15;

// The per-step scalars, rounded to fp32 once (Python floats meeting fp32 tensors in the
// reference).
struct Scalars {
  float grad_scale;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;
  bool eps_inside_sqrt;
};

Scalars make_scalars(double beta1, double beta2, double eps, double weight_decay,
                     double inv_grad_scale, bool eps_inside_sqrt) {
  Scalars s;
  s.grad_scale = static_cast<float>(inv_grad_scale);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.eps_inside_sqrt = eps_inside_sqrt;
  return s;
}

inline __attribute__((always_inline)) float to_f32(float x) { return x; }
inline __attribute__((always_inline)) float to_f32(c10::BFloat16 x) {
  return static_cast<float>(x);
}
inline __attribute__((always_inline)) float to_f32(c10::Half x) { return static_cast<float>(x); }

// The update direction u of one element (steps 4-5 of [Note: the Lamb formula order]).
inline __attribute__((always_inline)) float direction(const Scalars& s, float p, float m,
                                                      float v) {
  const float denom = s.eps_inside_sqrt ? sqrtf(v + s.eps) : sqrtf(v) + s.eps;
  return m / denom + p * s.weight_decay;
}

template <typename G>
FSDPX_LAMB_CLONES void moments_span(const Scalars s, const float* __restrict p,
                                    const G* __restrict g, float* __restrict m,
                                    float* __restrict v, int64_t n, double* p_sq,
                                    double* u_sq) {
  double ps = 0.0;
  double us = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = to_f32(g[i]) * s.grad_scale;  // 1
    const float mi = m[i] * s.beta1 + gi * s.one_minus_beta1;  // 2
    const float vi = v[i] * s.beta2 + (gi * s.one_minus_beta2) * gi;  // 3
    m[i] = mi;
    v[i] = vi;
    const float u = direction(s, p[i], mi, vi);
    const double pd = static_cast<double>(p[i]);
    const double ud = static_cast<double>(u);
    ps += pd * pd;  // exact products (24-bit mantissas), summed in double
    us += ud * ud;
  }
  *p_sq = ps;
  *u_sq = us;
}

FSDPX_LAMB_CLONES void apply_span(const Scalars s, float* __restrict p, const float* __restrict m,
                                  const float* __restrict v, float rate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] = p[i] - direction(s, p[i], m[i], v[i]) * rate;  // 7
  }
}

template <typename G>
void moments_tensor(const Scalars& s, const at::Tensor& p, const at::Tensor& g,
                    const at::Tensor& m, const at::Tensor& v, double* out) {
  const int64_t n = p.numel();
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<double> ps(static_cast<size_t>(chunks), 0.0);
  std::vector<double> us(static_cast<size_t>(chunks), 0.0);
  const float* pp = p.const_data_ptr<float>();
  const G* gp = static_cast<const G*>(g.const_data_ptr());
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * kGrain;
      const int64_t len = std::min(kGrain, n - lo);
      moments_span<G>(s, pp + lo, gp + lo, mp + lo, vp + lo, len, &ps[c], &us[c]);
    }
  });
  double p_sum = 0.0;
  double u_sum = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    p_sum += ps[c];
    u_sum += us[c];
  }
  out[0] = p_sum;
  out[1] = u_sum;
}

void check_f32(const at::Tensor& t, const at::Tensor& p, const char* op, const char* what,
               size_t i) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == p.numel(),
              "fsdpx.", op, ": ", what, "[", i, "] must be a contiguous fp32 CPU tensor with ",
              p.numel(), " elements like params[", i, "]; got ", t.scalar_type(), " on ",
              t.device(), " with ", t.numel(), " elements (contiguous: ", t.is_contiguous(), ")");
}

void check_lists(const char* op, at::TensorList params, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs) {
  const size_t n = params.size();
  TORCH_CHECK(exp_avgs.size() == n && exp_avg_sqs.size() == n, "fsdpx.", op,
              ": params, exp_avgs and exp_avg_sqs must have one entry per parameter; got ", n,
              ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  for (size_t i = 0; i < n; ++i) {
    check_f32(params[i], params[i], op, "params", i);
    check_f32(exp_avgs[i], params[i], op, "exp_avgs", i);
    check_f32(exp_avg_sqs[i], params[i], op, "exp_avg_sqs", i);
  }
}

at::Tensor lamb_moments_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, double beta1, double beta2, double eps,
                            double weight_decay, double inv_grad_scale, bool eps_inside_sqrt) {
  check_lists("lamb_moments", params, exp_avgs, exp_avg_sqs);
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "fsdpx.lamb_moments: grads must have one entry per parameter (",
              n, "); got ", grads.size());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    const auto gt = g.scalar_type();
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.numel() == params[i].numel() &&
                    (gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf),
                "fsdpx.lamb_moments: grads[", i, "] must be a contiguous fp32/bf16/fp16 CPU "
                "tensor with ", params[i].numel(), " elements; got ", gt, " on ", g.device(),
                " with ", g.numel(), " elements (contiguous: ", g.is_contiguous(), ")");
  }
  const Scalars s = make_scalars(beta1, beta2, eps, weight_decay, inv_grad_scale,
                                 eps_inside_sqrt);
  at::Tensor sums = at::zeros({static_cast<int64_t>(n), 2},
                              at::TensorOptions().dtype(at::kDouble));
  double* out = sums.data_ptr<double>();
  for (size_t i = 0; i < n; ++i) {
    switch (grads[i].scalar_type()) {
      case at::kFloat:
        moments_tensor<float>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out + 2 * i);
        break;
      case at::kBFloat16:
        moments_tensor<c10::BFloat16>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                      out + 2 * i);
        break;
      default:
        moments_tensor<c10::Half>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i],
                                  out + 2 * i);
        break;
    }
  }
  return sums;
}

void lamb_apply_cpu(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    const at::Tensor& coeffs, double step_size, double eps, double weight_decay,
                    bool eps_inside_sqrt) {
  check_lists("lamb_apply", params, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(coeffs.device().is_cpu() && coeffs.scalar_type() == at::kFloat &&
                  coeffs.dim() == 1 && coeffs.numel() == n && coeffs.is_contiguous(),
              "fsdpx.lamb_apply: coeffs must be a contiguous 1-D fp32 CPU tensor with one trust "
              "ratio per parameter (", n, "); got ", coeffs.scalar_type(), " of shape ",
              coeffs.sizes());
  const Scalars s = make_scalars(0.0, 0.0, eps, weight_decay, 1.0, eps_inside_sqrt);
  const float size = static_cast<float>(step_size);
  const float* c = coeffs.const_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float rate = size * c[i];  // 6: fp32 product, as the reference's
    float* pp = params[i].data_ptr<float>();
    const float* mp = exp_avgs[i].const_data_ptr<float>();
    const float* vp = exp_avg_sqs[i].const_data_ptr<float>();
    at::parallel_for(0, params[i].numel(), kGrain, [&](int64_t begin, int64_t end) {
      apply_span(s, pp + begin, mp + begin, vp + begin, rate, end - begin);
    });
  }
}

}  // namespace
}  // namespace fsdpx::lamb

TORCH_LIBRARY_IMPL(fsdpx, CPU, m) {
  m.impl("lamb_moments", &fsdpx::lamb::lamb_moments_cpu);
  m.impl("lamb_apply", &fsdpx::lamb::lamb_apply_cpu);
}

// fsdpx::adam_step on CPU: one memory pass per tensor over fp32 params and moments, reading
// fp32/bf16/fp16 gradients and optionally writing a bf16/fp16 copy of the new params. The
// element math lives in adam_common.h; the contract and the reference in fsdpx/ops/adam.py.
//
// Runtime CPU dispatch: every loop below is a GCC target_clones function (x86-64-v4 = AVX-512,
// x86-64-v3 = AVX2/FMA/F16C, default = SSE2); the dynamic loader picks one clone per process
// from the running CPU (ifunc). This keeps one translation unit and one set of flags (what
// torch.utils.cpp_extension.load offers) instead of per-ISA files and a dispatch table, and
// never ties the binary to the build machine the way -march=native does. The loops are plain
// scalar C++ that GCC vectorises: IEEE add/mul/div/sqrt give the same bits at any width.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cfloat>
#include <cstring>
#include <type_traits>

#include "adam_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDPX_CLONES
#endif

namespace fsdpx::adam {
namespace {

// Elements per parallel task: a few hundred KB of streams, so tiny tensors (biases, norms)
// stay on the calling thread and big ones split evenly over torch's threads.
constexpr int64_t kGrain = 1 << 15;

struct NoCopy {};  // the "no 16-bit copy-out" output type

FSDPX_HD float load(float x) { return x; }
FSDPX_HD float load(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
FSDPX_HD float load(c10::Half x) { return static_cast<float>(x); }

// Round to nearest even, NaN -> 0x7FC0: c10::BFloat16's rule, written branch-free so it
// vectorises.
FSDPX_HD void store(c10::BFloat16* out, float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  out->x = static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}
FSDPX_HD void store(c10::Half* out, float f) { *out = c10::Half(f); }

template <typename G, typename O, bool kAmsgrad>
FSDPX_CLONES void adam_span(const Scalars s, float* __restrict p, const G* __restrict g,
                            float* __restrict m, float* __restrict v, float* __restrict vmax,
                            O* __restrict out, int64_t n) {
  float unused = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float& vm = kAmsgrad ? vmax[i] : unused;
    const float np = update<kAmsgrad>(s, load(g[i]), p[i], m[i], v[i], vm);
    p[i] = np;
    if constexpr (!std::is_same_v<O, NoCopy>) {
      store(&out[i], np);
    }
  }
}

// True when every g * scale is finite (the value step 1 of the update would use).
template <typename G>
FSDPX_CLONES bool span_finite(const G* __restrict g, float scale, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = load(g[i]) * scale;
    bad |= !(std::fabs(x) <= FLT_MAX);
  }
  return bad == 0;
}

template <typename G, typename O, bool kAmsgrad>
void run_tensor(const Scalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                const at::Tensor& v, const at::Tensor* vmax, const at::Tensor* out) {
  float* pp = p.data_ptr<float>();
  const G* gp = static_cast<const G*>(g.const_data_ptr());
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  float* vmp = kAmsgrad ? vmax->data_ptr<float>() : nullptr;
  O* op = nullptr;
  if constexpr (!std::is_same_v<O, NoCopy>) {
    op = static_cast<O*>(out->data_ptr());
  }
  at::parallel_for(0, p.numel(), kGrain, [&](int64_t begin, int64_t end) {
    adam_span<G, O, kAmsgrad>(s, pp + begin, gp + begin, mp + begin, vp + begin,
                              kAmsgrad ? vmp + begin : nullptr,
                              op == nullptr ? nullptr : op + begin, end - begin);
  });
}

template <typename G, typename O>
void run_amsgrad(const Scalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                 const at::Tensor& v, const at::Tensor* vmax, const at::Tensor* out) {
  if (vmax != nullptr) {
    run_tensor<G, O, true>(s, p, g, m, v, vmax, out);
  } else {
    run_tensor<G, O, false>(s, p, g, m, v, vmax, out);
  }
}

template <typename G>
void run_copy(const Scalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
              const at::Tensor& v, const at::Tensor* vmax, const at::Tensor* out) {
  if (out == nullptr) {
    run_amsgrad<G, NoCopy>(s, p, g, m, v, vmax, out);
  } else if (out->scalar_type() == at::kBFloat16) {
    run_amsgrad<G, c10::BFloat16>(s, p, g, m, v, vmax, out);
  } else {
    run_amsgrad<G, c10::Half>(s, p, g, m, v, vmax, out);
  }
}

template <typename G>
bool tensor_finite(const at::Tensor& g, float scale) {
  const G* gp = static_cast<const G*>(g.const_data_ptr());
  std::atomic<bool> ok{true};
  at::parallel_for(0, g.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (ok.load(std::memory_order_relaxed) && !span_finite<G>(gp + begin, scale, end - begin)) {
      ok.store(false, std::memory_order_relaxed);
    }
  });
  return ok.load();
}

bool grad_finite(const at::Tensor& g, float scale) {
  switch (g.scalar_type()) {
    case at::kFloat:
      return tensor_finite<float>(g, scale);
    case at::kBFloat16:
      return tensor_finite<c10::BFloat16>(g, scale);
    default:
      return tensor_finite<c10::Half>(g, scale);
  }
}

void check_state(const at::Tensor& t, const at::Tensor& p, const char* what, size_t i) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == p.numel(),
              "fsdpx.adam_step: ", what, "[", i, "] must be a contiguous fp32 CPU tensor with ",
              p.numel(), " elements like params[", i, "]; got ", t.scalar_type(), " on ",
              t.device(), " with ", t.numel(), " elements (contiguous: ", t.is_contiguous(), ")");
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
              "fsdpx.adam_step: max_exp_avg_sqs must be empty (no amsgrad) or have ", n,
              " entries; got ", max_exp_avg_sqs.size());
  TORCH_CHECK(param_copies.empty() || param_copies.size() == n,
              "fsdpx.adam_step: param_copies must be empty (no copy-out) or have ", n,
              " entries; got ", param_copies.size());
  TORCH_CHECK(step >= 1, "fsdpx.adam_step: step counts from 1 (bias correction divides by "
              "1 - beta1^step); got ", step);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check_state(p, p, "params", i);
    const at::Tensor& g = grads[i];
    const auto gt = g.scalar_type();
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.numel() == p.numel() &&
                    (gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf),
                "fsdpx.adam_step: grads[", i, "] must be a contiguous fp32/bf16/fp16 CPU tensor "
                "with ", p.numel(), " elements; got ", gt, " on ", g.device(), " with ",
                g.numel(), " elements (contiguous: ", g.is_contiguous(), ")");
    check_state(exp_avgs[i], p, "exp_avgs", i);
    check_state(exp_avg_sqs[i], p, "exp_avg_sqs", i);
    if (!max_exp_avg_sqs.empty()) {
      check_state(max_exp_avg_sqs[i], p, "max_exp_avg_sqs", i);
    }
    if (!param_copies.empty()) {
      const at::Tensor& c = param_copies[i];
      const auto ct = c.scalar_type();
      TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.numel() == p.numel() &&
                      (ct == at::kBFloat16 || ct == at::kHalf),
                  "fsdpx.adam_step: param_copies[", i, "] must be a contiguous bf16/fp16 CPU "
                  "tensor with ", p.numel(), " elements; got ", ct, " on ", c.device(),
                  " with ", c.numel(), " elements (contiguous: ", c.is_contiguous(), ")");
    }
  }
}

at::Tensor adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                         at::TensorList param_copies, double lr, double beta1, double beta2,
                         double eps, double weight_decay, int64_t step,
                         bool decoupled_weight_decay, bool maximize, double inv_grad_scale,
                         bool check_finite, bool bias_correction) {
  check_inputs(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, step);
  const Scalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, step,
                                 decoupled_weight_decay, maximize, inv_grad_scale,
                                 bias_correction);
  at::Tensor found_inf = at::empty({}, at::TensorOptions().dtype(at::kBool));
  bool finite = true;
  // A separate read-only pass over every gradient first: the flag must be known before any
  // state is written (a one-pass check could only skip the tensors after the bad one).
  if (check_finite) {
    for (size_t i = 0; i < params.size() && finite; ++i) {
      finite = grad_finite(grads[i], s.grad_scale);
    }
  }
  *found_inf.data_ptr<bool>() = !finite;
  if (!finite) {
    return found_inf;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor* vmax = max_exp_avg_sqs.empty() ? nullptr : &max_exp_avg_sqs[i];
    const at::Tensor* out = param_copies.empty() ? nullptr : &param_copies[i];
    switch (grads[i].scalar_type()) {
      case at::kFloat:
        run_copy<float>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, out);
        break;
      case at::kBFloat16:
        run_copy<c10::BFloat16>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, out);
        break;
      default:
        run_copy<c10::Half>(s, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, out);
        break;
    }
  }
  return found_inf;
}

}  // namespace
}  // namespace fsdpx::adam

TORCH_LIBRARY_IMPL(fsdpx, CPU, m) { m.impl("adam_step", &fsdpx::adam::adam_step_cpu); }

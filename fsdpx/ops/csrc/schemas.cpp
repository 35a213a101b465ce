// Every fsdpx op schema, declared once. Kernels register per backend in their own files with
// TORCH_LIBRARY_IMPL(fsdpx, CPU / CUDA, m); the CUDA library has no TORCH_LIBRARY of its own
// (a namespace may be defined only once per process), so it needs this CPU library loaded
// first (fsdpx/ops/_loader.py does that). Each op's contract is documented with its Python
// wrapper and reference in fsdpx/ops/<op>.py.
#include <torch/library.h>

TORCH_LIBRARY(fsdpx, m) {
  // fsdpx/ops/adam.py. Lists are per tensor (one entry per parameter); an empty
  // max_exp_avg_sqs means no amsgrad, an empty param_copies means no 16-bit copy-out.
  // Returns a 0-dim bool tensor: True when check_finite found a non-finite gradient, in
  // which case nothing was written. bias_correction=False drops Adam's bias correction
  // (DeepSpeed FusedAdam's bias_correction=False: step size lr, denominator sqrt(v) + eps).
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] param_copies, *, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool decoupled_weight_decay=True, bool maximize=False, float inv_grad_scale=1.0, "
      "bool check_finite=False, bool bias_correction=True) -> Tensor");

  // fsdpx/ops/lamb.py. DeepSpeed's Lamb step in two passes: lamb_moments updates the
  // moments and returns a float64 [n, 2] tensor of sum(p^2) and sum(u^2) per parameter (u the
  // update direction); lamb_apply recomputes u and applies p -= (step_size * coeffs[i]) * u.
  m.def(
      "lamb_moments(Tensor[] params, Tensor[] grads, Tensor(a!)[] exp_avgs, "
      "Tensor(b!)[] exp_avg_sqs, *, float beta1, float beta2, float eps, float weight_decay, "
      "float inv_grad_scale=1.0, bool eps_inside_sqrt=False) -> Tensor");
  m.def(
      "lamb_apply(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor coeffs, "
      "*, float step_size, float eps, float weight_decay, bool eps_inside_sqrt=False) -> ()");

  // fsdpx/ops/quant.py. Blockwise symmetric quantization of x.reshape(-1): returns q (x's
  // shape, int8 / float8_e4m3fn) and one float32 scale per block_size elements.
  m.def("quantize_int8(Tensor x, int block_size) -> (Tensor, Tensor)");
  m.def("dequantize_int8(Tensor q, Tensor scales, int block_size, ScalarType dtype) -> Tensor");
  m.def("quantize_fp8(Tensor x, int block_size) -> (Tensor, Tensor)");
  m.def("dequantize_fp8(Tensor q, Tensor scales, int block_size, ScalarType dtype) -> Tensor");
  // fsdpx/ops/quant_int4.py: packed int4 (uint8 of ceil(numel / 2) bytes, even block_size);
  // dequantize_int4 returns the first `numel` values, 1-D.
  m.def("quantize_int4(Tensor x, int block_size) -> (Tensor, Tensor)");
  m.def(
      "dequantize_int4(Tensor packed, Tensor scales, int numel, int block_size, "
      "ScalarType dtype) -> Tensor");
  // qgZ's fused sum: acc (contiguous float32) += dequantize(q, scales) elementwise.
  m.def(
      "dequantize_accumulate_int8(Tensor(a!) acc, Tensor q, Tensor scales, int block_size) "
      "-> ()");
  m.def(
      "dequantize_accumulate_int4(Tensor(a!) acc, Tensor packed, Tensor scales, "
      "int block_size) -> ()");
  // fsdpx/ops/shuffle.py (contract: checkpoint_tools/format/kernels.py). Byte shuffle of
  // `size`-byte elements into planes, returning each wanted plane's CRC-32 (int64, else 0);
  // the inverse from per-plane tensors (None: leave those bytes), CRCs when `crc`; CRC-32.
  m.def("shuffle_crc(Tensor src, Tensor(a!) dst, int size, bool[] want) -> Tensor");
  m.def("unshuffle_crc(Tensor?[] planes, Tensor(a!) dst, bool crc) -> Tensor");
  m.def("crc32(Tensor data, int value) -> Tensor");
  // The aio thread pool is a custom class (torch.classes.fsdpx.AioPool), registered in aio.cpp.
}

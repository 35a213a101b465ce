// Byte shuffle / unshuffle fused with CRC-32, for checkpoint chunks (format 1.1, codec 2).
// The contract is written once, in checkpoint_tools/format/kernels.py (the numpy reference,
// whose output these kernels equal byte for byte); the Python wrapper is
// fsdpx/ops/shuffle.py. Schemas are in schemas.cpp.
//
// [Note: one pass] The data is processed in blocks of kBlock elements: a block is shuffled
// (or unshuffled) and each plane's slice of it is checksummed while it is still in L1/L2,
// instead of a shuffle pass over the whole chunk followed by a CRC pass that reads it back
// from memory. Each call runs on the calling thread; parallelism is across chunks (the
// checkpoint writer's and reader's worker threads), and torch releases the GIL around
// custom op calls, so those threads really run at once.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FSDPX_SHUFFLE_X86 1
#endif

// Runtime CPU dispatch, as in adam.cpp / quant.cpp: the byte-moving loops are target_clones
// functions; the CRC uses carry-less multiplication (PCLMULQDQ) when the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDPX_SHUFFLE_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDPX_SHUFFLE_CLONES
#endif

namespace fsdpx::shuffle {
namespace {

constexpr uint32_t kPoly = 0xedb88320u;  // CRC-32 (ISO-HDLC, zlib), bit-reflected
constexpr int64_t kBlock = 8192;  // elements per block: <= 64 KiB in flight for 8-byte elements

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int j = 0; j < 8; ++j) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};
const Tables kTables;

// Slice-by-8, zlib's conventions (pre/post inversion inside; `crc` is a finished CRC).
uint32_t crc32_slice8(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = kTables.t;
  crc = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^
          t[4][(v >> 24) & 0xff] ^ t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^
          t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

#ifdef FSDPX_SHUFFLE_X86
// Folding with carry-less multiplication (Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ", Intel 2009), the bit-reflected constants for zlib's
// polynomial as in Chromium's zlib (crc32_simd.c). `n` >= 64 and a multiple of 16; `crc`
// is the raw (pre-inverted) register value.
__attribute__((target("pclmul,sse4.1"))) uint32_t crc32_fold(const uint8_t* buf, size_t n,
                                                                uint32_t crc) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const uint64_t poly[] = {0x01db710641, 0x01f7011641};
  __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;
  x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
  x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
  x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
  x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(crc)));
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  buf += 64;
  n -= 64;
  while (n >= 64) {  // four independent 128-bit lanes, folded 512 bits at a time
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
    x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
    x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
    x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
    y5 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
    y6 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
    y7 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
    y8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
    x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
    x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
    x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
    buf += 64;
    n -= 64;
  }
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));  // fold the lanes into one
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
  while (n >= 16) {
    x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    buf += 16;
    n -= 16;
  }
  // 128 -> 64 bits, then Barrett reduction to 32.
  x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
  x3 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_srli_si128(x1, 8);
  x1 = _mm_xor_si128(x1, x2);
  x0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, x3);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_and_si128(x1, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
  x2 = _mm_and_si128(x2, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool has_pclmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

// zlib's crc32(crc, p, n): `crc` is the CRC of the bytes before p (0 to start).
uint32_t crc32_update(uint32_t crc, const uint8_t* p, size_t n) {
#ifdef FSDPX_SHUFFLE_X86
  if (n >= 64 && has_pclmul()) {
    const size_t whole = n & ~static_cast<size_t>(15);
    crc = ~crc32_fold(p, whole, ~crc);
    p += whole;
    n -= whole;
  }
#endif
  return crc32_slice8(crc, p, n);
}

// Fixed element sizes let the compiler turn the strided gathers and scatters into vector
// shuffles; one clone per ISA level.
template <int S>
FSDPX_SHUFFLE_CLONES void shuffle_block(const uint8_t* __restrict src, uint8_t* __restrict dst,
                                        int64_t n, int64_t begin, int64_t end) {
  for (int k = 0; k < S; ++k) {
    uint8_t* __restrict plane = dst + k * n;
    for (int64_t i = begin; i < end; ++i) plane[i] = src[i * S + k];
  }
}

#ifdef FSDPX_SHUFFLE_X86
// [Note: one-load shuffle] The loop above reads each source byte S times (once per plane,
// the compiler vectorising each strided gather separately). These read 16 elements once:
// a byte shuffle within each 16-byte load groups the bytes by plane, then 32- and 64-bit
// unpacks transpose the groups, and each plane gets one 16-byte store. SSSE3
// only (pshufb), so one version serves every x86-64 CPU of the last 15 years. Measured on
// 4 MiB fp32 chunks, one core (AVX-512 host, so against the v4 clone): 9.0 -> 12.7 GB/s in
// cache, 5.9 -> 7.5 GB/s from a cold 600 MB source (a memcpy: 9.2-9.8), shuffle+CRC of
// three planes 4.9 -> 6.0 GB/s cold. For S = 2 the same treatment measured 11.9 -> 12.3
// GB/s, within the spread, so 2-byte elements keep the compiler's clones.
__attribute__((target("ssse3"))) inline __m128i load_by(const uint8_t* p, __m128i order) {
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), order);
}

__attribute__((target("ssse3"))) inline void store(uint8_t* p, __m128i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
}

__attribute__((target("ssse3"))) void shuffle4_ssse3(const uint8_t* __restrict src,
                                                       uint8_t* __restrict dst, int64_t n,
                                                       int64_t begin, int64_t end) {
  const __m128i by_plane = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  uint8_t* p0 = dst;
  uint8_t* p1 = dst + n;
  uint8_t* p2 = dst + 2 * n;
  uint8_t* p3 = dst + 3 * n;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const uint8_t* s = src + 4 * i;
    // a..d: 32-bit lane k holds byte k of 4 consecutive elements
    const __m128i a = load_by(s, by_plane), b = load_by(s + 16, by_plane);
    const __m128i c = load_by(s + 32, by_plane), d = load_by(s + 48, by_plane);
    const __m128i ab_lo = _mm_unpacklo_epi32(a, b);  // a0 b0 a1 b1
    const __m128i ab_hi = _mm_unpackhi_epi32(a, b);  // a2 b2 a3 b3
    const __m128i cd_lo = _mm_unpacklo_epi32(c, d);
    const __m128i cd_hi = _mm_unpackhi_epi32(c, d);
    store(p0 + i, _mm_unpacklo_epi64(ab_lo, cd_lo));  // a0 b0 c0 d0: byte 0 of 16 elements
    store(p1 + i, _mm_unpackhi_epi64(ab_lo, cd_lo));
    store(p2 + i, _mm_unpacklo_epi64(ab_hi, cd_hi));
    store(p3 + i, _mm_unpackhi_epi64(ab_hi, cd_hi));
  }
  shuffle_block<4>(src, dst, n, i, end);  // the last < 16 elements
}

bool has_ssse3() {
  static const bool yes = __builtin_cpu_supports("ssse3");
  return yes;
}
#endif

template <int S>
void shuffle_block_best(const uint8_t* src, uint8_t* dst, int64_t n, int64_t begin, int64_t end) {
#ifdef FSDPX_SHUFFLE_X86
  if constexpr (S == 4) {
    if (has_ssse3()) {
      shuffle4_ssse3(src, dst, n, begin, end);
      return;
    }
  }
#endif
  shuffle_block<S>(src, dst, n, begin, end);
}

template <int S>
FSDPX_SHUFFLE_CLONES void unshuffle_block(const uint8_t* const* planes, uint8_t* __restrict dst,
                                          int64_t begin, int64_t end) {
  bool all = true;
  for (int k = 0; k < S; ++k) all = all && planes[k] != nullptr;
  if (all) {  // every plane: one interleaving pass with whole-element stores
    const uint8_t* p[S];
    for (int k = 0; k < S; ++k) p[k] = planes[k];
    for (int64_t i = begin; i < end; ++i)
      for (int k = 0; k < S; ++k) dst[i * S + k] = p[k][i];
    return;
  }
  for (int k = 0; k < S; ++k) {
    const uint8_t* __restrict plane = planes[k];
    if (plane == nullptr) continue;
    for (int64_t i = begin; i < end; ++i) dst[i * S + k] = plane[i];
  }
}

void check_bytes(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 1 &&
                  t.is_contiguous(),
              "fsdpx shuffle ops: expected ", what,
              " to be a contiguous 1-d uint8 CPU tensor, got ", t.scalar_type(), " of shape ",
              t.sizes(), " on ", t.device());
}

template <int S>
void shuffle_crc_impl(const uint8_t* src, uint8_t* dst, int64_t n, const std::vector<bool>& want,
                      uint32_t* crc) {
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    shuffle_block_best<S>(src, dst, n, b, e);
    for (int k = 0; k < S; ++k)
      if (want[k]) crc[k] = crc32_update(crc[k], dst + k * n + b, static_cast<size_t>(e - b));
  }
}

at::Tensor shuffle_crc_cpu(const at::Tensor& src, at::Tensor& dst, int64_t size,
                           const c10::List<bool>& want) {
  check_bytes(src, "src");
  check_bytes(dst, "dst");
  TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8,
              "fsdpx::shuffle_crc: element size must be 1, 2, 4 or 8, got ", size);
  TORCH_CHECK(src.numel() % size == 0 && dst.numel() == src.numel(),
              "fsdpx::shuffle_crc: expected src of a whole number of ", size,
              "-byte elements and dst of the same length, got ", src.numel(), " and ",
              dst.numel(), " bytes");
  TORCH_CHECK(static_cast<int64_t>(want.size()) == size, "fsdpx::shuffle_crc: expected ", size,
              " entries in want, got ", want.size());
  const int64_t n = src.numel() / size;
  std::vector<bool> w;
  for (size_t k = 0; k < want.size(); ++k) w.push_back(want.get(k));
  std::array<uint32_t, 8> crc{};
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* d = dst.data_ptr<uint8_t>();
  switch (size) {
    case 1: shuffle_crc_impl<1>(s, d, n, w, crc.data()); break;
    case 2: shuffle_crc_impl<2>(s, d, n, w, crc.data()); break;
    case 4: shuffle_crc_impl<4>(s, d, n, w, crc.data()); break;
    default: shuffle_crc_impl<8>(s, d, n, w, crc.data()); break;
  }
  at::Tensor out = at::empty({size}, src.options().dtype(at::kLong));
  for (int64_t k = 0; k < size; ++k) out.data_ptr<int64_t>()[k] = crc[k];
  return out;
}

template <int S>
void unshuffle_crc_impl(const uint8_t* const* planes, uint8_t* dst, int64_t n, bool crc_on,
                        uint32_t* crc) {
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    if (crc_on)  // read each plane's block once for its CRC; the scatter finds it in cache
      for (int k = 0; k < S; ++k)
        if (planes[k] != nullptr)
          crc[k] = crc32_update(crc[k], planes[k] + b, static_cast<size_t>(e - b));
    unshuffle_block<S>(planes, dst, b, e);
  }
}

at::Tensor unshuffle_crc_cpu(at::ArrayRef<std::optional<at::Tensor>> planes, at::Tensor& dst,
                             bool crc_on) {
  check_bytes(dst, "dst");
  const int64_t size = static_cast<int64_t>(planes.size());
  TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8,
              "fsdpx::unshuffle_crc: expected 1, 2, 4 or 8 planes, got ", size);
  TORCH_CHECK(dst.numel() % size == 0, "fsdpx::unshuffle_crc: dst has ", dst.numel(),
              " bytes, not a whole number of ", size, "-byte elements");
  const int64_t n = dst.numel() / size;
  std::array<const uint8_t*, 8> ptrs{};
  for (int64_t k = 0; k < size; ++k) {
    const auto& p = planes[k];
    if (!p.has_value()) continue;
    check_bytes(*p, "each plane");
    TORCH_CHECK(p->numel() == n, "fsdpx::unshuffle_crc: plane ", k, " has ", p->numel(),
                " bytes, expected ", n);
    ptrs[k] = p->data_ptr<uint8_t>();
  }
  std::array<uint32_t, 8> crc{};
  uint8_t* d = dst.data_ptr<uint8_t>();
  switch (size) {
    case 1: unshuffle_crc_impl<1>(ptrs.data(), d, n, crc_on, crc.data()); break;
    case 2: unshuffle_crc_impl<2>(ptrs.data(), d, n, crc_on, crc.data()); break;
    case 4: unshuffle_crc_impl<4>(ptrs.data(), d, n, crc_on, crc.data()); break;
    default: unshuffle_crc_impl<8>(ptrs.data(), d, n, crc_on, crc.data()); break;
  }
  at::Tensor out = at::empty({size}, dst.options().dtype(at::kLong));
  for (int64_t k = 0; k < size; ++k) out.data_ptr<int64_t>()[k] = crc[k];
  return out;
}

at::Tensor crc32_cpu(const at::Tensor& data, int64_t value) {
  check_bytes(data, "data");
  TORCH_CHECK(value >= 0 && value < (int64_t{1} << 32), "fsdpx::crc32: value must be a CRC-32 ",
              "in [0, 2**32), got ", value);
  const uint32_t crc = crc32_update(static_cast<uint32_t>(value), data.data_ptr<uint8_t>(),
                                    static_cast<size_t>(data.numel()));
  at::Tensor out = at::empty({}, data.options().dtype(at::kLong));
  out.data_ptr<int64_t>()[0] = crc;
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdpx, CPU, m) {
  m.impl("shuffle_crc", &shuffle_crc_cpu);
  m.impl("unshuffle_crc", &unshuffle_crc_cpu);
  m.impl("crc32", &crc32_cpu);
}

}  // namespace fsdpx::shuffle

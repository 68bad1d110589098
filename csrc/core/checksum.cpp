#include "smp/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define SMP_CRC32C_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define SMP_CRC32C_ARM 1
#endif

namespace smp {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;  // CRC-32C, bit-reversed

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

// The CRC register without the pre- and post-inversion is linear: for bytes A then B,
// crc(s, A B) = shift(crc(s, A), |B|) ^ crc(0, B), where shift multiplies by x^(8 |B|) modulo
// the polynomial. So three independent streams over consecutive blocks run in parallel (the
// CRC instruction has a latency of 3 cycles and a throughput of 1) and are joined with two
// multiplications per round.
constexpr size_t kStreamBlock = 4096;

// a * b modulo the polynomial, in the bit-reversed representation (bit 31 is x^0).
uint32_t multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int power = 0; power < 32; ++power) {
    if (a & (0x80000000u >> power)) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPolynomial : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * bytes) modulo the polynomial: what shifting a register over `bytes` zeros multiplies by.
uint32_t shift_factor(uint64_t bytes) {
  uint32_t result = 0x80000000u;  // x^0
  uint32_t square = 0x00800000u;  // x^8
  for (; bytes > 0; bytes >>= 1) {
    if (bytes & 1u) result = multiply(result, square);
    square = multiply(square, square);
  }
  return result;
}

#if SMP_CRC32C_X86
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n,
                                                         uint32_t crc) {
  static const uint32_t one_block = shift_factor(kStreamBlock);
  static const uint32_t two_blocks = shift_factor(2 * kStreamBlock);
  uint64_t state = crc;
  while (n >= 3 * kStreamBlock) {
    uint64_t s1 = 0, s2 = 0;
    for (size_t i = 0; i < kStreamBlock; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kStreamBlock + i, 8);
      std::memcpy(&w2, p + 2 * kStreamBlock + i, 8);
      state = _mm_crc32_u64(state, w0);
      s1 = _mm_crc32_u64(s1, w1);
      s2 = _mm_crc32_u64(s2, w2);
    }
    state = multiply(static_cast<uint32_t>(state), two_blocks) ^
            multiply(static_cast<uint32_t>(s1), one_block) ^ static_cast<uint32_t>(s2);
    p += 3 * kStreamBlock;
    n -= 3 * kStreamBlock;
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    state = _mm_crc32_u64(state, word);
    p += 8;
    n -= 8;
  }
  uint32_t tail = static_cast<uint32_t>(state);
  while (n-- > 0) tail = _mm_crc32_u8(tail, *p++);
  return tail;
}

bool has_sse42() {
  static const bool supported = __builtin_cpu_supports("sse4.2");
  return supported;
}
#endif

#if SMP_CRC32C_ARM
uint32_t crc32c_arm(const unsigned char* p, size_t n, uint32_t crc) {
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    crc = __crc32cd(crc, word);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = __crc32cb(crc, *p++);
  return crc;
}
#endif

}  // namespace

namespace internal {
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = (crc >> 8) ^ kTable[(crc ^ p[i]) & 0xFFu];
  return ~crc;
}
}  // namespace internal

bool crc32c_is_hardware() {
#if SMP_CRC32C_X86
  return has_sse42();
#elif SMP_CRC32C_ARM
  return true;
#else
  return false;
#endif
}

uint32_t crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
#if SMP_CRC32C_X86
  if (has_sse42()) return ~crc32c_sse42(p, size, ~crc);
#elif SMP_CRC32C_ARM
  return ~crc32c_arm(p, size, ~crc);
#endif
  return internal::crc32c_portable(p, size, crc);
}

}  // namespace smp

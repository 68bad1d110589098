#include "smp/checksum.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace smp {
namespace {

TEST(Crc32c, KnownValues) {
  // The check value of CRC-32C (RFC 3720, appendix B.4) and the empty input.
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(internal::crc32c_portable(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
  // 32 zero bytes (RFC 3720, B.4).
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(Crc32c, MatchesThePortableOneAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::vector<unsigned char> data(4096 + 16);
  for (auto& byte : data) byte = static_cast<unsigned char>(rng());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t size : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      EXPECT_EQ(crc32c(data.data() + offset, size),
                internal::crc32c_portable(data.data() + offset, size))
          << "offset " << offset << " size " << size;
    }
  }
}

TEST(Crc32c, MatchesThePortableOneOnLongInputs) {
  // Long enough for the three-stream rounds (3 x 4 KiB), with remainders of every kind.
  std::mt19937 rng(11);
  std::vector<unsigned char> data(200000);
  for (auto& byte : data) byte = static_cast<unsigned char>(rng());
  for (size_t size : {12287, 12288, 12289, 12296, 24576 + 5, 100000, 200000}) {
    EXPECT_EQ(crc32c(data.data() + 3, size - 3), internal::crc32c_portable(data.data() + 3, size - 3))
        << "size " << size;
  }
}

TEST(Crc32c, ContinuesAcrossPieces) {
  std::vector<unsigned char> data(10000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 31 + 7);
  const uint32_t whole = crc32c(data.data(), data.size());
  for (size_t cut : {0, 1, 8, 4095, 9999, 10000}) {
    uint32_t crc = crc32c(data.data(), cut);
    crc = crc32c(data.data() + cut, data.size() - cut, crc);
    EXPECT_EQ(crc, whole) << "cut at " << cut;
  }
}

}  // namespace
}  // namespace smp

// smp/checksum.h — CRC-32C (Castagnoli), the checksum smp records for every checkpoint file.
//
// Checkpoints are checked on every save and load, so the checksum must cost far less than the
// disk: on x86-64 with SSE4.2 and on AArch64 with the CRC extension it runs on the CPU's CRC
// instruction (several GB/s per core), elsewhere on a table (hundreds of MB/s).
//
// Example:
//   uint32_t crc = smp::crc32c(first.data(), first.size());
//   crc = smp::crc32c(second.data(), second.size(), crc);  // the CRC of first + second
#pragma once

#include <cstddef>
#include <cstdint>

namespace smp {

/// The CRC-32C of `size` bytes at `data`, continuing a CRC of earlier bytes (`crc`, 0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

/// Whether crc32c() runs on the CPU's CRC instruction on this machine.
bool crc32c_is_hardware();

namespace internal {
/// The table-driven CRC-32C, whatever the CPU: crc32c()'s fallback, and its reference in tests.
uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc = 0);
}  // namespace internal

}  // namespace smp

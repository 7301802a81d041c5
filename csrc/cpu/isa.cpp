// Runtime ISA detection for the CPU kernels.
//
// The module is compiled for the baseline ISA; kernels for wider ISAs live in functions with
// __attribute__((target(...))) and are picked with these flags, so the same binary runs on every x86-64 CPU.
// A feature counts only when both the CPU reports it and the OS saves its registers (XCR0), else using it
// would fault.
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

#include <cstring>
#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

namespace ktrans {
namespace {

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux keeps AMX tile data off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

IsaInfo detect() {
  IsaInfo info;
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    info.amd = std::strcmp(vendor, "AuthenticAMD") == 0;
  }
  if (!__get_cpuid(1, &a, &b, &c, &d)) return info;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  if (!osxsave) return info;
  const uint64_t xcr0 = xgetbv0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  __cpuid_count(7, 0, a, b, c, d);
  info.avx2 = os_avx && (b & (1u << 5)) && fma && f16c;
  info.avx512f = os_avx512 && (b & (1u << 16));
  info.avx512bw = info.avx512f && (b & (1u << 30));
  info.avx512vl = info.avx512f && (b & (1u << 31));
  info.avx512vnni = info.avx512bw && (c & (1u << 11));
  info.amx_tile = os_amx && (d & (1u << 24));
  info.amx_int8 = info.amx_tile && (d & (1u << 25));
  info.amx_bf16 = info.amx_tile && (d & (1u << 22));
  __cpuid_count(7, 1, a, b, c, d);
  info.avx512bf16 = info.avx512bw && (a & (1u << 5));
  if (info.amx_tile && !request_amx_permission()) {
    info.amx_tile = info.amx_int8 = info.amx_bf16 = false;
    info.amx_denied = true;
  }
  return info;
}

}  // namespace

const IsaInfo& isa() {
  static const IsaInfo info = detect();
  return info;
}

}  // namespace ktrans

#else
namespace ktrans {
const IsaInfo& isa() {
  static const IsaInfo info;
  return info;
}
}  // namespace ktrans
#endif

// What the running CPU (and OS) can execute; see isa.cpp.
#pragma once

namespace ktrans {

struct IsaInfo {
  bool avx2 = false;        // with FMA and F16C
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool amx_tile = false;
  bool amx_int8 = false;
  bool amx_bf16 = false;
  bool amx_denied = false;  // the CPU has AMX but the kernel refused tile-data permission
  bool amd = false;         // vendor AuthenticAMD (a tuning default differs: MoEConfig::x16_prefetch_bytes)
};

const IsaInfo& isa();

}  // namespace ktrans

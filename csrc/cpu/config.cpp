// MoEConfig: the environment's defaults and the range checks. Baseline ISA only.
#include "config.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "isa.h"

namespace ktrans {
namespace {

// The integer value of environment variable `name` (atoi), or `fallback` when it is unset or empty.
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

constexpr int kMaxPrefetchBytes = 1 << 20;

// A prefetch distance from the environment: as before the per-object config, rounded down to a multiple of 64 and
// kept within the range check() allows.
int env_prefetch_bytes(const char* name, int fallback) {
  return std::min(kMaxPrefetchBytes, std::max(64, env_int(name, fallback) & ~63));
}

void require(bool ok, const char* field, const std::string& what, int got) {
  if (!ok) throw std::invalid_argument(std::string(field) + ": must be " + what + ", got " + std::to_string(got));
}

void check_prefetch_bytes(const char* field, int v) {
  require(v >= 64 && v <= kMaxPrefetchBytes && v % 64 == 0, field,
          "a multiple of 64 from 64 to " + std::to_string(kMaxPrefetchBytes), v);
}

}  // namespace

MoEConfig MoEConfig::defaults() {
  MoEConfig c;
  // Out-of-range values are clamped, as the environment always was; a config given explicitly is checked instead.
  c.gate_up_tasks = std::max(1, env_int("KTRANS_GU_TASKS", c.gate_up_tasks));
  c.down_tasks = std::max(1, env_int("KTRANS_DN_TASKS", c.down_tasks));
  c.down_expert_rows = std::max(16, env_int("KTRANS_DN_ROWS", c.down_expert_rows));
  c.prefetch_bytes = env_prefetch_bytes("KTRANS_PREFETCH_BYTES", c.prefetch_bytes);
  const char* hint = std::getenv("KTRANS_PREFETCH_HINT");
  const std::string h = hint ? hint : "";
  c.prefetch_hint = h == "t1" ? 1 : (h == "nta" ? 2 : 0);
  c.x16_prefetch_bytes = env_prefetch_bytes("KTRANS_X16_PREFETCH_BYTES", isa().amd ? 1024 : c.x16_prefetch_bytes);
  c.tile_min_tokens = std::max(1, env_int("KTRANS_TILE_MIN_TOKENS", c.tile_min_tokens));
  c.x16_tile_from = std::max(1, env_int("KTRANS_X16_TILE_FROM", c.x16_tile_from));
  const int amx = env_int("KTRANS_AMX", c.amx);
  c.amx = amx == 1 || amx == 2 ? amx : 0;  // as before: what is not 1 or 2 means the VNNI tiles
  return c;
}

void MoEConfig::check() const {
  require(gate_up_tasks >= 1, "gate_up_tasks", "at least 1", gate_up_tasks);
  require(down_tasks >= 1, "down_tasks", "at least 1", down_tasks);
  require(down_expert_rows >= 16, "down_expert_rows", "at least 16", down_expert_rows);
  check_prefetch_bytes("prefetch_bytes", prefetch_bytes);
  require(prefetch_hint >= 0 && prefetch_hint <= 2, "prefetch_hint", "0 (t0), 1 (t1) or 2 (nta)", prefetch_hint);
  check_prefetch_bytes("x16_prefetch_bytes", x16_prefetch_bytes);
  require(tile_min_tokens >= 1, "tile_min_tokens", "at least 1", tile_min_tokens);
  require(x16_tile_from >= 1, "x16_tile_from", "at least 1", x16_tile_from);
  require(amx >= 0 && amx <= 2, "amx", "0 (AVX-512 VNNI), 1 (AMX where present) or 2 (emulated AMX)", amx);
}

int amx_mode(int amx) { return amx == 2 ? 2 : (amx == 1 && isa().amx_int8 ? 1 : 0); }

}  // namespace ktrans

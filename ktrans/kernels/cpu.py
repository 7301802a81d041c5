"""The C++ CPU kernels (ktrans._cpu) from Python: ISA report, MoE experts and linear on raw GGUF blocks.

Weights come in ggml's bytes (a uint8 tensor per stacked matrix, as in a GGUF file's ffn_{gate,up,down}_exps, or
a float/bf16 tensor for F32/F16/BF16). CPULinear reads them in place; CPUMoE by default copies them once into
transparent huge pages and repacks Q4_K and Q5_K 16 rows at a time where the AVX-512 kernels read that (see
CPUMoE).
Activations are float32 [T, hidden]. `submit` queues the work on the pool and returns a `Pending` at once, with
the GIL released, so the caller (the GPU's attention and shared expert) runs meanwhile; `Pending.wait()` joins.
Every tensor a job reads or writes is kept alive by its Pending until then.

The kernel path is chosen once per object: "auto" takes the best this CPU runs (AVX-512 VNNI, else AVX2+FMA,
else portable C++), and the environment variable KTRANS_CPU_ISA=avx512|avx2|scalar overrides "auto". The tuning
(work split, prefetch, tiles, AMX) is a CPUMoEConfig per object; the KTRANS_* tuning variables only give its defaults.
The thread pool and the kernel path query are in ktrans.kernels.cpu_pool, re-exported here.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ktrans import _cpu  # ImportError here means the package was installed without its build
# The pool and kernel path live in cpu_pool; _default_pool is not re-exported, as a name bound here would keep the
# pool of import time, not the one get_pool later replaces it with.
from ktrans.kernels.cpu_pool import (DEFAULT_SPIN_US, STREAM_SPIN_US, best_path,  # noqa: F401 (re-exported)
                                     core_siblings, default_threads, get_pool, isa_info, make_pool, read_bandwidth,
                                     spin_us, stream_bandwidth, stream_spin_us)
from ktrans.kernels.host_memory import (_HUGEPAGE_MIN_BYTES, host_hugepages, host_rss,  # noqa: F401 (re-exported)
                                        hugepage_buffer, in_hugepages, numa_nodes, release_file_pages, thp_mode)

# ggml type ids of the formats the kernels read (ktrans.weights.quants has the full table).
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14, "BF16": 30}
_TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}
# ggml type -> (id, name) of its 16-row layout (csrc/cpu/quant.h), which CPUMoE repacks into where the path reads it
_X16 = {GGML_TYPES["Q4_K"]: (_cpu.Q4_K_X16, "Q4_K_X16"), GGML_TYPES["Q5_K"]: (_cpu.Q5_K_X16, "Q5_K_X16")}
_X16_NAMES = dict(_X16.values())
_FLOAT_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# What the ops hand the kernels: the ggml types they read as stored, and the torch dtype of each float one.
KERNEL_TYPES = tuple(GGML_TYPES)
TORCH_FLOAT = {name: dtype for dtype, name in _FLOAT_TYPES.items()}
_F32, _I64 = torch.float32, torch.int64


def type_id(qtype: int | str) -> int:
    """A ggml type name ("Q4_K") or id, checked against the formats the CPU kernels read."""
    if isinstance(qtype, str):
        if qtype.upper() not in GGML_TYPES:
            raise ValueError(f"the CPU kernels do not read {qtype!r}; they read {sorted(GGML_TYPES)}")
        return GGML_TYPES[qtype.upper()]
    if int(qtype) not in GGML_TYPES.values():
        raise ValueError(f"the CPU kernels do not read ggml type {int(qtype)}; they read {sorted(GGML_TYPES)}")
    return int(qtype)


def row_bytes(qtype: int | str, k: int) -> int:
    return _cpu.type_row_bytes(type_id(qtype), k)


# ---------------------------------------------------------------------------------------------------------
# tuning: one config per object

_HINTS = ("t0", "t1", "nta")  # prefetch_hint names, in the order of the C++ values 0, 1, 2


def _default(name: str):
    """A dataclass default: field `name` of the C++ defaults, from the KTRANS_* environment variables read now."""
    def make():
        value = _cpu.moe_config()[name]
        return _HINTS[value] if name == "prefetch_hint" else value
    return field(default_factory=make)


@dataclass(frozen=True)
class CPUMoEConfig:
    """The tuning of one CPUMoE (or CPULinear): how its jobs split their work and how its kernels run.

    Each object holds its own, so two CPUMoEs in one process can run with different settings. A field left out takes
    its default from its environment variable, read when the config is made (never later: a config, and the object
    holding it, does not change when the environment does); a field given is checked instead, and a bad one raises
    ValueError naming it. The results do not depend on the config, except that the Q4_K/Q5_K tiles sum in another
    order than the row kernels (tile_min_tokens). csrc/cpu/config.h has the measurements behind the defaults.

    - gate_up_tasks (KTRANS_GU_TASKS, 4), down_tasks (KTRANS_DN_TASKS, 2): about this many gate/up and down tasks
      per pool thread in a MoE call (at least 1);
    - down_expert_rows (KTRANS_DN_ROWS, 256): most rows per down task when down runs per expert (decode; >= 16);
    - prefetch_bytes (KTRANS_PREFETCH_BYTES, 4096): the row kernels' software prefetch distance (a multiple of 64,
      64 to 1 MiB); prefetch_hint (KTRANS_PREFETCH_HINT, "t0"): "t0", "t1" (into L2) or "nta" (non-temporal);
    - x16_prefetch_bytes (KTRANS_X16_PREFETCH_BYTES, 1024 on AMD CPUs, else 4096): the distance of the repacked
      Q4_K/Q5_K kernels;
    - tile_min_tokens (KTRANS_TILE_MIN_TOKENS, 3): activation rows per gemm call from which Q4_K/Q5_K use the tile
      kernels (TILES_OFF: never);
    - x16_tile_from (KTRANS_X16_TILE_FROM, 24): activation rows from which the repacked kernels unpack a tile once per
      superblock instead of fused passes of four;
    - amx (KTRANS_AMX, 1): the Q4_K/Q5_K prefill tiles on 1 AMX where the CPU has it, 0 AVX-512 VNNI, 2 the AMX data
      flow emulated in C++ (tests); amx_mode says what runs here;
    - prefetch_clamp (True): whether the in-loop prefetch stops at the end of a call's weight rows (False only for
      A/B diagnostics).
    """

    gate_up_tasks: int = _default("gate_up_tasks")
    down_tasks: int = _default("down_tasks")
    down_expert_rows: int = _default("down_expert_rows")
    prefetch_bytes: int = _default("prefetch_bytes")
    prefetch_hint: str = _default("prefetch_hint")
    x16_prefetch_bytes: int = _default("x16_prefetch_bytes")
    tile_min_tokens: int = _default("tile_min_tokens")
    x16_tile_from: int = _default("x16_tile_from")
    amx: int = _default("amx")
    prefetch_clamp: bool = _default("prefetch_clamp")

    def __post_init__(self):
        if self.prefetch_hint not in _HINTS:
            raise ValueError(f"CPUMoEConfig.prefetch_hint: must be one of {', '.join(_HINTS)}, "
                             f"got {self.prefetch_hint!r}")
        try:  # the ranges (and the integer types) are checked where they are used, in C++
            _cpu.moe_config(self.native())
        except ValueError as e:
            raise ValueError(f"CPUMoEConfig.{e}") from None

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def native(self) -> dict:
        """The dict the C++ side takes (prefetch_hint as 0, 1 or 2)."""
        return {**self._fields(), "prefetch_hint": _HINTS.index(self.prefetch_hint)}

    @classmethod
    def from_native(cls, d: dict) -> CPUMoEConfig:
        return cls(**{**d, "prefetch_hint": _HINTS[d["prefetch_hint"]]})

    @classmethod
    def from_dict(cls, d: dict) -> CPUMoEConfig:
        """A config from a mapping of some of its fields (a rule's cpu_config); ValueError names an unknown key."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in known:
                raise ValueError(f"unknown CPUMoEConfig field {key!r} (known: {', '.join(known)})")
        return cls(**d)

    def replace(self, **changes) -> CPUMoEConfig:
        """A copy with `changes` applied (checked); the other fields stay as they are here."""
        return dataclasses.replace(self, **changes)

    @property
    def amx_mode(self) -> int:
        """How the Q4_K/Q5_K prefill tiles run under this config on this CPU: 1 AMX, 0 AVX-512 VNNI, 2 emulated."""
        return _cpu.amx_mode(self.amx)


def _config(config: CPUMoEConfig | None) -> CPUMoEConfig:
    if config is None:
        return CPUMoEConfig()
    if not isinstance(config, CPUMoEConfig):
        raise TypeError(f"config must be a CPUMoEConfig, got {type(config).__name__}")
    return config


class _Tuned:
    """`config` and `set_config` of an object whose C++ side (the attribute named _NATIVE) holds the config too."""

    _NATIVE = ""
    _config: CPUMoEConfig

    @property
    def config(self) -> CPUMoEConfig:
        return self._config

    def set_config(self, config: CPUMoEConfig) -> None:
        """Run the jobs submitted from now on with `config`. A job already submitted (and not yet waited for) keeps
        the config it was submitted with: each job takes a copy at submit."""
        config = _config(config)
        getattr(self, self._NATIVE).set_config(config.native())
        self._config = config


# ---------------------------------------------------------------------------------------------------------
# ISA report (ktrans doctor)

def isa_report() -> dict:
    info = isa_info()
    path, why = best_path(info)
    status = _cpu.path_status()
    defaults = CPUMoEConfig()
    return {"path": path, "why": why, "runnable_paths": [p for p, reason in status.items() if reason is None],
            "prefill_tiles": prefill_tiles(path, info, defaults),
            # CPUMoE copies expert weights into huge pages only where this is "always" or "madvise"
            "transparent_hugepages": thp_mode(),
            # what a CPUMoE made now runs with unless given a config (the KTRANS_* tuning variables apply)
            "prefetch_bytes": {"row_kernels": defaults.prefetch_bytes, "q4_k_x16": defaults.x16_prefetch_bytes},
            "moe_config_defaults": dataclasses.asdict(defaults),
            # two or more: the pool's workers span nodes and read the experts from wherever their pages landed
            "numa_nodes": numa_nodes(),
            "features": info}


TILES_OFF = 1 << 30  # a tile_min_tokens that no call reaches: the tiles are off


def prefill_tiles(path: str, info: dict[str, bool], config: CPUMoEConfig | None = None) -> dict:
    """How Q4_K/Q5_K experts with many tokens per call (prefill) are computed under `config` (default: the
    defaults): 16 weight rows at a time on AMX or AVX-512 VNNI tiles, 8 on AVX2 tiles, or by the row kernels."""
    config = CPUMoEConfig() if config is None else config
    tmin = config.tile_min_tokens
    if path not in ("avx512", "avx2"):
        return {"mode": "rows", "why": "the tiles need AVX2 or AVX-512"}
    if tmin >= TILES_OFF:
        return {"mode": "rows", "why": "turned off (tile_min_tokens; KTRANS_TILE_MIN_TOKENS by default)"}
    if path == "avx2":
        return {"mode": "avx2", "why": "AVX2 tiles of 8 rows (vpmaddubsw, int16 sums per sub-block)",
                "from_tokens_per_expert": max(tmin, _cpu.AVX2_TILE_MIN_TOKENS)}
    mode = {0: "avx512-vnni", 1: "amx", 2: "amx-emulated"}[config.amx_mode]
    if mode == "amx":
        why = "AMX-INT8 tiles (tdpbusd) for the dot products, AVX-512 for unpacking and scales"
    elif mode == "amx-emulated":
        why = "the AMX data flow with the tile product in plain C++ (amx=2: a test mode, slow)"
    elif info.get("amx_int8") and config.amx == 0:
        why = "AVX-512 VNNI tiles (AMX turned off: amx=0; KTRANS_AMX=0 by default)"
    else:
        why = "AVX-512 VNNI tiles (vpdpbusd, one 32-bit lane per weight row); no AMX-INT8 here"
    return {"mode": mode, "why": why, "from_tokens_per_expert": tmin}


# ---------------------------------------------------------------------------------------------------------
# jobs

class Pending:
    """A submitted job: wait() blocks until it is done and returns its output."""

    __slots__ = ("_pool", "_ticket", "_out", "_keep", "_done")

    def __init__(self, pool, ticket: int, out: torch.Tensor, keep: tuple):
        self._pool, self._ticket, self._out, self._keep, self._done = pool, ticket, out, keep, False

    def done(self) -> bool:
        return self._done or self._pool.done(self._ticket)

    def wait(self) -> torch.Tensor:
        if not self._done:
            try:
                self._pool.wait(self._ticket)
            finally:
                self._done, self._keep = True, ()
        return self._out

    def __del__(self):
        # Dropped without wait(): the job may still read the inputs and write the output this holds, so let it end
        # before they are freed (its error, if any, is left to whoever waits next).
        if not self._done and self._keep:
            try:
                self._pool.wait(self._ticket)
            except Exception:  # noqa: BLE001 - nowhere to report it from a finalizer
                pass


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _cpu_weights(t, what: str, nbytes: int) -> torch.Tensor:
    """t (a tensor or numpy array) as a CPU tensor of exactly nbytes, not necessarily contiguous."""
    if not isinstance(t, torch.Tensor):
        t = torch.from_numpy(t)
    if t.device.type != "cpu":
        raise ValueError(f"{what}: weights must be in CPU memory, got a tensor on {t.device}")
    have = t.numel() * t.element_size()
    if have != nbytes:
        raise ValueError(f"{what}: expected {nbytes} bytes, got {have} (shape {tuple(t.shape)}, {t.dtype})")
    return t


def _as_bytes(t, what: str, nbytes: int) -> torch.Tensor:
    """A contiguous CPU tensor holding exactly nbytes (the caller keeps it alive)."""
    return _cpu_weights(t, what, nbytes).contiguous()


def _weight_type(t, qtype) -> int:
    if qtype is not None:
        return type_id(qtype)
    if isinstance(t, torch.Tensor) and t.dtype in _FLOAT_TYPES:
        return GGML_TYPES[_FLOAT_TYPES[t.dtype]]
    raise ValueError("raw (uint8) weight blocks need their ggml type, e.g. qtype='Q4_K'")


def _activations(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{what}: expected activations [T, {width}], got {tuple(x.shape)}")
    return _cpu_tensor(x, torch.float32)


def _cpu_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous CPU tensor of dtype; the common case (already one) skips the torch dispatches, which are
    a measurable share of a decode step's fixed cost."""
    if t.dtype == dtype and t.is_cpu and t.is_contiguous() and not t.requires_grad:  # (t.device.type costs more)
        return t
    return t.detach().to("cpu", dtype).contiguous()


class CPUMoE(_Tuned):
    """The routed experts of one MoE layer on the CPU, on stacked raw blocks.

    gate, up: [E, intermediate, hidden] and down: [E, hidden, intermediate] expert matrices, each one buffer
    (uint8 ggml blocks with its type given in `types`, or a float32/float16/bfloat16 tensor). Types may differ
    per matrix (Q4_K_M files mix Q4_K and Q6_K). With hugepages (the default) each matrix of 4 MiB or more is
    copied once into transparent huge pages (the load time of a memcpy, the same bytes; a GGUF file's mmap then
    stays only as page cache); with hugepages=False weights are read in place (a non-contiguous view, such as half
    of a fused gate_up tensor, is still copied once to make it contiguous), except Q4_K and Q5_K unless repack=False.

    With repack (the default), Q4_K and Q5_K matrices are repacked 16 rows at a time into the layout of the AVX-512
    VNNI dot product (Q4_K_X16, Q5_K_X16, csrc/cpu/quant.h: the same bytes, reordered) where the kernel path reads
    it: one instruction stream per 16 rows and 64 bytes instead of transposing them at every call, 1.9-3.2x the
    row kernels per thread. The repack takes the place of the huge-page copy (no second buffer); without huge pages it
    is one extra buffer of the matrix's size. `layouts` names what each matrix is kept as.

    `config` (a CPUMoEConfig; default: CPUMoEConfig(), from the environment now) tunes this layer's jobs; `config`
    reads it and set_config replaces it.
    """

    _NATIVE = "_moe"

    def __init__(self, gate, up, down, *, n_experts: int, hidden: int, intermediate: int,
                 types: tuple | None = None, pool: _cpu.ThreadPool | None = None, isa: str = "auto",
                 hugepages: bool = True, repack: bool = True, config: CPUMoEConfig | None = None):
        self._config = _config(config)
        types = types or (None, None, None)
        self.n_experts, self.hidden, self.intermediate = n_experts, hidden, intermediate
        self.types = tuple(_weight_type(t, q) for t, q in zip((gate, up, down), types))
        shapes = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
        sizes = [n_experts * rows * _cpu.type_row_bytes(ty, cols) for ty, (rows, cols) in zip(self.types, shapes)]
        mats = [_cpu_weights(t, name, n) for t, name, n in zip((gate, up, down), ("gate", "up", "down"), sizes)]
        # hugepages: matrices of 4 MiB and more are copied into transparent huge pages (see in_hugepages) where
        # the kernel's THP mode allows them; self.hugepages says whether it took the advice for all of them.
        self.pool = pool or get_pool()
        huge = hugepages and thp_mode() in ("always", "madvise") and min(sizes) >= _HUGEPAGE_MIN_BYTES
        x16 = repack and _cpu.reads_x16(isa)
        kinds, weights, advised, self.repack_s = [], [], [], 0.0
        self.released_bytes = 0  # source pages of a GGUF mapping let go once copied (host_memory.release_file_pages)
        for t, ty, (rows, cols), n in zip(mats, self.types, shapes, sizes):
            if x16 and ty in _X16 and rows % 16 == 0 and cols % 256 == 0:
                src = t.contiguous()
                dst, ok = hugepage_buffer(n) if huge else (torch.empty(n, dtype=torch.uint8), False)
                t0 = time.perf_counter()
                _cpu.repack_x16(self.pool, ty, src.data_ptr(), dst.data_ptr(), n_experts * rows, cols)
                self.repack_s += time.perf_counter() - t0
                kinds.append(_X16[ty][0])
            elif huge:
                dst, ok = in_hugepages(t)
                kinds.append(ty)
            else:
                dst, ok = t.contiguous(), False
                kinds.append(ty)
            if dst.data_ptr() != t.data_ptr():  # a copy: the file pages it was read from need not stay resident
                self.released_bytes += release_file_pages(t)
            weights.append(dst)
            advised.append(ok)
        self.weights = tuple(weights)
        # self.hugepages: whether every matrix took the huge-page advice
        self.hugepages = huge and all(advised)
        self.layouts = tuple(_X16_NAMES.get(k) or _TYPE_NAMES[k] for k in kinds)
        g, u, d = self.weights
        self._moe = _cpu.MoE(self.pool, n_experts, hidden, intermediate, g.data_ptr(), kinds[0],
                             u.data_ptr(), kinds[1], d.data_ptr(), kinds[2], isa, self._config.native())
        self._last: Pending | None = None

    @property
    def path(self) -> str:
        return self._moe.path

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices: what a call streams per distinct expert it routes to."""
        return self.nbytes // self.n_experts

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               out: torch.Tensor | None = None) -> Pending:
        """Queue out = sum_k w[t, k] * expert_{ids[t, k]}(x[t]) and return at once. Negative ids are skipped."""
        xf, ids, w, out = self._inputs(x, topk_ids, topk_weights, out)
        ticket = self._moe.submit(xf.data_ptr(), xf.shape[0], self.hidden, ids.data_ptr(), w.data_ptr(), ids.shape[1],
                                  out.data_ptr(), self.hidden)
        self._last = Pending(self.pool, ticket, out, (self, xf, ids, w))
        return self._last

    def _inputs(self, x, topk_ids, topk_weights, out):
        # What the model passes (contiguous float32 x [T, hidden], int64 ids and float32 weights [T, k] on the CPU)
        # is checked in one flat expression: a decode step's caller runs this on a core whose caches the weight
        # stream has just emptied, where every extra function and attribute lookup costs (doc/cpu_kernels.md).
        xs, ks = x.shape, topk_ids.shape
        if (out is None and len(xs) == 2 and len(ks) == 2 and xs[1] == self.hidden and ks[0] == xs[0]
                and topk_weights.shape == ks and x.dtype is _F32 and topk_ids.dtype is _I64
                and topk_weights.dtype is _F32 and x.is_cpu and topk_ids.is_cpu and topk_weights.is_cpu
                and not x.requires_grad and x.is_contiguous() and topk_ids.is_contiguous()
                and topk_weights.is_contiguous()):
            return x, topk_ids, topk_weights, torch.empty(xs[0], self.hidden)
        return self._inputs_checked(x, topk_ids, topk_weights, out)

    def _inputs_checked(self, x, topk_ids, topk_weights, out):
        """Every check, with conversions (other dtypes, layouts, devices) and the errors that name the field."""
        xf = _activations(x, self.hidden, "CPUMoE.submit x")
        t = xf.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"CPUMoE.submit: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} must both be [T={t}, k]")
        ids = _cpu_tensor(topk_ids, torch.int64)
        w = _cpu_tensor(topk_weights, torch.float32)
        if out is None:
            out = torch.empty(t, self.hidden, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (t, self.hidden) or not out.is_contiguous():
            raise ValueError(f"CPUMoE.submit out: expected contiguous float32 [{t}, {self.hidden}]")
        elif t and _overlap(out, xf):
            raise ValueError("CPUMoE.submit out: must not share memory with x (the job reads x while it writes out)")
        return xf, ids, w, out

    def sync(self) -> torch.Tensor | None:
        """Wait for this layer's last submit and return its output (None if nothing was submitted)."""
        return self._last.wait() if self._last is not None else None

    def forward(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """submit + wait in one call into the extension (one GIL release, no Pending): the synchronous path."""
        xf, ids, w, out = self._inputs(x, topk_ids, topk_weights, None)
        self._moe.run(xf.data_ptr(), xf.shape[0], self.hidden, ids.data_ptr(), w.data_ptr(), ids.shape[1],
                      out.data_ptr(), self.hidden)
        return out

    __call__ = forward


class CPULinear(_Tuned):
    """y = x W^T on the CPU, W [n_out, n_in] as raw ggml blocks (or a float tensor), read in place; with repack, Q4_K
    and Q5_K weights are repacked 16 rows at a time as CPUMoE's (3-4x the row kernels per thread at one token; the
    sums then differ from the row kernels' in the last bits at one token, bitwise equal from three). `config`: as
    CPUMoE's (the kernel fields apply; the work split fields do not). `layout` names what the kernels read."""

    _NATIVE = "_lin"

    def __init__(self, weight, n_out: int, n_in: int, qtype=None, pool: _cpu.ThreadPool | None = None,
                 isa: str = "auto", config: CPUMoEConfig | None = None, repack: bool = False):
        self._config = _config(config)
        self.n_out, self.n_in = n_out, n_in
        self.type = _weight_type(weight, qtype)
        nbytes = n_out * _cpu.type_row_bytes(self.type, n_in)
        self.weight = _as_bytes(weight, "CPULinear weight", nbytes)
        self.pool = pool or get_pool()
        kind, self.layout = self.type, _TYPE_NAMES[self.type]
        # repack: Q4_K / Q5_K rows 16 at a time, as CPUMoE does for its experts (the same kernels read them), into a
        # buffer of their own; the stored blocks' pages of a GGUF map are let go, so the weights stay resident once
        self.released_bytes = 0
        if (repack and self.type in _X16 and n_out % 16 == 0 and n_in % 256 == 0 and _cpu.reads_x16(isa)):
            big = nbytes >= _HUGEPAGE_MIN_BYTES
            dst = hugepage_buffer(nbytes)[0] if big else torch.empty(nbytes, dtype=torch.uint8)
            _cpu.repack_x16(self.pool, self.type, self.weight.data_ptr(), dst.data_ptr(), n_out, n_in)
            self.released_bytes = release_file_pages(self.weight)
            self.weight, (kind, self.layout) = dst, _X16[self.type]
        self._lin = _cpu.Linear(self.pool, n_out, n_in, self.weight.data_ptr(), kind, isa, self._config.native())

    @property
    def path(self) -> str:
        return self._lin.path

    def submit(self, x: torch.Tensor) -> Pending:
        xf = _activations(x, self.n_in, "CPULinear x")
        y = torch.empty(xf.shape[0], self.n_out, dtype=torch.float32)
        ticket = self._lin.submit(xf.data_ptr(), xf.shape[0], self.n_in, y.data_ptr(), self.n_out)
        return Pending(self.pool, ticket, y, (self, xf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.submit(x).wait()

    __call__ = forward

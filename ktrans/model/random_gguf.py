"""Random-weight GGUF files at any config's shapes, written block by block on every core (`ktrans make-tiny --gguf
--preset qwen3-next-80b-a3b`).

The float path of `gguf_writer.write_gguf` draws fp32 weights and quantizes them; at the real 80B shapes that is
~80G floats and hours of k-quant scale search. Here each block is drawn directly in its ggml format instead:
random quants, and scales from a per-tensor pool of well-formed block heads sized so the dequantized weights have
the spread the float path gives (1/sqrt(fan-in), down-projections smaller by depth, norms near 1; see
`model/tiny.py`). Types are `gguf_writer.choose_types`' (llama-quantize's Q4_K_M mix, or F32/BF16/Q8_0), names
and metadata are the converter's, and the Qwen3 vocabulary and chat template are embedded, so llama.cpp loads the
file as it loads its own.

Streaming and parallel: the header is laid out first, then the tensors are cut into tasks of at most 32 MiB that
worker processes draw and `pwrite` at their offsets. Values are drawn in units of about 1 MiB of rows, each from a
generator seeded by (seed, tensor, unit), so the file's bytes depend on the seed only, not on the number of workers
or the task size; memory stays a few tasks per worker.

`router="skewed"` gives every layer's router a few hot experts (rows scaled up, so their logits spread wider and
win the top-k more often) and a log-normal spread over the rest: on isotropic hidden states the 8 hot experts of
a 512-expert layer take ~11% of the top-10 picks (uniform: ~2%), the 64 busiest ~43% (uniform: ~16%).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ktrans.config import ModelConfig
from ktrans.weights.gguf_writer import GGUFWriter, choose_types, gguf_tensors, model_metadata
from ktrans.weights.quant_blocks import f16_bytes
from ktrans.weights.quants import quant_type, quantize, row_bytes

ROUTERS = ("uniform", "skewed")
CHUNK_BYTES = 32 << 20  # bytes drawn per task: bounds each worker's memory
UNIT_BYTES = 1 << 20  # bytes of rows drawn from one seeded generator (part of the file format: keep it fixed)
_POOL = 4096  # distinct block heads per tensor (a block picks one with 12 of its random bits)

# Quant value spread per block type: (std of the integer codes as the format decodes them)
_Q4_STD, _Q5_STD, _Q6_STD, _Q8_STD = 4.61, 9.23, 18.47, 73.6


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order; the last dimension is ggml ne[0]
    qtype: str
    law: tuple  # ("normal", std) | ("uniform", lo, hi) | ("neg_uniform", lo, hi)
    index: int  # position in the file: part of every task's seed


def _law(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple:
    """The float distribution a GGUF tensor's values follow: model/tiny.py's initialisation, in GGUF terms (norms
    already hold the converter's +1; ssm_a is -exp(A_log))."""
    fan_in = shape[-1]
    if name == "token_embd.weight":
        return ("normal", 1.0)
    if name == "output.weight":
        return ("normal", 3.0 / math.sqrt(config.hidden_size))
    if name.endswith("_norm.weight"):
        return ("uniform", 0.7, 1.3)
    if name.endswith("ssm_a"):
        return ("neg_uniform", 1.0, 16.0)
    if name.endswith("ssm_dt.bias"):
        return ("uniform", -1.0, 1.5)
    if name.endswith("ffn_gate_inp.weight"):
        return ("normal", 2.0 / math.sqrt(fan_in))
    if name.endswith(("attn_output.weight", "ssm_out.weight")) or ".ffn_down" in name:
        return ("normal", 2.0 / math.sqrt(2 * config.num_hidden_layers) / math.sqrt(fan_in))
    return ("normal", 1.0 / math.sqrt(fan_in))


def plan_tensors(config: ModelConfig, quant: str, dense: str = "as-quant",
                 legacy_ssm_in: bool = False) -> list[_Tensor]:
    """Every tensor of the file, in the converter's order, with its type and value law."""
    import torch

    from ktrans.model.qwen3_next import Qwen3NextForCausalLM

    with torch.device("meta"):
        shapes = {n: torch.empty(p.shape, device="meta") for n, p in Qwen3NextForCausalLM(config).named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    named = [(n, s) for n, s, _ in gguf_tensors(config, shapes, legacy_ssm_in)]
    types = choose_types(named, quant, config.num_hidden_layers, dense=dense)
    return [_Tensor(n, s, types[n], _law(n, s, config), i) for i, (n, s) in enumerate(named)]


# ---------------------------------------------------------------------------------------------- blocks


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence([seed, *key])))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bytes at memory speed (Generator.bytes is ~10x slower than the raw 64-bit stream)."""
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def _heads(qtype: str, std: float, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(byte offset in the block, [_POOL, n] block heads): the scale fields of well-formed blocks whose values have
    about `std` spread and zero mean; a block's other bytes are its random quants."""
    jitter = np.exp(rng.normal(0.0, 0.2, _POOL)).astype(np.float32)  # blocks differ in scale, as trained ones do
    jitter /= np.sqrt(np.mean(jitter * jitter))
    if qtype in ("Q4_K", "Q5_K"):
        from ktrans.weights.quants_k import _pack_k_scale_min

        qstd, qmean = (_Q4_STD, 7.5) if qtype == "Q4_K" else (_Q5_STD, 15.5)
        sc = rng.integers(32, 64, (_POOL, 8)).astype(np.uint8)
        d = std * jitter / (qstd * 48.4)  # 48.4: the RMS of codes 32..63
        # the mins' codes equal the scales' and dmin = qmean * d: each sub-block then has mean ~0
        head = np.concatenate([f16_bytes(d), f16_bytes(qmean * d), _pack_k_scale_min(sc, sc)], axis=1)
        return 0, head
    if qtype == "Q6_K":  # ql[128] qh[64] scales[16] (int8) d
        sc = rng.integers(16, 128, (_POOL, 16)).astype(np.int8).view(np.uint8)
        d = std * jitter / (_Q6_STD * 78.0)  # 78.0: the RMS of codes 16..127
        return 192, np.concatenate([sc, f16_bytes(d)], axis=1)
    if qtype in ("Q8_0", "Q5_0", "Q4_0"):  # d first, then symmetric codes
        return 0, f16_bytes(std * jitter / {"Q8_0": _Q8_STD, "Q5_0": _Q5_STD, "Q4_0": _Q4_STD}[qtype])
    if qtype in ("Q4_1", "Q5_1"):  # d, m (the value of code 0): m = -mean code * d centres the block
        qstd, qmean = (_Q4_STD, 7.5) if qtype == "Q4_1" else (_Q5_STD, 15.5)
        d = std * jitter / qstd
        return 0, np.concatenate([f16_bytes(d), f16_bytes(-qmean * d)], axis=1)
    raise ValueError(f"no random block writer for {qtype}")


def _unit_rows(t: _Tensor) -> int:
    return max(1, UNIT_BYTES // row_bytes(t.qtype, t.shape[-1]))


def _units(t: _Tensor, seed: int, row0: int, nrows: int):
    """(generator, rows) for each seeding unit of rows [row0, row0 + nrows); row0 starts a unit."""
    per = _unit_rows(t)
    for r in range(row0, row0 + nrows, per):
        yield _rng(seed, t.index, r // per), min(per, row0 + nrows - r)


def _quant_rows(t: _Tensor, seed: int, row0: int, nrows: int) -> np.ndarray:
    qt = quant_type(t.qtype)
    per_row = t.shape[-1] // qt.block_size
    blocks = np.concatenate([_random_bytes(rng, n * per_row * qt.type_size) for rng, n in _units(t, seed, row0, nrows)])
    blocks = blocks.reshape(-1, qt.type_size)
    off, heads = _heads(t.qtype, t.law[1], _rng(seed, t.index, 1 << 30))
    pick = (blocks[:, off].astype(np.int32) | (blocks[:, off + 1].astype(np.int32) << 8)) % _POOL
    blocks[:, off:off + heads.shape[1]] = heads[pick]
    if t.qtype == "Q8_0":  # ggml's quantizer never writes -128
        q = blocks[:, 2:].view(np.int8)
        np.maximum(q, -127, out=q)
    return blocks


def _draw(rng: np.random.Generator, law: tuple, n: int) -> np.ndarray:
    if law[0] == "normal":
        return rng.standard_normal(n, dtype=np.float32) * np.float32(law[1])
    lo, hi = law[1], law[2]
    x = rng.random(n, dtype=np.float32) * np.float32(hi - lo) + np.float32(lo)
    return -x if law[0] == "neg_uniform" else x


def _float_rows(t: _Tensor, seed: int, row0: int, nrows: int, router_scale: np.ndarray | None) -> np.ndarray:
    x = np.concatenate([_draw(rng, t.law, n * t.shape[-1]) for rng, n in _units(t, seed, row0, nrows)])
    if router_scale is not None:
        x = (x.reshape(nrows, -1) * router_scale[:, None]).reshape(-1)
    return quantize(x, t.qtype)


def router_row_scales(seed: int, layer: int, n_experts: int) -> np.ndarray:
    """Per-expert scale of a skewed router's rows: max(1, n/64) hot experts at 2x, the rest log-normal (0.2). The
    same (seed, layer) gives the same hot experts in a GGUF written here and in `random_state_dict`."""
    rng = _rng(seed, layer, 1 << 31)
    s = np.exp(rng.normal(0.0, 0.2, n_experts)).astype(np.float32)
    s[rng.choice(n_experts, max(1, n_experts // 64), replace=False)] *= 2.0
    return s


# ---------------------------------------------------------------------------------------------- tasks

_FD: int | None = None


def _open_for_workers(path: str) -> None:
    global _FD
    _FD = os.open(path, os.O_WRONLY)


def _close_for_workers() -> None:
    global _FD
    if _FD is not None:
        os.close(_FD)
        _FD = None


def _run_task(task: tuple) -> int:
    t, seed, row0, nrows, offset, router = task
    if t.qtype in ("F32", "F16", "BF16"):
        scale = router_row_scales(seed, int(t.name.split(".")[1]), t.shape[0])[row0:row0 + nrows] if router else None
        data = _float_rows(t, seed, row0, nrows, scale)
    else:
        data = _quant_rows(t, seed, row0, nrows)
    buf = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    while buf:
        n = os.pwrite(_FD, buf, offset)
        buf, offset = buf[n:], offset + n
    return len(data.view(np.uint8).reshape(-1))


def _tasks(tensors: list[_Tensor], offsets: list[int], data_start: int, seed: int, skewed: bool):
    for t, off in zip(tensors, offsets):
        rows = math.prod(t.shape[:-1])
        rb = row_bytes(t.qtype, t.shape[-1])
        per = max(1, CHUNK_BYTES // UNIT_BYTES) * _unit_rows(t)  # whole seeding units per task
        router = skewed and t.name.endswith("ffn_gate_inp.weight")
        for row0 in range(0, rows, per):
            yield (t, seed, row0, min(per, rows - row0), data_start + off + row0 * rb, router)


def write_random_gguf(path: str | Path, config: ModelConfig, quant: str = "q4_k_m", seed: int = 0,
                      router: str = "uniform", dense: str = "as-quant", tokenizer=None, workers: int | None = None,
                      legacy_ssm_in: bool = False, show_progress: bool = False) -> Path:
    """Write a random-weight GGUF of `config`'s shapes; the same arguments give the same bytes."""
    if router not in ROUTERS:
        raise ValueError(f"--router must be one of {ROUTERS}, got {router!r}")
    tensors = plan_tensors(config, quant, dense, legacy_ssm_in)
    w = GGUFWriter(path)
    w.metadata.update(model_metadata(config, quant))
    w.metadata["general.name"] = f"ktrans random Qwen3-Next (seed {seed}, {router} router)"
    if tokenizer is not None:
        from ktrans.tokenizer.gguf import gguf_tokenizer_metadata

        w.metadata.update(gguf_tokenizer_metadata(tokenizer, config))
    for t in tensors:
        w.add_tensor(t.name, t.shape, t.qtype, lambda: None)
    header, offsets, data_bytes = w.layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(header)
        f.truncate(len(header) + data_bytes)  # alignment padding stays zero
    tasks = list(_tasks(tensors, offsets, len(header), seed, router == "skewed"))
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(tasks)))
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=data_bytes, unit="B", unit_scale=True, desc=f"writing {path.name}")
    try:
        if workers == 1:
            _open_for_workers(str(tmp))
            results = map(_run_task, tasks)
            _consume(results, bar)
        else:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(workers, _open_for_workers, (str(tmp),)) as pool:
                _consume(pool.imap_unordered(_run_task, tasks, chunksize=1), bar)
    finally:
        if bar is not None:
            bar.close()
        _close_for_workers()
    tmp.replace(path)
    return path


def _consume(results, bar) -> None:
    for n in results:
        if bar is not None:
            bar.update(n)


__all__ = ["ROUTERS", "plan_tensors", "router_row_scales", "write_random_gguf"]

"""Memory-mapped reading of (sharded) safetensors checkpoints.

A tensor read here is a view of the mapped file, so loading a checkpoint in its stored dtype costs page cache,
not private RSS; only a dtype conversion copies. The format is an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, then the raw bytes.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file and tensor."""


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise CheckpointError(f"{path}: empty file") from None
        if len(self._map) < 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", self._map[:8])
        if 8 + n > len(self._map):
            raise CheckpointError(f"{path}: header length {n} runs past the end of the file (truncated?)")
        try:
            header = json.loads(self._map[8 : 8 + n])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: bad safetensors header: {e}") from None
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries: dict[str, dict] = header
        for name, e in header.items():
            start, end = e["data_offsets"]
            if self._base + end > len(self._map):
                raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']}")
        start, end = e["data_offsets"]
        shape = tuple(e["shape"])
        if start == end:
            return torch.empty(shape, dtype=dtype)
        # frombuffer warns on read-only buffers; the tensors are never written (loaders copy before mutating).
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize,
                                    offset=self._base + start)
        return flat.view(shape)


class SafetensorsCheckpoint:
    """All *.safetensors of a HF model directory, indexed by tensor name."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no *.safetensors files (and no model.safetensors.index.json)")
        self.files = []
        self.where: dict[str, SafetensorsFile] = {}
        for name in files:
            path = model_dir / name
            if not path.is_file():
                raise CheckpointError(f"{index}: names shard {name}, which is missing")
            f = SafetensorsFile(path)
            self.files.append(f)
            for key in f.entries:
                self.where[key] = f

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        return self.where[name].get(name)

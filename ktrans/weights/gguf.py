"""Memory-mapped reading of GGUF files (llama.cpp's model format), split files included.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each
metadata entry is (key string, value type u32, value); each tensor info is (name string, n_dims u32,
ne[n_dims] u64 innermost first, ggml type u32, offset u64); then, at the next multiple of `general.alignment`
(default 32), the tensor data, each tensor at its offset. Strings are a u64 byte count then UTF-8.

Shapes here are in numpy/torch order (ne reversed): a weight with ne = {n_embd, n_ff} has shape [n_ff, n_embd],
the same as the torch Linear weight, and a stacked expert tensor is [n_expert, rows, cols].

Nothing here copies tensor data: `raw()` is a uint8 numpy view of the mapped file. A split model
(`name-00001-of-00003.gguf`, as llama-gguf-split writes it) is opened from its first shard: metadata comes from
that shard, tensors from all of them. Every error names the file and the key or tensor.
"""
from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ktrans.weights.quants import UnsupportedQuantError, quant_type, tensor_nbytes
from ktrans.weights.safetensors_mmap import CheckpointError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SPLIT_COUNT_KEY = "split.count"
SPLIT_NO_KEY = "split.no"
SPLIT_TENSORS_KEY = "split.tensors.count"


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read or does not hold what is asked for; the message names file and key/tensor."""


# value type id -> (name, struct format) for the fixed-size scalar types
SCALAR_TYPES = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
    12: ("FLOAT64", "<d"),
}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_NUMPY_OF = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
             12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: ne reversed
    ggml_type: int
    offset: int  # absolute byte offset in its file
    nbytes: int | None  # None when the ggml type is unknown to ktrans
    path: Path

    @property
    def type_name(self) -> str:
        try:
            return quant_type(self.ggml_type).name
        except UnsupportedQuantError:
            return f"type {self.ggml_type}"


class _Cursor:
    """Reads little-endian fields from the map; running off the end is a 'truncated' error naming `what`."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            self.truncated(what)

    def truncated(self, what: str):
        raise GGUFError(f"{self.path}: file ends inside {what} (at byte {self.pos} of {len(self.buf)}): "
                        f"the file is truncated")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8: {e}") from None

    def strings(self, count: int, what: str) -> list[str]:
        # the hot loop of a 150k-token vocabulary: no per-item method calls
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    break
                out.append(buf[pos:pos + n].decode("utf-8"))
                pos += n
        except struct.error:
            pass
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what}[{len(out)}] is not valid UTF-8: {e}") from None
        self.pos = pos
        if len(out) < count:
            self.truncated(f"{what}[{len(out)}]")
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype in SCALAR_TYPES:
            v = self.scalar(SCALAR_TYPES[vtype][1], what)
            # f32 values come back as the shortest decimal that rounds to them (1e-06, not 9.99999997e-07)
            return float(str(np.float32(v))) if vtype == 6 else v
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            etype = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if etype == STRING:
                return self.strings(count, what)
            if etype in _NUMPY_OF:
                dt = np.dtype(_NUMPY_OF[etype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return [bool(x) for x in arr] if etype == 7 else arr.tolist()
            if etype == ARRAY:
                return [self.value(ARRAY, f"{what}[{i}]") for i in range(count)]
            raise GGUFError(f"{self.path}: {what} is an array of unknown value type {etype}")
        raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}")


class GGUFFile:
    """One .gguf file: its metadata and tensor table, and zero-copy views of its tensor data."""

    def __init__(self, path: str | Path):
        self.path = path = Path(path)
        if not path.is_file():
            raise GGUFError(f"{path}: no such file")
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise GGUFError(f"{path}: empty file") from None
        cur = _Cursor(self._map, path)
        cur.need(4, "the header")
        magic = bytes(self._map[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.scalar("<I", "the header")
        if self.version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {self.version} is not supported (2 and 3 are; big-endian "
                            f"files read as a huge version number)")
        n_tensors = cur.scalar("<Q", "the header")
        n_kv = cur.scalar("<Q", "the header")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, int] = {}
        key = None
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}" + (f" (the one after {key!r})" if key else ""))
            vtype = cur.scalar("<I", f"metadata {key!r}")
            self.value_types[key] = vtype
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor info #{i}")
            n_dims = cur.scalar("<I", f"tensor info {name!r}")
            if n_dims > 4:
                raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions (ggml allows at most 4)")
            ne = [cur.scalar("<Q", f"tensor info {name!r}") for _ in range(n_dims)]
            ggml_type = cur.scalar("<I", f"tensor info {name!r}")
            offset = cur.scalar("<Q", f"tensor info {name!r}")
            infos.append((name, tuple(reversed(ne)), ggml_type, offset))

        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{path}: tensor {name!r} appears twice")
            try:
                nbytes = tensor_nbytes(ggml_type, shape) if shape else quant_type(ggml_type).type_size
            except UnsupportedQuantError:
                nbytes = None  # refused when it is read, naming the tensor
            except ValueError as e:
                raise GGUFError(f"{path}: tensor {name!r}: {e}") from None
            info = TensorInfo(name, shape, ggml_type, self.data_offset + offset, nbytes, path)
            end = info.offset + (nbytes or 0)
            if end > len(self._map):
                raise GGUFError(f"{path}: tensor {name!r} ({info.type_name} {list(shape)}) runs past the end of the "
                                f"file ({end} > {len(self._map)} bytes): the file is truncated")
            self.tensors[name] = info

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map."""
        if info.nbytes is None:
            quant_type(info.ggml_type)  # raises UnsupportedQuantError naming the type
        return np.frombuffer(self._map, np.uint8, count=info.nbytes, offset=info.offset)


_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: str | Path) -> list[Path]:
    """All shards of a split model given its first shard (llama.cpp's `-00001-of-0000N.gguf` naming), else [path]."""
    path = Path(path)
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    if no != 1:
        raise GGUFError(f"{path}: this is shard {no} of {count}; pass the first shard (-00001-of-{count:05d}.gguf)")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: split model is missing shard(s) {', '.join(missing)}")
    return paths


class GGUFModelFile:
    """A GGUF model, maybe split across shards: metadata from the first shard, tensors from all."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files = [GGUFFile(p) for p in split_paths(path)]
        self.metadata = self.files[0].metadata
        declared = int(self.metadata.get(SPLIT_COUNT_KEY, 1))
        if declared != len(self.files):
            raise GGUFError(f"{self.path}: metadata says the model is split in {declared} files, but "
                            f"{len(self.files)} were found (name split files like llama-gguf-split does)")
        self.tensors: dict[str, TensorInfo] = {}
        self._file_of: dict[str, GGUFFile] = {}
        for f in self.files:
            for name, info in f.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{f.path}: tensor {name!r} is also in {self.tensors[name].path.name}")
                self.tensors[name] = info
                self._file_of[name] = f
        want = self.metadata.get(SPLIT_TENSORS_KEY)
        if want is not None and int(want) != len(self.tensors):
            raise GGUFError(f"{self.path}: metadata {SPLIT_TENSORS_KEY} is {want} but the shards hold "
                            f"{len(self.tensors)} tensors")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """Bytes of tensor `name` as a read-only uint8 view, shaped [*shape[:-1], row_bytes]."""
        info = self.info(name)
        try:
            data = self._file_of[name].raw(info)
        except UnsupportedQuantError as e:
            raise GGUFError(f"{info.path}: tensor {name!r}: {e}") from None
        if not info.shape:
            return data
        return data.reshape(*info.shape[:-1], -1)

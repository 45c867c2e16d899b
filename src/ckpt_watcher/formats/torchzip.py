"""Read the tensors of a `torch.save` file without running its pickle's code, one tensor at a
time: a restricted unpickler and the zip's stored members, never `torch.load`.

A `torch.save` file is a zip: `<archive>/data.pkl` (the pickled object, whose tensors point at
storages by key) and one stored (uncompressed) member `<archive>/data/<key>` per storage.
`read_index` unpickles `data.pkl` with `Unpickler.find_class` limited to what a state dict of
plain tensors and DTensors is made of; anything else (a function or class that could run code)
is refused with its name. A tensor becomes a `LazyTensor` (its storage's key, offset, shape and
stride); a DTensor becomes a `Sharded` (its local `LazyTensor`, its placements and the global
shape its spec records). The device mesh is kept as an inert record and never read (its pickled
form changed across torch versions). `LazyTensor.read` then reads just that tensor's bytes with
one positioned read, and `LazyTensor.blocks` reads them a block at a time, so memory holds a
tensor, or a block of one, never the file.

The file is the trainer's, or anyone's who could write beside it, so nothing it declares is
trusted: pickle's BUILD (which would write a record's fields behind a frozen dataclass's back,
e.g. point a tensor at another file) is refused on everything but the inert records; every
tensor's shape, stride and offset must be whole numbers, and the bytes they span must lie inside
its own storage (its zip member, or the span its safetensors header gives) before anything is
read or allocated.

`read_embedded` reads an archive that lies inside a bigger file (a distributed checkpoint's
data files are such archives end to end), and `read_pickle` a plain pickle (its `.metadata`),
with the same restrictions.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import re
import reprlib
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ckpt_watcher.errors import NativeFormatError

MAX_PICKLE = 256 << 20  # a rank file's pickle: its tensors' records, not their bytes
MAX_WINDOW_READ = 512 << 20  # what reading a zip's directory and pickle may take in all
MAX_DIMS = 64
_STORAGE_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")  # torch names them 0, 1, ...
MAX_EXTENT = 1 << 48  # an element count, stride or offset past this is no tensor of a model
EOCD = b"PK\x05\x06"  # a zip's end of central directory record: the last thing torch.save writes
EOCD_SIZE = 22
# the storage types torch.save names (its legacy typed storages) -> the dtype's name in torch
_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
}
_ITEM_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
_DTYPES = set(_ITEM_BYTES)
# DTensor's own names, across torch versions
_DTENSOR = {
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed._tensor", "DTensor"),
    ("torch.distributed._tensor.api", "DTensor"),
}


def zip_whole(tail: bytes) -> bool:
    """Whether the last `EOCD_SIZE` bytes of a file are a zip's end record: torch.save has
    finished it (the record is written last, and torch writes no zip comment)."""
    return len(tail) == EOCD_SIZE and tail.startswith(EOCD)


@dataclass(frozen=True)
class LazyTensor:
    """A tensor in a torch.save file (or a safetensors file), not yet read."""

    path: Path
    member: str  # the zip member holding its storage ("": `at` says where it is)
    dtype: str  # torch's name of its dtype
    offset: int  # in elements, into its storage
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    at: int = 0  # where its storage begins in the file, when it is no zip member (safetensors)
    storage_bytes: int | None = None  # its storage's size from `at` (a zip member's: read there)

    def __post_init__(self) -> None:
        dims = (self.offset, *self.shape, *self.stride)
        if (
            self.dtype not in _DTYPES
            or len(self.shape) != len(self.stride)
            or len(self.shape) > MAX_DIMS
            or not all(type(n) is int and 0 <= n < MAX_EXTENT for n in dims)
            or (not self.member and (self.storage_bytes is None or self.storage_bytes < 0))
            # elements that share storage (a stride 0, overlapping strides): a file of a few
            # bytes read as a tensor of any size; torch.save writes none in a state dict
            or (self.numel > 0 and self.numel > self.span)
        ):
            raise NativeFormatError(
                f"{self.path.name}: a tensor declared as {self.dtype} {_short(self.shape)} "
                f"(stride {_short(self.stride)}, offset {_short(self.offset)}) in "
                f"{self.member or 'its file'}: not a tensor a state dict holds"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """The elements of its storage it reaches, from its offset on."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))

    @property
    def contiguous(self) -> bool:
        return self.stride == _contiguous(self.shape)

    def read(self) -> Any:
        """The tensor (a fresh CPU tensor of its own): one positioned read of its bytes."""
        import torch

        dtype = getattr(torch, self.dtype)
        if self.numel == 0:
            return torch.empty(self.shape, dtype=dtype)
        with open(self.path, "rb") as f:
            begins = self._storage(f)
            buf = torch.empty(self.span, dtype=dtype)
            self._read_into(f, buf, 0, begins)
        if self.contiguous:
            return buf.view(self.shape)
        return buf.as_strided(self.shape, self.stride).contiguous()

    def blocks(self, max_bytes: int) -> Iterator[Any]:
        """A contiguous tensor's elements in order, as 1-D tensors of at most `max_bytes`:
        memory holds one block, not the tensor."""
        import torch

        dtype = getattr(torch, self.dtype)
        step = max(1, max_bytes // _ITEM_BYTES[self.dtype])
        with open(self.path, "rb") as f:
            begins = self._storage(f)
            for at in range(0, self.numel, step):
                buf = torch.empty(min(step, self.numel - at), dtype=dtype)
                self._read_into(f, buf, at, begins)
                yield buf

    def _storage(self, f: Any) -> int:
        """Where its storage begins in the open file `f`, once the elements the tensor declares
        are known to lie inside that storage (else NativeFormatError, before any allocation)."""
        if self.member:
            begins, size = _member_span(f, self.member)
        else:
            begins, size = self.at, self.storage_bytes or 0
        needed = (self.offset + self.span) * _ITEM_BYTES[self.dtype] if self.numel else 0
        if needed > size:
            raise NativeFormatError(
                f"{self.path.name}: a {self.dtype} tensor of shape {list(self.shape)} at offset "
                f"{self.offset} needs {needed} bytes of its storage"
                f"{' ' + self.member if self.member else ''}, which has {size}: a damaged or "
                "crafted file; not read"
            )
        return begins

    def _read_into(self, f: Any, buf: Any, at: int, begins: int) -> None:
        """Read `buf`'s worth of this tensor's storage (which begins at `begins` in `f`), from
        its element `at` on."""
        import torch

        raw = buf.view(torch.uint8)
        start = begins + (self.offset + at) * buf.element_size()
        f.seek(start)
        got = f.readinto(cast(Any, raw.numpy()))
        if got != raw.numel():
            raise NativeFormatError(
                f"{self.path.name}: {self.member} ends after {got} of {raw.numel()} bytes "
                "(truncated file)"
            )


@dataclass(frozen=True)
class Placement:
    """A DTensor placement as saved: `Shard` (with its dim), `Replicate`, or another kind."""

    kind: str
    dim: int | None = None


@dataclass(frozen=True)
class Sharded:
    """A DTensor as saved: this rank's piece, how it is placed, and the whole tensor's shape."""

    local: LazyTensor
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]


def read_index(path: Path, window: _Window | None = None) -> dict[str, Any]:
    """The state dict saved in `path` (or read through `window`, that file's bytes): key ->
    `LazyTensor` or `Sharded` (other values as saved: numbers, strings, None). Raises
    NativeFormatError for a file that is not a whole torch.save zip of tensors."""
    loaded = _load(path, window if window is not None else path)
    if not isinstance(loaded, dict):
        raise NativeFormatError(f"{path.name}: holds a {type(loaded).__name__}, not a state dict")
    if not all(isinstance(k, str) for k in loaded):
        raise NativeFormatError(f"{path.name}: a state dict whose keys are not all names")
    return dict(loaded)


def read_index_at(name: str, size: int, read_at: Callable[[int, int], bytes]) -> dict[str, Any]:
    """`read_index` of a file read only in ranges (`read_at(start, length)`: a local file or an
    S3 object): its zip directory and pickle, never its tensors' bytes. What a completeness check
    uses to read a rank file's few fields, however large the file."""
    return read_index(Path(name), window=_Window(read_at, 0, size))


def read_embedded(path: Path, start: int, length: int) -> Any:
    """What the torch.save archive at `start` (`length` bytes) of `path` holds, its tensors as
    `LazyTensor`s that say where their bytes lie in `path` (a torch distributed checkpoint's
    data file is such archives end to end, one per tensor piece). Only the archive's directory
    and pickle are read."""
    with open(path, "rb") as f:
        window = _Window(_positioned(f), start, length)
        loaded = _load(path, window)
        return _placed(loaded, window)


def read_pickle(name: str, data: bytes) -> Any:
    """A plain pickle (a distributed checkpoint's `.metadata`) read as `read_index` reads one:
    torch's distributed classes become inert records, anything that could run code is refused."""
    return _unpickle(io.BytesIO(data), Path(name), "")


def _load(path: Path, source: Any) -> Any:
    try:
        with zipfile.ZipFile(source) as zf:
            names = zf.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl")), None)
            if pkl is None:
                raise NativeFormatError(f"{path.name}: no data.pkl: not a torch.save file")
            archive = pkl[: -len("data.pkl")]
            for member in (pkl, f"{archive}byteorder"):
                if member in names:  # torch stores them; anything else is not its file
                    info = zf.getinfo(member)
                    if info.compress_type != zipfile.ZIP_STORED or info.file_size > MAX_PICKLE:
                        raise NativeFormatError(
                            f"{path.name}: {member} compressed, or of {info.file_size} bytes: "
                            "not a torch.save file"
                        )
            order = (
                zf.read(f"{archive}byteorder").decode()
                if f"{archive}byteorder" in names
                else "little"
            )
            if order.strip() != "little":
                raise NativeFormatError(f"{path.name}: saved {_short(order)}-endian; not read")
            raw = zf.read(pkl)
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, EOFError) as e:
        raise NativeFormatError(f"{path.name}: not a whole torch.save file ({e})") from None
    return _unpickle(io.BytesIO(raw), path, archive)


def _unpickle(raw: io.BytesIO, path: Path, archive: str) -> Any:
    try:
        return _Unpickler(raw, path, archive).load()
    except NativeFormatError:
        raise
    except Exception as e:  # a damaged pickle fails in any of pickle's own ways
        raise NativeFormatError(f"{path.name}: not a readable pickle ({e})") from None


def _positioned(f: Any) -> Callable[[int, int], bytes]:
    """Reads of an open file at a position."""

    def read_at(start: int, length: int) -> bytes:
        f.seek(start)
        return cast(bytes, f.read(length))

    return read_at


class _Window(io.RawIOBase):
    """`length` bytes from `start` on of what `read_at(start, length)` reads (an open file, an
    S3 object), as a file of their own (for zipfile)."""

    def __init__(self, read_at: Callable[[int, int], bytes], start: int, length: int) -> None:
        super().__init__()
        self.read_at, self.start, self.length, self.pos = read_at, start, length, 0
        self.given = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.length - self.pos)
        size = left if size is None or size < 0 else min(size, left)
        self.given += size
        if self.given > MAX_WINDOW_READ:  # a directory that claims gigabytes
            raise NativeFormatError(
                f"reading its zip directory and pickle took over {MAX_WINDOW_READ} bytes"
            )
        data = self.read_at(self.start + self.pos, size) if size else b""
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _placed(loaded: Any, window: _Window) -> Any:
    """`loaded`'s LazyTensors (one, or a dict's values) told where their bytes lie in the file
    the window is of, by absolute position (`at`) rather than by zip member."""
    members: dict[str, tuple[int, int]] = {}

    def place(t: Any) -> Any:
        if not isinstance(t, LazyTensor) or not t.member:
            return t
        if t.member not in members:
            begins, size = _member_span(window, t.member)
            members[t.member] = (window.start + begins, size)
        at, size = members[t.member]
        return LazyTensor(t.path, "", t.dtype, t.offset, t.shape, t.stride, at, size)

    if isinstance(loaded, dict):
        return {k: place(v) for k, v in loaded.items()}
    return place(loaded)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _member_span(f: Any, member: str) -> tuple[int, int]:
    """Where a stored zip member's bytes begin in the open file `f`, and how many there are."""
    f.seek(0)
    try:
        info = zipfile.ZipFile(f).getinfo(member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise NativeFormatError(f"{member}: no such storage in the archive ({e})") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise NativeFormatError(f"{member}: compressed; torch.save stores its tensors")
    f.seek(info.header_offset)
    header = f.read(30)
    if header[:4] != b"PK\x03\x04":
        raise NativeFormatError(f"{member}: no zip entry where the directory says")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return int(info.header_offset) + 30 + name_len + extra_len, int(info.file_size)


class _Record:
    """An inert stand-in for a distributed class in the pickle (DTensorSpec, DeviceMesh,
    placements, TensorMeta...): it keeps what it was given and runs nothing."""

    kind = ""
    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:  # pickle's NEWOBJ and REDUCE
        made = super().__new__(cls)
        made.args, made.state = args, {}
        return made

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {"value": state}


class _DTensorMark:
    """What the pickle calls DTensor: a type only, never built."""


class _TensorMark:
    """torch.Tensor as a rebuilt tensor's type (DeepSpeed's flat groups): a type only."""


def _flat_key(key: Any) -> bool:
    scalar = (str, int, float, bool, bytes, type(None))
    return (
        isinstance(key, (*scalar, _Record))
        or isinstance(key, tuple)
        and len(key) <= 64
        and all(isinstance(k, scalar) for k in key)
    )


def _check_keys(path: Path, keys: Any) -> None:
    for key in keys:
        if not _flat_key(key):
            raise NativeFormatError(
                f"{path.name}: a key or set item of type {type(key).__name__} nested past what a "
                "state dict holds; not loaded"
            )


def _set(items: Any = ()) -> set:
    items = list(items)
    _check_keys(Path("pickle"), items)
    return set(items)


def _frozenset(items: Any = ()) -> frozenset:
    return frozenset(_set(items))


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    pairs = list(args[0]) if args else []
    _check_keys(Path("pickle"), [p[0] if isinstance(p, tuple) and p else p for p in pairs])
    return collections.OrderedDict(pairs)


_BUILTINS = {
    ("builtins", n): t for n, t in (("set", _set), ("frozenset", _frozenset), ("slice", slice))
}


_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


def _record_class(name: str) -> type:
    return type(name, (_Record,), {"kind": name})


_STORAGE = collections.namedtuple("_STORAGE", "dtype")


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> LazyTensor:
    if not isinstance(storage, _StorageRef):
        raise NativeFormatError("a tensor without a saved storage")
    if not (_ints(size) and _ints(stride)):
        raise NativeFormatError(f"a tensor of shape {_short(size)}, stride {_short(stride)}")
    return LazyTensor(
        storage.path, storage.member, storage.dtype, offset, tuple(size), tuple(stride)
    )


def _ints(value: Any) -> bool:
    """A shape or stride as torch.save writes one: a tuple (or torch.Size) of ints."""
    return isinstance(value, tuple) and all(type(n) is int for n in value)


def _short(value: Any) -> str:
    """A value from the file, shown whole only if small (a crafted one may be nested deep)."""
    return reprlib.repr(value)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    made = func(*args)
    if new_type is _DTensorMark:
        return _dtensor(state)
    return made


def _rebuild_wrapper_subclass(*_: Any) -> None:
    return None  # the DTensor's outer shell: its state carries what matters


@dataclass(frozen=True)
class _StorageRef:
    path: Path
    member: str
    dtype: str


def _dtensor(state: Any) -> Sharded:
    if isinstance(state, tuple):  # (its __dict__, its __slots__' values): DTensor has slots
        state = {**(state[0] or {}), **(state[1] if len(state) > 1 and state[1] else {})}
    if not isinstance(state, dict):
        raise NativeFormatError("a DTensor saved without its state")
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, LazyTensor) or not isinstance(spec, _Record):
        raise NativeFormatError("a DTensor without its local tensor or spec")
    placements = tuple(_placement(p) for p in spec.state.get("placements", ()))
    meta = spec.state.get("tensor_meta")
    shape = meta.args[0] if isinstance(meta, _Record) and meta.args else meta[0] if meta else None
    if shape is None:
        raise NativeFormatError("a DTensor whose spec records no global shape")
    return Sharded(local, placements, tuple(int(n) for n in shape))


def _placement(p: Any) -> Placement:
    if not isinstance(p, _Record):
        return Placement(type(p).__name__)
    dim = p.state.get("dim", p.args[0] if p.args else None)
    return Placement(p.kind, int(dim) if isinstance(dim, int) else None)


# pickle's own Python unpickler: its opcodes can be overridden (the C one's cannot)
_PythonUnpickler: Any = getattr(pickle, "_Unpickler")  # noqa: B009


class _Unpickler(_PythonUnpickler):
    """The globals limited to `find_class`'s, BUILD limited to inert records."""

    dispatch: dict[int, Any] = dict(_PythonUnpickler.dispatch)

    def __init__(self, file: io.BytesIO, path: Path, archive: str) -> None:
        super().__init__(file)
        self.path, self.archive = path, archive
        self.records: dict[str, type] = {}

    def load_build(self) -> None:
        """BUILD sets an object's state: allowed on the inert records (they keep it as data),
        dropped for a state dict's OrderedDict (its `_metadata`, module versions no conversion
        needs), refused on anything else (a tensor's record, a storage, a class, a dtype)."""
        state = self.stack.pop()
        made = self.stack[-1]
        if isinstance(made, _Record):
            made.__setstate__(state)
        elif type(made) is not collections.OrderedDict:
            raise NativeFormatError(
                f"{self.path.name}: its pickle sets the state of a {type(made).__name__}, which "
                "torch.save never does: a crafted file; not loaded"
            )

    dispatch[pickle.BUILD[0]] = load_build

    # what may be a dict's key or a set's item: hashing a tuple nested a million deep (a few
    # bytes a level) recurses in C with no guard and crashes the process, and shared subtuples
    # make it exponential. A state dict's keys, and a distributed checkpoint's, are names,
    # numbers and inert records (flat tuples of those at most).
    def load_setitem(self) -> None:
        _check_keys(self.path, [self.stack[-2]])
        super().load_setitem()

    def load_setitems(self) -> None:
        _check_keys(self.path, self.stack[0::2])  # (the items since the mark: key, value...)
        super().load_setitems()

    def load_dict(self) -> None:
        _check_keys(self.path, self.stack[0::2])
        super().load_dict()

    def load_additems(self) -> None:
        _check_keys(self.path, self.stack)
        super().load_additems()

    def load_frozenset(self) -> None:
        _check_keys(self.path, self.stack)
        super().load_frozenset()

    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 3):
            raise NativeFormatError(
                f"{self.path.name}: an unknown persistent reference {_short(pid)}"
            )
        kind, key = pid[1], pid[2]
        dtype = kind.dtype if isinstance(kind, _STORAGE) else None
        if dtype is None or not (isinstance(key, str) and _STORAGE_KEY.fullmatch(key)):
            raise NativeFormatError(
                f"{self.path.name}: a storage of unknown type or key {_short(kind)}, {_short(key)}"
            )
        return _StorageRef(self.path, f"{self.archive}data/{key}", dtype)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return _ordered_dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPES:
            import torch

            return getattr(torch, name)
        if (module, name) in {("torch", "Size"), ("torch", "device")}:
            import torch

            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda _name: None
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor_v2
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if (module, name) == ("torch._utils", "_rebuild_wrapper_subclass"):
            return _rebuild_wrapper_subclass
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type_v2
        if (module, name) in _DTENSOR:
            return _DTensorMark
        if (module, name) == ("torch", "Tensor"):
            return _TensorMark
        if (module, name) in _BUILTINS:
            return _BUILTINS[module, name]
        if module == "pathlib" and name in _PATHS:  # where a distributed checkpoint was saved
            return self.records.setdefault(f"{module}.{name}", _record_class(name))
        # specs, meshes, placements; DeepSpeed's loss scaler and stage enum: inert records
        if module.startswith(("torch.distributed.", "deepspeed.")):
            return self.records.setdefault(f"{module}.{name}", _record_class(name))
        raise NativeFormatError(
            f"{self.path.name}: holds a {module}.{name}, which a file of weights has no need "
            "of; not loaded (only tensors and DTensors are read)"
        )

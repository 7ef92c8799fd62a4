"""Reading a zero_py checkpoint: the manifest, its checks against the files, and element
ranges of any parameter (load_checkpoint, consolidate and inspect all read through here).

Checkpoint.open reads manifest.json and every rank file's header (a few KB each) and refuses
a checkpoint whose format, version, file sizes, file headers or save identity disagree with the
manifest, naming the file and what is wrong. stage(kind, name, lo, hi) plans a read of elements
[lo, hi) of one parameter's values ("param"), fp32 master ("master") or per-element state
("state/<key>"): a tensor and the file segments that fill it. verify(files, segments) reads
those files whole, in order, checks their CRC-32C and fills the planned segments they hold
straight from that read (load_checkpoint shares the files out, one reader per file); fill()
reads the segments left with pread. read_into() does both at once for one range
(consolidate). Files are read with pread and read(), never mapped: mapped pages would count as
the reader's resident memory. Buffers and `extra` (small) go through the safetensors package.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from zero_py.checkpoint import plain
from zero_py.checkpoint.files import (ST_DTYPES, NotRegularFile, file_crc32c, parse_json,
                                      read_header, read_json_file)
from zero_py.checkpoint.validate import layout_problems
from zero_py.collectives.objects import gather_json

FORMAT = "zero_py-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_PROBLEMS_SHOWN = 20  # a damaged manifest's problems listed in its error
# the most rank files a manifest may list: its world size is checked against this before any
# per-rank list is built (a manifest saying 10**9 ranks made the reader build 10**9 file names)
_MAX_WORLD = 1 << 20


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank of the group."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def optimizer_of(model, optimizer):
    from zero_py.optim.optimizer import ZeroOptimizer  # the checkpoint sits above optim

    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError("zero_py checkpoints take the ZeroOptimizer of the model (what "
                        f"zero_py.initialize returned), got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be the nn.Module the optimizer trains, got "
                        f"{type(model).__name__}")
    return optimizer


def agree(executor, error: Optional[str], what: str, save_id: Optional[str] = None,
          call: Optional[str] = None) -> None:
    """Raises CheckpointError on every rank when any rank has an error (each rank's message,
    by rank), or when the ranks read different saves (`save_id`: the manifest's, where a rank
    read one; a save published to the path while they opened it), or made the call with other
    arguments (`call`: the arguments in words). Collective."""
    executor = getattr(executor, "world", executor)  # hybrid sharding: every replica
    got = gather_json(executor, [error, save_id, call], None)
    errors = [e for e, _, _ in got]
    if len({c for _, _, c in got}) > 1 and not any(errors):
        # e.g. async_save on some ranks only: those went on to make the save thread's groups
        # while the others waited in the write's collectives (a hang, past the group's
        # timeout under hybrid sharding); another path: the files went to rank 0's path
        raise CheckpointError(
            f"{what}: the ranks passed different arguments ("
            f"{'; '.join(f'rank {r}: {c}' for r, (_, _, c) in enumerate(got))}): every rank "
            "must make the same call, with the same path, keep_last and async_save; nothing "
            "was written")
    ids = {i for _, i, _ in got if i is not None}
    if len(ids) > 1 and not any(errors):
        raise CheckpointError(
            f"{what}: the ranks read different saves of the checkpoint (save ids "
            f"{', '.join(f'rank {r}: {i}' for r, (_, i, _) in enumerate(got))}): it was "
            "replaced while they opened it (or they were given different paths); load again")
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        if len(bad) == executor.world_size and all(e == bad[0][1] for _, e in bad):
            text = bad[0][1]  # every rank found the same
        else:
            text = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise CheckpointError(f"{what}: {text}")


class Checkpoint:
    """A checkpoint directory, its manifest checked against its files (see the module
    docstring)."""

    def __init__(self, path: str, manifest: dict, root: Optional[str] = None,
                 dirfd: Optional[int] = None):
        self.path = path  # as the user named it: for messages
        # where the files are opened: through a descriptor of the directory taken when it was
        # opened, so that every read comes from that directory even if a save publishes to the
        # path meanwhile (publish_dir swaps directories); `path` where there is no /proc
        self.root = root or path
        self._dirfd = dirfd
        self.manifest = manifest
        self.params: Dict[str, dict] = manifest["params"]
        self._handles: Dict[str, Any] = {}
        self._raws: Dict[str, _RawFile] = {}
        self._headers: Dict[str, Tuple[dict, int]] = {}  # file -> (header, data offset)
        self._sizes: Dict[str, int] = {}  # file -> bytes

    @classmethod
    def open(cls, path) -> "Checkpoint":
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist or "
                                  "is not a directory)")
        try:
            dirfd: Optional[int] = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be opened ({exc.strerror})") from None
        root = f"/proc/self/fd/{dirfd}"
        if not os.path.isdir(root):
            os.close(dirfd)
            dirfd, root = None, path
        try:
            ck = cls(path, cls._read_manifest(path, root), root, dirfd)
        except BaseException:
            if dirfd is not None:
                os.close(dirfd)
            raise
        try:
            ck._check_files()
            ck._check_layout()
        except BaseException:
            ck.close()
            raise
        return ck

    @staticmethod
    def _read_manifest(path: str, root: str) -> dict:
        mpath = os.path.join(path, MANIFEST)
        try:
            manifest = read_json_file(os.path.join(root, MANIFEST))
        except FileNotFoundError:
            raise CheckpointError(f"{path} has no {MANIFEST}: not a finished zero_py "
                                  "checkpoint") from None
        except NotRegularFile as exc:  # a link, a FIFO (whose open waits), /dev/zero
            raise CheckpointError(str(exc).replace(os.path.join(root, MANIFEST), mpath)) \
                from None
        except ValueError as exc:
            raise CheckpointError(f"{mpath} is damaged (not valid JSON: {exc})") from None
        except OSError as exc:
            raise CheckpointError(f"{mpath} cannot be read ({exc.strerror or exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{mpath} is not a zero_py checkpoint manifest")
        if manifest.get("version") != VERSION:
            raise CheckpointError(f"{mpath} has format version {manifest.get('version')!r}; "
                                  f"this zero_py reads version {VERSION}")
        # the fields every reader takes, of the types they take (a manifest edited by hand would
        # fail later with a bare KeyError or TypeError)
        for key, kinds in (("save_id", str), ("step", int), ("world_size", int),
                           ("stage", int), ("files", dict), ("params", dict),
                           ("buffers", dict), ("optimizer", dict),
                           ("loss_scaler", (dict, type(None)))):
            if key not in manifest:
                raise CheckpointError(f"{mpath} lacks {key!r}: it is damaged")
            if not isinstance(manifest[key], kinds) or isinstance(manifest[key], bool):
                raise CheckpointError(f"{mpath}: {key!r} is {manifest[key]!r}, not of the type "
                                      "the format gives it: the manifest is damaged")
        world = manifest["world_size"]
        if not 1 <= world <= _MAX_WORLD or len(manifest["files"]) != world:
            raise CheckpointError(f"{mpath}: 'world_size' is {world} and 'files' lists "
                                  f"{len(manifest['files'])} file(s): a checkpoint has one file "
                                  f"per rank of the saving run, 1 to {_MAX_WORLD}; the manifest "
                                  "is damaged")
        for name, info in manifest["files"].items():
            if not (isinstance(info, dict) and all(k in info for k in ("rank", "bytes",
                                                                       "crc32c"))):
                raise CheckpointError(f"{mpath}: the entry of file {name!r} lacks rank, bytes "
                                      "or crc32c: the manifest is damaged")
            field = f"files[{name!r}]"
            if not (_is_count(info["rank"]) and name == rank_file(info["rank"])):
                raise CheckpointError(f"{mpath}: {field}.rank is {info['rank']!r}, not the rank "
                                      "the file is named after: the manifest is damaged")
            if not _is_count(info["bytes"]):
                raise CheckpointError(f"{mpath}: {field}.bytes is {info['bytes']!r}, not a "
                                      "byte count: the manifest is damaged")
            if not (isinstance(info["crc32c"], str)
                    and re.fullmatch(r"[0-9a-f]{8}", info["crc32c"])):
                raise CheckpointError(f"{mpath}: {field}.crc32c is {info['crc32c']!r}, not 8 "
                                      "hex digits: the manifest is damaged")
            if not isinstance(info.get("extra", False), bool):
                raise CheckpointError(f"{mpath}: {field}.extra is {info['extra']!r}, not true "
                                      "or false: the manifest is damaged")
        return manifest

    def _at(self, name: str) -> str:
        """The path to open file `name` by (through the directory's descriptor)."""
        return os.path.join(self.root, name)

    def _shown(self, exc: BaseException) -> str:
        """An error's text with the file named by the checkpoint's path, not the descriptor's."""
        return str(exc).replace(self.root, self.path)

    def _check_files(self) -> None:
        man = self.manifest
        sid = man["save_id"]
        if sorted(man["files"]) != [rank_file(r) for r in range(man["world_size"])]:
            raise CheckpointError(f"{self.path}: the manifest lists files "
                                  f"{sorted(man['files'])}, not one per rank of "
                                  f"{man['world_size']}")
        for name, info in man["files"].items():
            fpath = os.path.join(self.path, name)
            if os.path.islink(self._at(name)):
                raise CheckpointError(f"{fpath} is a symbolic link; the files of a checkpoint "
                                      "are regular files in its directory (copy the file there "
                                      "instead of linking it)")
            if not os.path.lexists(self._at(name)):
                raise CheckpointError(f"{fpath} is missing")
            if not os.path.isfile(self._at(name)):
                raise CheckpointError(f"{fpath} is not a regular file (a FIFO, socket, device "
                                      "or directory), which a checkpoint never holds")
            size = self._sizes[name] = os.path.getsize(self._at(name))
            try:
                self._headers[name] = read_header(self._at(name))  # read once: _raw() takes it
                meta = self._headers[name][0].get("__metadata__") or {}
            except ValueError as exc:
                raise CheckpointError(f"{self._shown(exc)}: the file is truncated or "
                                      "damaged") from None
            # which save a file belongs to first: a file of another save has another size too
            if meta.get("format") != FORMAT or meta.get("save_id") != sid:
                raise CheckpointError(
                    f"{fpath} belongs to another save (step {meta.get('step')!r}, save id "
                    f"{meta.get('save_id')!r}) than {MANIFEST} (step {man['step']}, save id "
                    f"{sid!r}): the checkpoint mixes files of different saves")
            if size != info["bytes"]:
                raise CheckpointError(f"{fpath} is {size} bytes, the manifest says "
                                      f"{info['bytes']}: the file is truncated or damaged")
            if meta.get("rank") != str(info["rank"]) or meta.get("step") != str(man["step"]):
                raise CheckpointError(f"{fpath} says rank {meta.get('rank')} step "
                                      f"{meta.get('step')}, the manifest rank {info['rank']} "
                                      f"step {man['step']}")

    def _check_layout(self) -> None:
        """The manifest's parameters, buffers and pieces against themselves and the files'
        headers (validate.py): every problem, each naming its file and field."""
        problems = layout_problems(self.manifest, self._headers, self._sizes, self.path,
                                   MANIFEST)
        if problems:
            shown = problems[:_PROBLEMS_SHOWN]
            more = len(problems) - len(shown)
            raise CheckpointError(
                f"{self.path} is damaged: its manifest does not describe its files "
                f"({len(problems)} problem(s)):\n  " + "\n  ".join(shown)
                + (f"\n  ... and {more} more" if more else ""))

    def verify(self, names: Optional[List[str]] = None,
               segments: Sequence["Segment"] = (), check: bool = True) -> None:
        """Reads the files `names` (default: all) whole and checks their CRC-32C (unless
        check=False: then the read only fills). The `segments` (from stage()) of those files
        are filled from the same read; their bytes count only once the call returns (every
        file's checksum held)."""
        by_file: Dict[str, List[Segment]] = {}
        for seg in segments:
            by_file.setdefault(seg.file, []).append(seg)
        for name in self.manifest["files"] if names is None else names:
            info = self.manifest["files"][name]
            fpath = os.path.join(self.path, name)
            segs, end = [], -1  # disjoint, in file order; an overlapping one is read later
            for seg in sorted(by_file.get(name, ()), key=lambda x: x.fb):
                if seg.fb >= end and seg.fe > seg.fb:
                    segs.append(seg)
                    end = seg.fe
            if not check and not segs:
                continue
            try:
                crc = f"{file_crc32c(self._at(name), [(g.fb, g.fe, g.dst) for g in segs]):08x}"
            except OSError as exc:
                raise CheckpointError(self._shown(exc)) from None
            if check and crc != info["crc32c"]:
                raise CheckpointError(f"{fpath} is damaged: its CRC-32C is {crc}, the manifest "
                                      f"says {info['crc32c']}")
            for seg in segs:
                seg.got = seg.fe - seg.fb

    def stage(self, kind: str, name: str, lo: int, hi: int,
              out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, List["Segment"]]:
        """A tensor for elements [lo, hi) of parameter `name`'s `kind`, in the dtype they are
        stored in, and the segments of the files that fill it (verify() or fill() does). `out`
        (1-D, contiguous, CPU) is used when it has that dtype; else a new tensor is made, which
        the caller copies (casting) where it belongs."""
        key = f"{kind}/{name}"
        pieces = [(r, plo, phi) for r, plo, phi in self.params[name]["pieces"]
                  if max(lo, plo) < min(hi, phi)]
        dtype = None
        for r, plo, phi in pieces:
            dtype = self._raw(r).dtype_of(key, phi - plo)
        if dtype is None:
            dtype = out.dtype if out is not None else torch.float32
        if out is not None and out.dtype == dtype and out.device.type == "cpu" \
                and out.is_contiguous():
            t = out
        else:
            t = torch.empty(hi - lo, dtype=dtype)
        view = memoryview(t.view(torch.uint8).numpy()) if hi > lo else memoryview(b"")
        size = dtype.itemsize
        segments, done = [], 0
        for r, plo, phi in pieces:
            a, z = max(lo, plo), min(hi, phi)
            raw = self._raw(r)
            begin = raw.data_start + raw.header[key]["data_offsets"][0]
            segments.append(Segment(rank_file(r), begin + (a - plo) * size,
                                    begin + (z - plo) * size,
                                    view[(a - lo) * size:(z - lo) * size]))
            done += z - a
        if done != hi - lo:
            raise CheckpointError(f"{self.path}: the files hold {done} of elements [{lo}, {hi}) "
                                  f"of {key}")
        return t, segments

    def value_kind(self, name: str, dtype: torch.dtype) -> str:
        """Where the values a parameter of `dtype` gets are: its saved values ("param"), or its
        fp32 master ("master") when it was saved in another dtype with one (the master is then
        the exact value the saved parameter was rounded from)."""
        entry = self.params[name]
        same = entry["dtype"] == plain.dtype_name(dtype)
        return "param" if same or not entry.get("master") else "master"

    def fill(self, segments: Sequence["Segment"]) -> None:
        """Reads the segments verify() did not fill, each from its file."""
        for seg in segments:
            if seg.got == seg.fe - seg.fb:
                continue
            fd = self._raws[seg.file].fd
            at = seg.got
            while at < seg.fe - seg.fb:
                n = os.preadv(fd, [seg.dst[at:]], seg.fb + at)
                if n <= 0:
                    raise CheckpointError(f"{os.path.join(self.path, seg.file)} ended early: "
                                          "it is truncated")
                at += n
            seg.got = at

    # -- reading ------------------------------------------------------------------------------

    def _handle(self, rank: int):
        """safe_open of rank `rank`'s file (for buffers and extra: small tensors)."""
        name = rank_file(rank)
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = safe_open(self._at(name), framework="pt",
                                                device="cpu")
        return h

    def _raw(self, rank: int) -> _RawFile:
        name = rank_file(rank)
        f = self._raws.get(name)
        if f is None:
            f = self._raws[name] = _RawFile(self._at(name), os.path.join(self.path, name),
                                            *self._headers[name])
        return f

    def read_into(self, kind: str, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of parameter `name`'s `kind` into the 1-D tensor `out` (cast to
        its dtype and device), from every file that holds a part of them."""
        t, segments = self.stage(kind, name, lo, hi, out)
        self.fill(segments)
        if t is not out:
            out.copy_(t)

    def buffer(self, name: str) -> torch.Tensor:
        return self._handle(0).get_tensor(f"buffer/{name}")

    def tensor(self, rank: int, key: str) -> torch.Tensor:
        """Tensor `key` of rank `rank`'s file, whole (small ones: feedback.py's)."""
        try:
            return self._handle(rank).get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
            raise CheckpointError(f"{os.path.join(self.path, rank_file(rank))} lacks tensor "
                                  f"{key} that the manifest places there ({exc})") from None

    def extra(self, rank: int) -> Any:
        """The `extra` that rank `rank` saved (None when it saved none)."""
        if not self.manifest["files"][rank_file(rank)].get("extra"):
            return None
        fpath = os.path.join(self.path, rank_file(rank))
        h = self._handle(rank)

        def tensor(key: Any) -> torch.Tensor:
            if not (isinstance(key, str) and key.startswith("extra/")):
                raise ValueError(f"{key!r} is not a tensor of 'extra' (extra/<k>)")
            return h.get_tensor(key)

        try:
            return plain.decode(parse_json(h.metadata()["extra"], "it"), tensor)
        except Exception as exc:  # noqa: BLE001 - any value of the untrusted text: refused
            raise CheckpointError(  # by file and field (safetensors raises its own types)
                f"{fpath}: the header's __metadata__['extra'] (the `extra` rank {rank} saved) "
                f"cannot be decoded ({type(exc).__name__}: {exc}): the file is damaged"
            ) from None

    def decoded(self, field: str, value: Any) -> Any:
        """plain.decode of the manifest's `field` (hyperparameters, scalar state, the loss
        scaler's): CheckpointError naming the field where its tagged values are malformed."""
        try:
            return plain.decode(value)
        except Exception as exc:  # noqa: BLE001 - any value of the untrusted text: refused
            raise CheckpointError(f"{os.path.join(self.path, MANIFEST)}: {field} is "
                                  f"{str(value)[:100]}, which cannot be decoded "
                                  f"({type(exc).__name__}: {exc}): the manifest is damaged"
                                  ) from None

    def close(self) -> None:
        self._handles.clear()
        for f in self._raws.values():
            f.close()
        self._raws.clear()
        if self._dirfd is not None:
            os.close(self._dirfd)
            self._dirfd = None
            self.root = self.path


@dataclass
class Segment:
    """Bytes [fb, fe) of one file, bound for `dst` (a bytes view of a tensor's memory)."""

    file: str
    fb: int
    fe: int
    dst: memoryview
    got: int = 0  # bytes filled so far


class _RawFile:
    """One rank file opened for pread (Checkpoint.fill): its header and descriptor. Not
    mapped: pages of a mapped file count in the reader's resident memory until unmapped, and
    consolidation must stay near one tensor."""

    def __init__(self, at: str, path: str, header: dict, data_start: int):
        self.path = path  # for messages; `at`: where to open it (Checkpoint._at)
        self.header = header  # as Checkpoint.open read it
        self.data_start = data_start
        self.fd = os.open(at, os.O_RDONLY)

    def dtype_of(self, key: str, numel: int) -> torch.dtype:
        """The dtype of tensor `key`, checked to be 1-D of `numel` elements of that size."""
        entry = self.header.get(key)
        if not isinstance(entry, dict) or entry.get("dtype") not in ST_DTYPES \
                or entry.get("shape") != [numel]:
            raise CheckpointError(f"{self.path} lacks tensor {key} of {numel} elements that the "
                                  "manifest places there")
        dtype = ST_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {key} has {end - begin} bytes, not "
                                  f"{numel} elements of {dtype}")
        return dtype

    def close(self) -> None:
        os.close(self.fd)

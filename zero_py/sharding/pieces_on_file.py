"""PiecesOnFile: the part of ShardedParams (storage.py) that runs when a rank's stage-3 pieces
live in an NVMe parameter file (offload_params="nvme"; offload/param_store.py, `self.nvme`)
instead of memory: the step's transaction over the records, whole-shard residency, partitioned
construction bucket by bucket, and a load's records written beside the current ones.

A mixin, not a class of its own: it reads ShardedParams' layout and state (nvme, shards,
_resident, _cache, _open, _filling, _fill_pool, _local, _exposed, params), which
ShardedParams.__init__ sets; it never touches a gather buffer.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Sequence

import torch


class PiecesOnFile:
    """ShardedParams' methods for pieces on NVMe (see the module docstring)."""

    def update_pieces(self, buckets: Sequence[int], update: Callable[[int], None]) -> None:
        """On NVMe: update(b) for each bucket in order with its piece open (bucket_piece(b) is
        its record in the ring, read ahead), written back behind; the records flip when every
        write has landed, and none does if anything fails (ParamStore.transaction)."""
        self._cache.clear()
        try:
            with self.nvme.transaction(buckets):
                for b in buckets:
                    self._open[b] = self.nvme.open(b)
                    try:
                        update(b)
                    finally:
                        del self._open[b]
                    self.nvme.close(b)
        finally:
            self._cache.clear()  # copies read during the step may predate its records

    @contextlib.contextmanager
    def filling(self):
        """A partitioned construction (stage3/meta_init.py) writes its parameters' slices
        through write_slice inside. On NVMe each bucket's piece is read once, held while its
        slices arrive, and written as soon as the last one has (the rest on exit), so the host
        holds the buckets being filled, not the shard. A no-op otherwise.

        The pieces being filled live in buffers of the largest piece, reused bucket after
        bucket: a piece allocated and freed per bucket was measured to leave most of the shard
        in glibc's heap (its mmap threshold rises after the first large free), 0.8 GB of a
        400M-parameter bf16 model at one rank."""
        if not self.pieces_on_file or self._filling is not None:
            yield
            return
        self._filling = {}
        self._fill_pool: Dict[torch.dtype, List[torch.Tensor]] = {}
        try:
            yield
            for b in list(self._filling):
                self._write_filled(b)
        finally:
            self._filling = None
            self._fill_pool = {}

    def write_slice(self, s, values: torch.Tensor) -> None:
        """This rank's slice `s` (a ShardSlice) of a parameter set to `values` (its elements
        [param_lo, param_hi)); on NVMe only inside filling()."""
        if not self.pieces_on_file:
            self.shards.piece(s.bucket)[s.piece_lo:s.piece_lo + s.numel].copy_(values)
            return
        if self._filling is None:
            raise RuntimeError("zero_py: a parameter slice on NVMe was written outside "
                               "filling(); this is a bug, please report it")
        b = s.bucket
        entry = self._filling.get(b)
        if entry is None:
            dtype = self.bucket_dtype(b)
            pool = self._fill_pool.setdefault(dtype, [])
            buf = pool.pop() if pool else torch.empty(
                max(self.bucket_shard_numel[c] for c in range(self.n_buckets)
                    if self.bucket_dtype(c) == dtype), dtype=dtype)
            piece = buf[:self.bucket_shard_numel[b]]
            self.nvme.read_into(b, piece)
            entry = self._filling[b] = [piece, set(), buf]
        entry[0][s.piece_lo:s.piece_lo + s.numel].copy_(values)
        entry[1].add(s.param)
        if len(entry[1]) == len(self.slices_of_bucket[b]):
            self._write_filled(b)

    def _write_filled(self, b: int) -> None:
        piece, _, buf = self._filling.pop(b)
        self._cache.pop(b, None)
        self.nvme.write(b, piece)
        self._fill_pool[buf.dtype].append(buf)

    @property
    def pieces_on_file(self) -> bool:
        """Whether this rank's pieces are only in the NVMe parameter file now (offload_params=
        "nvme", outside resident()): checkpoints then copy them to and from its records."""
        return self.nvme is not None and not self._resident

    def write_pieces_aside(self, fill: Callable[[int, torch.Tensor], None]) -> None:
        """On NVMe: every bucket's piece as fill(b, piece) makes it, written beside the current
        one (ParamStore.write_aside); current only after flip_pieces()."""
        self.nvme.write_aside(range(self.n_buckets), fill)

    def flip_pieces(self) -> None:
        """The pieces write_pieces_aside wrote become the current ones."""
        self._cache.clear()
        self.nvme.flip(range(self.n_buckets))

    @contextlib.contextmanager
    def resident(self):
        """On NVMe: the rank's shards in memory for the duration (read in on entry, every
        record written back on exit, flipped together once all landed); parameters between
        uses are their shard slices meanwhile. Nested calls share one. A no-op otherwise."""
        if self.nvme is None or self._resident:
            self._resident += 1
            try:
                yield
            finally:
                self._resident -= 1
            return
        self._cache.clear()
        self.shards.tensors = {dtype: torch.empty(n, dtype=dtype)
                               for dtype, n in self.shards.sizes.items()}
        try:
            for b in range(self.n_buckets):
                self.nvme.read_into(b, self.shards.piece(b))
        except BaseException:
            self._release_shards()
            raise
        self._build_local()
        self._show_local()
        self._resident = 1
        try:
            yield
        finally:
            self._resident = 0
            try:
                with self.nvme.transaction(range(self.n_buckets)):
                    for b in range(self.n_buckets):
                        self.nvme.write(b, self.shards.piece(b))
            finally:
                self._release_shards()

    def _release_shards(self) -> None:
        self._cache.clear()
        self.shards.tensors = {dtype: torch.empty(0, dtype=dtype) for dtype in self.shards.sizes}
        self._build_local()
        self._show_local()

    def _show_local(self) -> None:
        """Parameters of the buckets not gathered become their (new) between-uses tensors."""
        for b in range(self.n_buckets):
            if not self._exposed[b]:
                for i in self.bucket_params[b]:
                    self.params[i].data = self._local[i]

"""StreamedUpdate: the fused update of a shard whose fp32 masters and optimizer states live on
NVMe (offload_optimizer="nvme"; the file and its ring: zero_py/offload/nvme.py).

A step streams the touched chunks of the shard space through the ring: each record (master and
states of chunk_numel elements) is read, updated by the fused CPU kernel with the gradient read
from, and the new parameter values written to, the parameter pieces (through small pinned
staging copies when the parameters are on a GPU), and written back. Nothing of the optimizer
is held in host memory but the ring.

State dicts (state_dict, load_state_dict, consolidate_state_dict) run inside resident(): the
shard's masters and states are read into memory, the ordinary FusedUpdate code works on them,
and on leaving they are written back (the slots flip as after a step). Checkpoints copy the
records through the store's ring instead (zero_py/checkpoint/offloaded.py). Reading one
parameter's state (optimizer.state[p]) reads only the chunks it spans.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Dict, List, Optional, Sequence

import torch

from zero_py import kernels
from zero_py.offload.host import host_threads
from zero_py.offload.nvme import NvmeStore
from zero_py.optim.update import FusedUpdate
from zero_py.sharding.layout import FlatLayout, ShardSlice
from zero_py.sharding.storage import PieceStore

CPU = torch.device("cpu")


class ResidentMasters(PieceStore):
    """The fp32 masters of the bf16/fp16 buckets, in memory only inside resident()."""

    def __init__(self, flat: FlatLayout):
        super().__init__(flat, lambda b: None if flat.bucket_dtype(b) == torch.float32
                         else torch.float32, CPU,
                         lambda sizes: {dtype: torch.empty(0, dtype=dtype) for dtype in sizes})
        self.open = False

    def piece(self, b: int, tensors: Optional[dict] = None) -> Optional[torch.Tensor]:
        if self.dtype_of[b] is None:
            return None
        if not self.open and tensors is None:
            raise RuntimeError("zero_py: the fp32 masters are on NVMe (offload_optimizer="
                               "'nvme') and were read outside resident(); this is a bug, "
                               "please report it")
        return super().piece(b, tensors)

    def allocate(self) -> None:
        self.tensors = {dtype: torch.empty(n, dtype=dtype) for dtype, n in self.sizes.items()}
        self.open = True

    def release(self) -> None:
        self.tensors = {dtype: torch.empty(0, dtype=dtype) for dtype in self.sizes}
        self.open = False

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.tensors.values())


class StreamedUpdate(FusedUpdate):
    """FusedUpdate over an NvmeStore (see the module docstring)."""

    def __init__(self, kind: int, flat: FlatLayout, grads: PieceStore, masters: ResidentMasters,
                 param_groups: List[dict], offload_dir, defaults: Optional[dict] = None,
                 **store_options):
        super().__init__(kind, flat, grads, masters, param_groups, defaults=defaults)
        self.device = CPU  # the states' and the kernel's side
        self.store = NvmeStore(flat, len(self.keys), offload_dir, flat.rank, **store_options)
        self.threads = host_threads()
        self._depth = 0  # resident() nesting
        self._on_gpu = flat.device.type == "cuda"
        self._write_all(None)  # the initial records: masters from the parameters, fresh states

    # -- where each chunk's elements belong -----------------------------------------------------

    def _parts(self, k: int, buckets: Optional[Sequence[int]] = None):
        """(bucket, lo, hi) of chunk k: the shard-space elements [lo, hi) of bucket pieces."""
        c = self.store.chunk_range(k)
        flat = self.flat
        for b in range(flat.n_buckets) if buckets is None else buckets:
            off = flat.bucket_shard_offset[b]
            lo, hi = max(c.start, off), min(c.stop, off + flat.bucket_shard_numel[b])
            if lo < hi:
                yield b, lo, hi

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if t.device.type != "cpu" else t

    # -- whole-shard passes (construction, resident()) ------------------------------------------

    def _write_all(self, states: Optional[List[torch.Tensor]]) -> None:
        """Writes every record: masters from the resident masters (bf16/fp16 buckets) or the
        parameters, states from `states` (None: their initial values)."""
        store, flat = self.store, self.flat

        def fill(k: int, buf: torch.Tensor) -> None:
            arrays = store.arrays(buf)
            c = store.chunk_range(k)
            for a in arrays:
                a.zero_()
            for b, lo, hi in self._parts(k):
                off = flat.bucket_shard_offset[b]
                m = self.masters.piece(b) if self.masters.open else None
                src = m if m is not None else flat.bucket_piece(b)
                arrays[0][lo - c.start:hi - c.start].copy_(self._host(src[lo - off:hi - off]))
                if states is None and self.initial_state != 0.0:
                    for a in arrays[1:]:
                        a[lo - c.start:hi - c.start].fill_(self.initial_state)
            for j, t in enumerate(states or ()):
                arrays[j + 1][:len(c)].copy_(t[c.start:c.stop])
        store.stream(list(range(store.n_chunks)), fill, read=False)

    @contextlib.contextmanager
    def resident(self):
        """The masters and states in memory for the duration (read in, written back)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        store, flat = self.store, self.flat
        states = [torch.empty(flat.shard_numel, dtype=torch.float32) for _ in self.keys]
        self.masters.allocate()

        def take(k: int, buf: torch.Tensor) -> None:
            arrays = store.arrays(buf)
            c = store.chunk_range(k)
            for b, lo, hi in self._parts(k):
                m = self.masters.piece(b)
                if m is not None:
                    off = flat.bucket_shard_offset[b]
                    m[lo - off:hi - off].copy_(arrays[0][lo - c.start:hi - c.start])
            for j, t in enumerate(states):
                t[c.start:c.stop].copy_(arrays[j + 1][:len(c)])
        try:
            store.read_chunks(list(range(store.n_chunks)), take)
        except BaseException:
            self.masters.release()
            raise
        self.states = states
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            try:
                self._write_all(self.states if self.states is not None else None)
            finally:
                self.states = None
                self.masters.release()

    @property
    def is_resident(self) -> bool:
        return self._depth > 0

    def _ensure_states(self) -> List[torch.Tensor]:
        if not self._depth:
            raise RuntimeError("zero_py: the optimizer states are on NVMe (offload_optimizer="
                               "'nvme') and were used outside resident(); this is a bug, "
                               "please report it")
        return super()._ensure_states()

    def reset(self) -> None:
        if self._depth:
            self.states = None  # fresh states are written back when resident() ends
        else:
            with self.resident():
                self.states = None

    def state_bytes(self) -> int:
        return 0  # on NVMe (memory_report counts the file and the ring)

    # -- one parameter's slice, without reading the whole shard ----------------------------------

    def slice_state(self, s: ShardSlice, copy: bool = True) -> Dict[str, torch.Tensor]:
        if self._depth:
            return super().slice_state(s, copy)
        store, flat = self.store, self.flat
        lo = flat.bucket_shard_offset[s.bucket] + s.piece_lo
        hi = lo + s.numel
        out = {k: torch.empty(s.numel, dtype=torch.float32) for k in self.keys}
        master = torch.empty(s.numel, dtype=torch.float32)
        chunks = list(range(lo // store.chunk_numel, (hi - 1) // store.chunk_numel + 1)) \
            if hi > lo else []

        def take(k: int, buf: torch.Tensor) -> None:
            arrays = store.arrays(buf)
            c = store.chunk_range(k)
            a, z = max(lo, c.start), min(hi, c.stop)
            master[a - lo:z - lo].copy_(arrays[0][a - c.start:z - c.start])
            for j, key in enumerate(self.keys):
                out[key][a - lo:z - lo].copy_(arrays[j + 1][a - c.start:z - c.start])
        store.read_chunks(chunks, take)
        if flat.bucket_dtype(s.bucket) != torch.float32:
            out["master_param"] = master
        return out

    # -- the step -------------------------------------------------------------------------------

    def step(self, used: Sequence[int], step_count: Sequence[int], grad_scale: float,
             seed: int, stochastic_rounding: bool, buckets: Optional[Sequence[int]] = None
             ) -> None:
        flat, store = self.flat, self.store
        buckets = list(range(flat.n_buckets)) if buckets is None else list(buckets)
        runs = []  # (shard lo, shard hi, step, bucket): the elements the kernel updates
        group_rows: List[list] = []
        row_of: Dict[tuple, int] = {}
        for b in buckets:
            mine = list(self._runs(b, used, step_count))
            if not mine:
                continue  # its group is not read, as in FusedUpdate.step
            grad = self.grads.piece(b)
            key = (flat.bucket_group[b], grad.dtype, flat.bucket_dtype(b))
            if key not in row_of:
                row_of[key] = len(group_rows)
                group_rows.append(self._group_row(self.param_groups[key[0]], grad.dtype,
                                                  key[2], grad_scale, seed, stochastic_rounding))
            off = flat.bucket_shard_offset[b]
            runs += [(off + lo, off + hi, step, b, row_of[key]) for lo, hi, step in mine]
        if not runs:
            return
        runs.sort()
        chunks = sorted({k for a, z, *_ in runs
                         for k in range(a // store.chunk_numel, (z - 1) // store.chunk_numel + 1)})
        done: List[int] = []
        first = [0]  # runs[first[0]:] may still reach the chunks to come (both are in order)

        def work(k: int, buf: torch.Tensor) -> None:
            c = store.chunk_range(k)
            base = buf.data_ptr()
            rows = array("q")
            staged = []  # (device piece slice, host staging): written back after the kernel
            while first[0] < len(runs) and runs[first[0]][1] <= c.start:
                first[0] += 1
            for j in range(first[0], len(runs)):
                a, z, step, b, g = runs[j]
                if a >= c.stop:
                    break
                lo, hi = max(a, c.start), min(z, c.stop)
                if lo >= hi:
                    continue
                off = flat.bucket_shard_offset[b]
                grad = self.grads.piece(b)[lo - off:hi - off]
                out = flat.bucket_piece(b)[lo - off:hi - off]
                if self._on_gpu:  # the kernel reads and writes host memory
                    grad = grad.cpu()
                    host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    staged.append((out, host_out))
                    out = host_out
                at = (lo - c.start) * 4
                states = [base + (j + 1) * store.chunk_numel * 4 + at
                          for j in range(len(self.keys))] + [0] * (3 - len(self.keys))
                rows.extend(kernels.segment_row(
                    hi - lo, master=base + at, grad=grad.data_ptr(), state0=states[0],
                    state1=states[1], state2=states[2], param_out=out.data_ptr(), step=step,
                    group=g))
                if self._on_gpu:
                    staged[-1] = staged[-1] + (grad,)  # keep the host gradient alive
            kernels.optim_step_segments(rows, group_rows, CPU, n_threads=self.threads)
            for dev, host, *_ in staged:
                dev.copy_(host)
            done.append(k)

        try:
            store.stream(chunks, work)
        except OSError:
            self._restore_params(done)
            raise

    def _master_pairs(self, k: int, buf: torch.Tensor,
                      buckets: Optional[Sequence[int]] = None):
        """(master slice in the record `buf` of chunk k, the parameter piece it belongs to), of
        `buckets` only if given."""
        master = self.store.arrays(buf)[0]
        c = self.store.chunk_range(k)
        for b, lo, hi in self._parts(k, buckets):
            off = self.flat.bucket_shard_offset[b]
            yield (master[lo - c.start:hi - c.start],
                   self.flat.bucket_piece(b)[lo - off:hi - off])

    def _restore_params(self, chunks: Sequence[int]) -> None:
        """After a failed step: the parameters of `chunks` (already updated) from the last good
        step's masters, still current on disk (rounded to nearest)."""
        def put(k: int, buf: torch.Tensor) -> None:
            for master, param in self._master_pairs(k, buf):
                param.copy_(master)
        with torch.no_grad():
            self.store.read_chunks(list(chunks), put)

    def pull_masters(self, buckets: Optional[Sequence[int]] = None) -> None:
        """The masters from the parameters (sync_master_from_params outside resident()), of
        `buckets` only if given: only the chunks they span are rewritten."""
        def fill(k: int, buf: torch.Tensor) -> None:
            for master, param in self._master_pairs(k, buf, buckets):
                master.copy_(self._host(param))
        chunks = range(self.store.n_chunks)
        if buckets is not None:
            chunks = [k for k in chunks if next(self._parts(k, buckets), None) is not None]
        self.store.stream(list(chunks), fill)

    def close(self) -> None:
        self.store.close()

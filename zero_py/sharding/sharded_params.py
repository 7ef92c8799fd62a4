"""ShardedParams: where parameter values live in stage 3.

A rank keeps only its pieces (the shards, one compact tensor per dtype). A unit's full values
exist only while it is gathered, in one gather buffer per bucket. Between uses a parameter is
its own slice of the rank's shard: a 1-D tensor that can be read, logged or copied without harm
(full_shape() says its real shape); while its unit is gathered it is a view of the gather
buffer with its own shape. The gather buffers' storage is released (resized to zero bytes) when
a unit is freed and allocated again when it is gathered, so tensors autograd saved during
forward, which point at that storage, see the values again in backward. It answers the storage
contract (sharding/storage.py) as FlatParams does.

GatherMeter counts the gather buffers' bytes over every storage of one model; full_shape()
reads the shape ShardedParams recorded on each parameter.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence

import torch

from zero_py.collectives import quantized
from zero_py.collectives.peer_memory import PeerMemory
from zero_py.collectives.work import Work, issue
from zero_py.sharding.between_uses import BetweenUses
from zero_py.sharding.layout import FlatLayout
from zero_py.sharding.piece_store import PieceStore
from zero_py.sharding.pieces_on_file import PiecesOnFile

NO_BUCKET_LIMIT = 2**62  # stage 3 buckets are whole (unit, group, dtype) sets


class GatherMeter:
    """Bytes of gather buffers allocated now and at most, over every storage of one model."""

    def __init__(self) -> None:
        self.bytes = 0
        self.peak_bytes = 0

    def add(self, n: int) -> None:
        self.bytes += n
        self.peak_bytes = max(self.peak_bytes, self.bytes)


class ShardedParams(PiecesOnFile, FlatLayout):
    """Parameters of a stage-3 model, sharded (see the module docstring).

    `unit_of[i]` is parameter i's unit; the layout keys by (unit, param group), so a unit is
    whole buckets. `executor` runs the gathers (stage 3 gives it a channel of its own).
    Unit `persistent_unit` (when not None) holds parameters kept whole on every rank: its
    buckets are gathered once and never freed.

    host_shards (offload_params="cpu"): the shards live in host memory (pinned where the device
    is a GPU) and a gather first copies this rank's piece into its own slot of the gather
    buffer on the device, then all-gathers in place; the prefetch schedule issues gathers
    ahead of use, so the copy is prefetched with them. Between uses a parameter is then its
    slice of the host shard.

    param_file (offload_params="nvme"): a callable making the file that holds the shards
    (offload/param_store.py, ParamStore: a record of each bucket's piece, two slots each,
    streamed through a small ring). The shards are then not in memory: `shards` holds empty
    tensors, a parameter between uses is an empty placeholder of its dtype, a gather reads the
    piece from the file into its own slot of the gather buffer, and the optimizer's step
    updates the pieces bucket by bucket inside a transaction (update_pieces). Whatever needs
    every piece at once (checkpoints, state dicts, a load) runs inside resident(), which reads
    the shards into memory and writes them back after."""

    shards_frozen = True  # frozen parameters are sharded too, in frozen_storage
    params_sharded = True  # a rank holds only its slices (owned_values) between uses
    # the model's frozen parameters (their own ShardedParams over the same units), set by
    # zero_py.initialize; memory_report counts them with these
    frozen_storage: Optional["ShardedParams"] = None

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[int],
                 unit_of: Sequence[int], n_units: int, executor, align_bytes: int,
                 meter: GatherMeter, persistent_unit: Optional[int] = None,
                 host_shards: bool = False, param_file: Optional[Callable] = None,
                 device: Optional[torch.device] = None):
        n_groups = max(groups, default=0) + 1
        keys = [u * n_groups + g for u, g in zip(unit_of, groups)]
        super().__init__(params, groups, executor.world_size, executor.rank, align_bytes,
                         NO_BUCKET_LIMIT, layout_keys=keys, device=device)
        self.executor = executor
        self.meter = meter
        self.n_units = n_units
        self.persistent_unit = persistent_unit
        self.param_unit = list(unit_of)
        self.bucket_unit = [unit_of[ps[0]] for ps in self.bucket_params]
        self.unit_buckets: List[List[int]] = [[] for _ in range(n_units)]
        for b, u in enumerate(self.bucket_unit):
            self.unit_buckets[u].append(b)
        self.unit_bytes = [sum(self.bucket_numel[b] * self.bucket_dtype(b).itemsize
                               for b in bs) for bs in self.unit_buckets]
        # the shards in memory every rank of the host maps where it can (PeerMemory): a rank
        # can then gather a unit alone (gather_one_sided), e.g. for a no_grad forward of its own
        self.peers: Optional[PeerMemory] = None

        self.host_shards = bool(host_shards)
        on_gpu = self.device.type == "cuda"

        def allocate(sizes):
            if param_file is not None:  # on NVMe: in memory only inside resident()
                return {dtype: torch.empty(0, dtype=dtype) for dtype in sizes}
            if self.host_shards and on_gpu:
                return {dtype: torch.zeros(n, dtype=dtype, pin_memory=True)
                        for dtype, n in sizes.items()}
            self.peers = PeerMemory.create(executor, sizes)
            return self.peers.tensors(self.rank) if self.peers is not None else None
        self.shards = PieceStore(self, self.bucket_dtype, self.device, allocate)
        for p, shape in zip(self.params, self.param_shapes):
            p._zero_py_shape = shape  # full_shape(p): the shape between uses is 1-D
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # between uses: each parameter's slice of this rank's shard (empty where it has none,
        # and on NVMe outside resident())
        self._local: List[torch.Tensor] = []
        self._build_local()
        self.nvme = None  # offload_params="nvme": the ParamStore
        self._resident = 0  # resident() nesting
        self._open: Dict[int, torch.Tensor] = {}  # pieces opened by update_pieces
        self._cache: Dict[int, torch.Tensor] = {}  # pieces read for bucket_piece, newest last
        # inside filling(): b -> [piece, params stored, its pool buffer]; free buffers by dtype
        self._filling: Optional[Dict[int, list]] = None
        self._fill_pool: Dict[torch.dtype, List[torch.Tensor]] = {}
        if param_file is not None:
            self.nvme = param_file(self)
        # gather buffers (one per bucket, storage released between uses) and the parameters'
        # full views into them, all made by materialize()
        self._buffers: List[Optional[torch.Tensor]] = [None] * self.n_buckets
        self._full: List[Optional[torch.Tensor]] = [None] * len(self.params)
        self._exposed = [False] * self.n_buckets  # params are their full views now
        # buckets gathered by this rank alone for zero_py.gathered() or a state dict (peers
        # may not hold them): publish() leaves them to end_update(); free() forgets them
        self.held_alone: set = set()
        self._writes = 0  # the shards' version (begin_write)
        self._writing = 0
        self.unit_names: Optional[List[str]] = None  # set by the engine, for errors

    def _build_local(self) -> None:
        self._local = []
        for i, p in enumerate(self.params):
            s = self.slice_of_param.get(i)
            self._local.append(self.shards.piece(s.bucket)[s.piece_lo:s.piece_hi] if s is not None
                               else self.shards.tensors[p.dtype][:0])

    def describe_bucket(self, b: int) -> str:
        """Bucket b in words, for errors: its unit (by module name once the engine named the
        units) and its index."""
        u = self.bucket_unit[b]
        if u == self.persistent_unit:
            unit = "the persistent unit (parameters kept whole)"
        elif self.unit_names is not None and u < len(self.unit_names):
            unit = f"unit {u} {self.unit_names[u] or '(the root module)'!r}"
        else:
            unit = f"unit {u}"
        return f"{unit}, bucket {b}"

    # -- build ---------------------------------------------------------------------------------

    def materialize(self, b: int, values: Dict[int, torch.Tensor]) -> None:
        """Builds bucket b: its gather buffer, the full views, and this rank's piece from
        `values` ({param index: full value}, rank 0's broadcast to all; empty: the bucket was
        built on the meta device and its pieces are filled later). The buffer stays whole
        (exposed) only for the persistent unit."""
        buf = torch.empty(self.bucket_numel[b], dtype=self.bucket_dtype(b), device=self.device)
        self._buffers[b] = buf
        self.meter.add(buf.numel() * buf.element_size())
        for i in self.bucket_params[b]:
            lo = self.param_offset[i]
            self._full[i] = self.shaped(i, buf[lo:lo + self.param_numel[i]])
        if values:
            with torch.no_grad():
                for lo, hi in self.bucket_gaps[b]:
                    buf[lo:hi].zero_()
                for i, value in values.items():
                    self._full[i].copy_(value.reshape(self.param_shapes[i]))
                issue(f"broadcast of rank 0's values of {self.describe_bucket(b)} at "
                      "construction", self.executor.broadcast, buf, 0).wait()
                self.load_pieces_from(b, buf)
        self._exposed[b] = True
        self._expose(b)
        if self.bucket_unit[b] != self.persistent_unit:
            self.free(b)

    # -- gather and free --------------------------------------------------------------------------

    def is_gathered(self, b: int) -> bool:
        return self._exposed[b]

    def gather(self, b: int, exact: bool = False) -> Work:
        """Starts the all-gather of bucket b into its buffer; its parameters become their full
        views at once (their values are valid after the returned work is waited on). `exact`:
        the peers' pieces as they are, not through a quantized wire (quantized_weights)."""
        buf = self._unfree(b)
        piece = self.shards.piece(b)
        if self.nvme is not None and not self._resident:
            # the piece from its record (read ahead by the engine's read_ahead) into the
            # rank's own slot
            n = self.bucket_shard_numel[b]
            piece = buf[self.rank * n:(self.rank + 1) * n]
            self.nvme.read_into(b, piece)
        elif self.host_shards or self.nvme is not None:
            # host -> device into the rank's own slot, ordered before the gather on the stream
            n = self.bucket_shard_numel[b]
            mine = buf[self.rank * n:(self.rank + 1) * n]
            mine.copy_(piece, non_blocking=True)
            piece = mine
        executor = quantized.exact(self.executor) if exact else self.executor
        return issue(f"all-gather of {self.describe_bucket(b)}", executor.all_gather, buf, piece)

    def _unfree(self, b: int) -> torch.Tensor:
        """Bucket b's gather buffer with its storage back and its parameters as full views
        (the values arrive by a gather)."""
        buf = self._buffers[b]
        if not self._exposed[b]:
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            self.meter.add(buf.numel() * buf.element_size())
            self._exposed[b] = True
            self._expose(b)
        return buf

    @property
    def one_sided(self) -> bool:
        """Whether a bucket can be gathered by this rank alone (gather_one_sided)."""
        return self.peers is not None

    def gather_one_sided(self, b: int, what: str) -> Work:
        """Bucket b's full values copied out of every rank's shards in shared memory, with no
        collective: the peers take no part. Waits (up to the group's timeout) for a peer that
        is still updating its shards in the current step. Done when it returns."""
        self.peers.wait_for_peers(what)
        buf = self._unfree(b)
        n = self.bucket_shard_numel[b]
        with torch.no_grad():
            for q in range(self.world_size):
                buf[q * n:(q + 1) * n].copy_(self.shards.piece(b, self.peers.tensors(q)))
        return Work(what=what)

    def begin_update(self, steps: int) -> None:
        """The optimizer is about to update the shards in step `steps` (0-based): one-sided
        readers on other ranks wait until end_update."""
        self.begin_write()

    def end_update(self, steps: int) -> None:
        """The shards hold the values after the step; the buckets held alone (a step inside a
        zero_py.gathered() block of this rank's) are copied again from them."""
        self.end_write()
        for b in sorted(self.held_alone):
            self.gather_one_sided(b, f"one-sided gather of {self.describe_bucket(b)} after "
                                     "step() inside zero_py.gathered()").wait()

    # The shards' version, which one-sided readers wait for (PeerMemory): 2 * writes once this
    # rank's shards hold its `writes`-th update, odd while it writes one. An update is a step,
    # and any write outside one (load_state_dict, gathered(modifier_rank=...),
    # load_checkpoint), which every rank makes too, with no collective after it: a peer that
    # reads this rank's shards after its own load waits for this rank's load to end.
    def begin_write(self) -> None:
        self._writing += 1
        if self._writing == 1 and self.peers is not None:
            self.peers.publish_version(2 * self._writes + 1)

    def end_write(self) -> None:
        self._writing -= 1
        if self._writing == 0:
            self._writes += 1
            if self.peers is not None:
                self.peers.publish_version(2 * self._writes)

    @contextlib.contextmanager
    def writing(self):
        """This rank writes its shards outside a step (see begin_write)."""
        self.begin_write()
        try:
            yield
        finally:
            self.end_write()

    def read_ahead(self, buckets: Sequence[int]) -> None:
        """Buckets about to be gathered (the engine's schedule): on NVMe, their records start
        being read into the ring now, so the read overlaps what runs before their gather."""
        if self.nvme is not None and not self._resident:
            self.nvme.read_ahead([b for b in buckets if not self._exposed[b]])

    def free(self, b: int) -> None:
        """Releases bucket b's full values: its parameters are their shard slices again."""
        self.held_alone.discard(b)
        if not self._exposed[b]:
            return
        for i in self.bucket_params[b]:
            p = self.params[i]
            p.data = self._local[i]
            if type(p) is torch.nn.Parameter:  # computing with the slice says so (between_uses)
                p.__class__ = BetweenUses
        buf = self._buffers[b]
        buf.untyped_storage().resize_(0)
        self.meter.add(-buf.numel() * buf.element_size())
        self._exposed[b] = False

    def _expose(self, b: int) -> None:
        for i in self.bucket_params[b]:
            p = self.params[i]
            if type(p) is BetweenUses:
                p.__class__ = torch.nn.Parameter
            p.data = self._full[i]

    def changed_params(self) -> List[tuple]:
        """The parameters whose values are no longer where this storage put them, as
        (index, what it is now, what it should be), e.g. (3, "torch.float16 on cpu",
        "torch.float32 on cpu"): cast or moved after zero_py.initialize (model.half(),
        model.to(device)) or given another .data (`p.data = t`), which changes only the tensor
        the parameter is now (its shard slice, or its full view while gathered): the next
        gather or free would put the old one back and drop the change. Empty when none
        changed."""
        out = []
        with torch._C.DisableTorchFunctionSubclass():  # about 0.4 us a parameter
            for i, p in enumerate(self.params):
                want = self._full[i] if self._exposed[self.param_bucket[i]] else self._local[i]
                if want is not None and (p.data_ptr() != want.data_ptr()
                                         or p.dtype is not want.dtype):
                    out.append((i, f"{p.dtype} on {p.device}", f"{want.dtype} on "
                                f"{want.device}"))
        return out

    def publish(self, executor, buckets: Sequence[int], exact: bool = False) -> None:
        """After an update of the shards: refresh every bucket whose full values exist (the
        persistent unit's, and any held by zero_py.gathered()); the others are gathered from
        the new shards at their next use. Buckets this rank holds alone (held_alone: peers
        may not hold them) are not gathered here but copied again by end_update, once every
        rank's shards hold the step's values. `exact`: bypass a quantized wire (gather)."""
        pending = [self.gather(b, exact=exact) for b in range(self.n_buckets)
                   if self._exposed[b] and b not in self.held_alone]
        for work in pending:
            work.wait()

    # -- values -----------------------------------------------------------------------------------

    def bucket_piece(self, b: int) -> torch.Tensor:
        """This rank's piece of bucket b. On NVMe outside resident(): the piece opened by
        update_pieces (written back with it), or else a copy read from the file (the last two
        are kept: the optimizer's whole-shard passes walk the buckets in order), which is
        only read."""
        if self.nvme is None or self._resident:
            return self.shards.piece(b)
        piece = self._open.get(b)
        if piece is not None:
            return piece
        piece = self._cache.pop(b, None)
        if piece is None:
            piece = torch.empty(self.bucket_shard_numel[b], dtype=self.bucket_dtype(b))
            self.nvme.read_into(b, piece)
        self._cache[b] = piece
        while len(self._cache) > 2:
            self._cache.pop(next(iter(self._cache)))
        return piece

    def owned_values(self, i: int) -> torch.Tensor:
        """This rank's slice of parameter i in its shard, a 1-D view (empty where it owns
        none); what the parameter is between uses. On NVMe: only inside resident()."""
        if self.nvme is not None and not self._resident:
            raise RuntimeError("zero_py: the parameter shards are on NVMe (offload_params="
                               "'nvme') and were read outside resident(); this is a bug, "
                               "please report it")
        return self._local[i]

    def full_buffer(self, b: int) -> torch.Tensor:
        """Bucket b's gather buffer (whole only while gathered)."""
        return self._buffers[b]

    def full_view(self, i: int) -> torch.Tensor:
        """Parameter i with its full shape in its gather buffer (valid while gathered)."""
        return self._full[i]

    def load_pieces_from(self, b: int, full: torch.Tensor) -> None:
        """This rank's piece of bucket b from a full bucket `full`."""
        n = self.bucket_shard_numel[b]
        if self.nvme is not None and not self._resident:
            self._cache.pop(b, None)
            self.nvme.write(b, full[self.rank * n:(self.rank + 1) * n])
            return
        self.shards.piece(b).copy_(full[self.rank * n:(self.rank + 1) * n])

    def persistent_bytes(self) -> int:
        if self.persistent_unit is None:
            return 0
        return self.unit_bytes[self.persistent_unit]

    def param_bytes(self, frozen: Sequence[torch.Tensor]) -> Dict[str, int]:
        """memory_report's parameter terms: the shards, the persistent unit's buffers, the
        most gathered bytes held at once (gathered_peak, over every storage of the model) and
        this rank's share of the gathers' shared memory (gather_transport); the
        frozen parameters are sharded too (`frozen_storage`, set by zero_py.initialize)."""
        storages = [self] + ([self.frozen_storage] if self.frozen_storage is not None else [])
        kept = sum(s.shards.nbytes() + s.persistent_bytes() for s in storages)
        full = sum(_numel(shape) * p.dtype.itemsize for s in storages
                   for p, shape in zip(s.params, s.param_shapes))
        padding = sum((hi - lo) * s.bucket_dtype(b).itemsize for s in storages
                      for b in range(s.n_buckets) for lo, hi in s.bucket_gaps[b])
        transport = getattr(self.executor, "shared_bytes", 0)  # the gathers' shared memory
        shards = sum(s.shards.nbytes() for s in storages) if self.host_shards else 0
        # on NVMe: the file (both slots of every record) and the ring that streams it
        files = [s.nvme for s in storages if s.nvme is not None]
        ring = sum(f.host_bytes() for f in files)
        return {"params": kept - shards + self.meter.peak_bytes + transport, "ddp_params": full,
                "padding": padding, "gathered_peak": self.meter.peak_bytes,
                "gather_transport": transport, "host_params": shards + ring,
                "nvme_params": sum(f.file_bytes for f in files)}


    def index_of(self, p: torch.Tensor) -> Optional[int]:
        return self._index.get(id(p))


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's real shape: under stage 3 a parameter between uses is its 1-D shard
    slice; this gives the shape it has inside forward or zero_py.gathered()."""
    shape = getattr(p, "_zero_py_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

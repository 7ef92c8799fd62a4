"""The native NCCL executor: the schedule's collectives on CUDA tensors through zero_py._cuda's
own NCCL communicator (csrc/comm/), with the interface of executor.TorchDistExecutor.

NCCL is loaded at run time: the libnccl.so.2 that PyTorch already loaded (found by its soname),
else ZP_NCCL_LIBRARY, else an installed nvidia-nccl wheel. The communicator's unique id is
made on the group's rank 0 and handed to the others through the torch.distributed store. Every
collective runs on one dedicated stream, ordered after the caller's current stream by an event;
wait() makes the caller's current stream wait for it (the host does not), so reductions overlap
with backward and gathers with the next forward. A watchdog thread in C aborts the
communicator when NCCL reports an error or a collective outlives `timeout` seconds (a dead
peer; by default the process group's own timeout, the one given to init_process_group): the
next wait, synchronize or collective on the host then raises a CollectiveError naming the
operation and the reason instead of hanging. (Untested on a GPU so far: written to the same
contract as the CPU path, whose tests run.)

all_to_all (equal chunks: the quantized reduce-scatter's exchange, collectives/quantized.py) is
one NCCL group of an ncclSend of chunk r and an ncclRecv into chunk r per rank r, enqueued,
ordered and watched like the others. Those calls came in NCCL 2.7: with an older library the
executor still loads, and all_to_all_unavailable says why all_to_all cannot run (quantized
grads are then refused, and a bf16 wire summed in fp32 reduces in bf16 instead).

CPU tensors handed to all_reduce, broadcast and all_to_all go through the device: copied in
(without blocking), exchanged, and copied back when wait() is called. zero_py's own bookkeeping
(the "used" mask, statistics, counts) is made on the executor's device instead.

Every collective is counted in `stats` (stats.py: calls and bytes per kind under the ring
model, NCCL's own; the all-to-all's (N-1)/N of its input each way) once it has been issued; a
CPU tensor's is counted once, as its device copy's.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch
import torch.distributed as dist

from zero_py.collectives.arguments import check_all_to_all
from zero_py.collectives.stats import CommStats
from zero_py.collectives.timeout import group_timeout_s
from zero_py.collectives.work import CollectiveError, Work
from zero_py.kernels import cuda


ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, ALL_TO_ALL = 0, 1, 2, 3, 4  # zp_coll
_COLL_NAMES = ("all-reduce", "reduce-scatter", "all-gather", "broadcast", "all-to-all")
# ncclDataType_t values (csrc/comm/nccl_lib.h)
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
                torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_SUM, _PROD, _MAX, _MIN = 0, 1, 2, 3

# "ranks" -> communicators made over those ranks in this process (unique_id_key)
_IDS_MADE: dict = {}


def unique_id_key(ranks) -> str:
    """The store key under which group rank 0 publishes a new communicator's ncclUniqueId.

    It counts the communicators made over the same ranks only, which the members make at the
    same calls (initialize and channel() are collective over the group). A count of every
    communicator this process made differed between ranks as soon as some made one the others
    did not (a stage-3 model over ranks {2, 3}: its executor and gather channel), and the next
    executor over every rank then waited on a key that rank 0 never set: a hang (the gloo
    channel had the same defect, collectives/local_group.py)."""
    ranks = "-".join(map(str, ranks))
    made = _IDS_MADE.get(ranks, 0)
    _IDS_MADE[ranks] = made + 1
    return f"zero_py/nccl/{ranks}/{made}"


def nccl_op(op) -> int:
    """A torch.distributed.ReduceOp as NCCL's reduction code (SUM, PRODUCT, MAX, MIN)."""
    for ours, theirs in ((_SUM, dist.ReduceOp.SUM), (_PROD, dist.ReduceOp.PRODUCT),
                         (_MAX, dist.ReduceOp.MAX), (_MIN, dist.ReduceOp.MIN)):
        if op == theirs:
            return ours
    raise ValueError(f"the NCCL executor reduces with SUM, PRODUCT, MAX or MIN, not {op!r}")


def nccl_dtype(dtype: torch.dtype) -> int:
    try:
        return _NCCL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"the NCCL executor moves {sorted(str(d) for d in _NCCL_DTYPES)}, not "
                         f"{dtype}") from None


def library_candidates() -> List[Optional[str]]:
    """Where load_nccl looks, in order (None: the dynamic loader's own search by soname)."""
    out: List[Optional[str]] = []
    env = os.environ.get("ZP_NCCL_LIBRARY")
    if env:
        out.append(env)
    out.append(None)
    try:
        import nvidia.nccl  # the wheel PyTorch's CUDA builds depend on

        for base in nvidia.nccl.__path__:
            out.append(os.path.join(base, "lib", "libnccl.so.2"))
    except ImportError:
        pass
    out.append(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so.2"))
    return out


def load_nccl() -> int:
    """Loads NCCL once (see library_candidates) and returns its version code."""
    mod = cuda.native()
    errors = []
    for path in library_candidates():
        if path is not None and not os.path.exists(path):
            continue
        try:
            return mod.nccl_load(path)
        except RuntimeError as exc:
            errors.append(str(exc))
    raise RuntimeError("cannot load NCCL (libnccl.so.2): " + "; ".join(errors) +
                       ". Use a CUDA build of torch, install nvidia-nccl-cu12/13, or set "
                       "ZP_NCCL_LIBRARY to the library's path")


def unavailable_reason() -> Optional[str]:
    """None when the NCCL executor can run here; else why not."""
    why = cuda.unavailable_reason()
    if why is not None:
        return why
    try:
        load_nccl()
    except RuntimeError as exc:
        return str(exc)
    return None


class _StreamHandle:
    """A native NCCL collective as a Work handle: wait() orders the caller's current stream
    after it (the host does not block); synchronize() blocks the host."""

    __slots__ = ("_work", "_device")

    def __init__(self, work, device: torch.device):
        self._work = work
        self._device = device

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait(torch.cuda.current_stream(self._device).cuda_stream)

    def synchronize(self) -> None:
        self._work.synchronize()


class NcclExecutor:
    """Runs the schedule's collectives on `process_group`'s ranks with zero_py's own NCCL
    communicator on `device` (default: the current CUDA device). One GPU per rank, as NCCL
    requires. timeout: seconds a collective may take before the communicator is aborted
    (default: the process group's timeout). label: the group's name in the byte counts
    (`stats`, ZeroOptimizer.comm_stats())."""

    reduce_scatter_keeps_input = True  # NCCL's reduce-scatter reads its input only
    # None when all_to_all can run, else why not (a library older than NCCL 2.7, found at
    # construction); collectives/quantized.py reads it before it relies on all_to_all
    all_to_all_unavailable: Optional[str] = None

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, timeout: Optional[float] = None,
                 label: str = "shard"):
        self.stats = CommStats(label)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_py needs torch.distributed: call torch.distributed.init_process_group() "
                "(e.g. under torchrun) before building the optimizer")
        why = unavailable_reason()
        if why is not None:
            raise RuntimeError(f"the NCCL executor is unavailable: {why}; use "
                               "executor='torch' for the torch.distributed executor")
        self.group = process_group if process_group is not None else dist.group.WORLD
        if timeout is None:
            timeout = group_timeout_s(self.group)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the NCCL executor runs on a cuda device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.timeout = float(timeout)
        self.version = load_nccl()
        if not cuda.native().nccl_has_p2p():
            self.all_to_all_unavailable = (
                f"the loaded NCCL (version code {self.version}) has no ncclSend/ncclRecv, which "
                "came in NCCL 2.7: use a newer NCCL (ZP_NCCL_LIBRARY) or executor='torch'")
        unique_id = self._exchange_id()
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        self._comm = cuda.native().NcclComm(unique_id, self.world_size, self.rank,
                                            device.index, float(timeout))

    # -- set-up ----------------------------------------------------------------------------------

    def _exchange_id(self) -> bytes:
        """Rank 0's ncclUniqueId, on every rank, through the torch.distributed store (or, where
        no store is reachable, a broadcast over the group)."""
        ranks = dist.get_process_group_ranks(self.group)
        key = unique_id_key(ranks)
        store = None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError):
            store = None
        if store is not None:
            if self.rank == 0:
                uid = cuda.native().nccl_unique_id()
                store.set(key, uid)
                return uid
            return bytes(store.get(key))
        # no store: broadcast the 128 bytes over the group itself
        on_cuda = dist.get_backend(self.group) == "nccl"
        buf = torch.zeros(128, dtype=torch.uint8, device=self.device if on_cuda else "cpu")
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(cuda.native().nccl_unique_id()),
                                       dtype=torch.uint8))
        dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)
        return bytes(buf.cpu().tolist())

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def check(self) -> None:
        """Raises RuntimeError with the reason once the communicator has failed."""
        self._comm.check()

    def abort(self, reason: str = "aborted by the caller") -> None:
        self._comm.abort(reason)

    # -- collectives -----------------------------------------------------------------------------

    def _tensor(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}; this NCCL executor runs on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        nccl_dtype(t.dtype)

    def _issue(self, coll: int, send: torch.Tensor, recv: torch.Tensor, count: int, op: int = 0,
               root: int = 0) -> Work:
        what = (f"{_COLL_NAMES[coll]} of {count} {str(send.dtype).replace('torch.', '')} "
                "elements (NCCL)")
        if count == 0:
            return Work(what=what)
        after = torch.cuda.current_stream(self.device)
        # a communicator that the watchdog aborted (a dead peer, the timeout) raises here
        try:
            work = self._comm.collective(coll, send.data_ptr(), recv.data_ptr(), count,
                                         nccl_dtype(send.dtype), op, root,
                                         self.stream.cuda_stream, after.cuda_stream)
        except RuntimeError as exc:
            raise CollectiveError(what, exc) from exc
        # the caching allocator must not hand these blocks out again before the collective ran,
        # even if the caller drops the handle without waiting
        send.record_stream(self.stream)
        if recv.data_ptr() != send.data_ptr():
            recv.record_stream(self.stream)
        return Work(_StreamHandle(work, self.device), keep=(send, recv), what=what)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """output = this rank's chunk of the sum of `input` over ranks."""
        self._tensor("output", output)
        self._tensor("input", input)
        if input.dtype != output.dtype or input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input must be world_size ({self.world_size}) "
                             f"times output's {output.numel()} elements of {output.dtype}, got "
                             f"{input.numel()} of {input.dtype}")
        work = self._issue(REDUCE_SCATTER, input, output, output.numel(), _SUM)
        self._count("reduce_scatter", input)
        return work

    def _count(self, kind: str, full: torch.Tensor, root: Optional[int] = None) -> None:
        self.stats.record(kind, full.numel() * full.element_size(), self.world_size, self.rank,
                          root)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """output = the concatenation of every rank's `input` (input may alias its chunk)."""
        self._tensor("output", output)
        self._tensor("input", input)
        if input.dtype != output.dtype or output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output must be world_size ({self.world_size}) times "
                             f"input's {input.numel()} elements of {input.dtype}, got "
                             f"{output.numel()} of {output.dtype}")
        work = self._issue(ALL_GATHER, input, output, input.numel())
        self._count("all_gather", output)
        return work

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Chunk r of `input` goes to rank r; chunk r of `output` comes from rank r (equal
        chunks; the quantized reduce-scatter's one hop). One ncclSend and ncclRecv per rank in
        one NCCL group. CPU tensors (both) go through the device."""
        if self.all_to_all_unavailable is not None:
            raise RuntimeError(f"the NCCL executor has no all_to_all here: "
                               f"{self.all_to_all_unavailable}")
        if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor) and \
                output.device.type == "cpu" and input.device.type == "cpu":
            return self._all_to_all_through_device(output, input)
        self._tensor("output", output)
        self._tensor("input", input)
        ws = self.world_size
        check_all_to_all(output, input, ws)
        work = self._issue(ALL_TO_ALL, input, output, input.numel() // ws)
        self._count("all_to_all", input)
        return work

    def _all_to_all_through_device(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        dev_out = torch.empty(output.shape, dtype=output.dtype, device=self.device)
        work = self.all_to_all(dev_out, input.to(self.device))

        def back():
            work.synchronize()
            output.copy_(dev_out)
        return Work(None, back, what=work.what)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> Work:
        code = nccl_op(op)
        if tensor.device.type == "cpu":
            return self._through_device(tensor, lambda dev: self.all_reduce(dev, op))
        self._tensor("tensor", tensor)
        work = self._issue(ALL_REDUCE, tensor, tensor, tensor.numel(), code)
        self._count("all_reduce", tensor)
        return work

    def all_reduce_max(self, tensor: torch.Tensor) -> Work:
        return self.all_reduce(tensor, dist.ReduceOp.MAX)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        """tensor = group rank `src`'s tensor."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is not a rank of this group of "
                             f"{self.world_size}")
        if tensor.device.type == "cpu":
            return self._through_device(tensor, lambda dev: self.broadcast(dev, src))
        self._tensor("tensor", tensor)
        work = self._issue(BROADCAST, tensor, tensor, tensor.numel(), root=src)
        self._count("broadcast", tensor, src)
        return work

    def _through_device(self, host: torch.Tensor, run) -> Work:
        """A collective on a CPU tensor: through a device copy, copied back at wait()."""
        # not blocking: a blocking copy to the device would first wait for all the work
        # queued on the caller's stream (the host tensor is not written before back())
        dev = host.to(self.device, non_blocking=True)
        work = run(dev)

        def back():
            work.synchronize()
            host.copy_(dev)
        return Work(None, back, what=work.what)

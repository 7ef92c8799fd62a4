"""Hybrid sharding: shard inside a group, replicate across groups (a 2-D mesh of ranks).

The ranks form a grid: a row is a *shard group* (the ranks that split the model between
them, e.g. the ranks of one node), a column is a *replicate group* (the ranks that hold the
same shard in every row). Three ways to ask for it, each a keyword of ZeroOptimizer and
zero_py.initialize (resolve_groups):

    process_group=, replicate_group=   this rank's shard group and replicate group
    device_mesh=                       a 2-D DeviceMesh with dims ("replicate", "shard")
    hybrid="node"                      one shard group per node, from torchrun's
                                       LOCAL_WORLD_SIZE (ranks numbered node by node)

The groups are checked on every rank before anything else is sent (check_mesh): they must
tile the world as a grid, and the ranks of one replicate group must hold the same shard (the
same rank in their shard groups). A failed check is the same ValueError on every rank.

HybridExecutor is the executor the sharding code sees. Its world_size, rank and group are the
shard group's, so the layout, the all-gathers of parameters and the stage-3 gathers stay
inside the shard group. What differs from a plain executor:

    reduce_scatter   reduce-scatter in the shard group, then an all-reduce of the shard
                     across the replicate group: the output is this rank's chunk of the sum
                     over the whole world. Replicas then hold bit-identical reduced shards
                     (one all-reduce gives every member the same sum), so their updates agree.
    all_reduce       the shard group only: sums over shards (gradient norms, overflow) count
                     each element of the model once, whichever replica computes them (the
                     clipping statistics run on `world` instead: their arguments must agree
                     across replicas too, optim/grad_stats.py)
    all_reduce_max   the whole world (which parameters got a gradient on any rank)
    broadcast        the whole world, from rank `src` of the shard group of global rank 0:
                     at construction every rank starts from global rank 0's values
    world            an executor over every rank: the ranks' agreement, the pass and step
                     counts and the checkpoints' error exchange run on it, so a replica that
                     differs is refused

The replicate all-reduces are issued strictly in the order of the reduce-scatters they follow
(_Relay): a rank starts the all-reduce of a gradient bucket only after its own reduce-scatter is
complete, and waiting for (or polling) a later bucket first starts the earlier ones, so every
member of a replicate group issues its all-reduces in the same sequence. They run on a process
group of their own over the replicate group's ranks: the moment a rank starts one depends on
its timing, so no other collective may share their group.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zero_py.collectives.objects import gather_json
from zero_py.collectives.work import Work, issue

HYBRID_MODES = (None, "node")
MESH_DIMS = ("replicate", "shard")


class _Relay:
    """The replicate-group stage of every reduction, started in the order the reductions
    were issued (see the module docstring)."""

    def __init__(self) -> None:
        self.queue: deque = deque()

    def advance(self, through: Optional["_Relayed"] = None) -> None:
        """Starts the second stage of every queued link whose first stage is complete, in
        order; with `through`, waits for the first stages up to that link."""
        while self.queue:
            link = self.queue[0]
            if through is None and not link.first.is_completed():
                return
            self.queue.popleft()
            link.first.wait()
            link.second = link.start()
            if link is through:
                return


class _Relayed:
    """A handle over two collectives in sequence: `first`, then the Work `start()` returns."""

    def __init__(self, relay: _Relay, first: Work, start):
        self.relay, self.first, self.start = relay, first, start
        self.second: Optional[Work] = None
        relay.queue.append(self)

    def is_completed(self) -> bool:
        self.relay.advance()
        return self.second is not None and self.second.is_completed()

    def wait(self) -> None:
        if self.second is None:
            self.relay.advance(through=self)
        self.second.wait()


class HybridExecutor:
    """The collectives of a 2-D mesh of ranks, seen from the shard group (module docstring).

    shard, replicate: executors over this rank's shard group and replicate group (from
    make_executor); world: an executor over every rank; root_ranks: the global ranks of the
    shard group holding global rank 0, in shard-group order; mesh_ranks: every shard group's
    global ranks (what the ranks agree on)."""

    def __init__(self, shard, replicate, world, root_ranks: Sequence[int],
                 mesh_ranks: Sequence[Sequence[int]], relay: Optional[_Relay] = None):
        self.shard, self.replicate, self.world = shard, replicate, world
        self.group = shard.group
        self.world_size = shard.world_size
        self.rank = shard.rank
        self.device = shard.device
        self.n_replicas = replicate.world_size
        # which replica: the index of this rank's shard group, the one of global rank 0 first
        # (not the rank in the replicate group, whose order need not follow the shard groups)
        me = shard.global_rank(shard.rank)
        self.replica_rank = next(k for k, row in enumerate(mesh_ranks) if me in row)
        # DDP averages over every rank: the reducer divides each gradient by this
        self.data_parallel_size = shard.world_size * replicate.world_size
        self.root_ranks = list(root_ranks)
        self.mesh_ranks = [list(g) for g in mesh_ranks]
        self._relay = relay if relay is not None else _Relay()

    # the mesh's reduction is the shard group's reduce-scatter then the replicas' all-reduce: an
    # all-to-all of the shard executor (reached through __getattr__) would skip the replicas,
    # so quantized_grads is refused and a bf16 wire summed in fp32 takes reduce_scatter
    # (collectives/quantized.py reads this)
    all_to_all_unavailable = ("hybrid sharding reduces across the replicas too, and an "
                              "all-to-all within the shard group would leave them out")

    def __getattr__(self, name: str) -> Any:
        # what callers ask of an executor beyond the collectives (timeout_s, shared_bytes,
        # scratch_peak_bytes, reduce_scatter_keeps_input, ...) is the shard executor's
        if name in ("shard", "replicate", "world") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.shard, name)

    def with_shard(self, shard) -> "HybridExecutor":
        """The same mesh over another executor of the shard group (a channel), sharing this
        one's replicate group and the order of its all-reduces."""
        return HybridExecutor(shard, self.replicate, self.world, self.root_ranks,
                              self.mesh_ranks, self._relay)

    def global_rank(self, group_rank: int) -> int:
        return self.shard.global_rank(group_rank)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """output = this rank's chunk of the sum of `input` over every rank of the world."""
        first = issue("reduce-scatter in the shard group", self.shard.reduce_scatter, output,
                      input)
        if self.n_replicas == 1:
            return first
        return Work(_Relayed(self._relay, first, lambda: issue(
            "all-reduce of the gradient shard across the replicas", self.replicate.all_reduce,
            output)), what="reduce-scatter, then all-reduce across the replicas")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        return self.shard.all_gather(output, input)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> Work:
        return self.shard.all_reduce(tensor, op)

    def all_reduce_max(self, tensor: torch.Tensor) -> Work:
        return self.world.all_reduce_max(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        return self.world.broadcast(tensor, self.root_ranks[src])


# -- asking for it ------------------------------------------------------------------------------

def wants_hybrid(replicate_group=None, device_mesh=None, hybrid=None) -> bool:
    return replicate_group is not None or device_mesh is not None or hybrid is not None


def check_keywords(process_group, replicate_group, device_mesh, hybrid) -> None:
    """The keywords alone (the same on every rank when every rank passes the same call)."""
    if hybrid not in HYBRID_MODES:
        raise ValueError(f"hybrid must be None or 'node' (one shard group per node, from "
                         f"torchrun's LOCAL_WORLD_SIZE), got {hybrid!r}")
    given = [k for k, v in (("process_group", process_group),
                            ("replicate_group", replicate_group),
                            ("device_mesh", device_mesh)) if v is not None]
    if hybrid is not None and given:
        raise ValueError(f"hybrid='node' builds the shard and replicate groups itself; drop "
                         f"{' and '.join(given)}, or drop hybrid and pass the groups")
    if device_mesh is not None and given != ["device_mesh"]:
        raise ValueError("device_mesh gives both groups; pass either device_mesh or "
                         "process_group= with replicate_group=, not both")
    if replicate_group is not None and process_group is None:
        raise ValueError("replicate_group= needs process_group= too: the shard group (the "
                         "ranks that split the model between them)")


def _node_groups(world) -> Tuple[Any, Any]:
    """hybrid='node': one shard group per node and one replicate group per local rank, from
    torchrun's LOCAL_WORLD_SIZE (checked on every rank together)."""
    def env_int(name: str) -> int:
        try:
            return int(os.environ.get(name, "-1"))
        except ValueError:
            return -1
    mine = {"local_world_size": env_int("LOCAL_WORLD_SIZE"), "local_rank": env_int("LOCAL_RANK")}
    everyone = gather_json(world, mine, dst=None)
    n = world.world_size
    sizes = sorted({e["local_world_size"] for e in everyone})
    error = None
    if sizes == [-1] or -1 in sizes:
        error = ("hybrid='node' reads torchrun's LOCAL_WORLD_SIZE and LOCAL_RANK, which are "
                 "not set (or not numbers) on some ranks: launch with torchrun, or pass "
                 "process_group= and replicate_group=")
    elif len(sizes) > 1:
        error = (f"hybrid='node' needs the same number of ranks on every node; "
                 f"LOCAL_WORLD_SIZE is {sizes} across the ranks: pass process_group= and "
                 f"replicate_group= for uneven nodes")
    elif sizes[0] < 1 or n % sizes[0]:
        error = (f"hybrid='node': LOCAL_WORLD_SIZE={sizes[0]} does not divide the world size "
                 f"{n}; every node must run the same number of ranks")
    else:
        per_node = sizes[0]
        off = [r for r, e in enumerate(everyone) if e["local_rank"] != r % per_node]
        if off:
            error = (f"hybrid='node' needs ranks numbered node by node (rank = node * "
                     f"{per_node} + LOCAL_RANK), as torchrun numbers them; rank(s) {off} are "
                     "not: pass process_group= and replicate_group=")
    if error is not None:
        raise ValueError(error)
    timeout = _world_timeout()
    for key, groups in _NODE_GROUPS:
        if key == (per_node, n, timeout) and _live(groups):
            return groups
    shard_group = replicate_group = None
    # every rank takes part in making every group (new_group is collective over the world)
    for node in range(n // per_node):
        g = dist.new_group(list(range(node * per_node, (node + 1) * per_node)), timeout=timeout)
        if node == dist.get_rank() // per_node:
            shard_group = g
    for local in range(per_node):
        g = dist.new_group(list(range(local, n, per_node)), timeout=timeout)
        if local == dist.get_rank() % per_node:
            replicate_group = g
    if _live([]):  # torch's registry is there to tell a destroyed group apart
        _NODE_GROUPS.append(((per_node, n, timeout), (shard_group, replicate_group)))
    return shard_group, replicate_group


# torch.distributed keeps every group until destroy_process_group(), so groups made per
# optimizer leaked for each one a process built and dropped (hybrid="node" at 2 ranks: 14
# file descriptors and 9 gloo threads per optimizer). hybrid="node"'s groups are made once per
# world layout and shared, as a user's own groups are: ((per_node, world size, timeout),
# (shard group, replicate group)).
_NODE_GROUPS: List[Tuple[tuple, tuple]] = []
# The replicate all-reduces' groups of their own: (members, backend, timeout) -> [group, in
# use], an entry freed when the executor over it is collected and taken again by a later
# optimizer once every rank has freed it (_own_group).
_OWN_GROUPS: Dict[tuple, List[list]] = {}


def _live(groups) -> bool:
    """Whether every group of `groups` is still registered (not destroyed); False where torch
    has no registry to ask."""
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return live is not None and all(g in live for g in groups)


def _own_group(world, members: List[int], replicate_group):
    """A group of `members` for one optimizer's replicate all-reduces, no other optimizer's
    meanwhile: a free one of an earlier, collected optimizer where every rank has freed it
    (the ranks collect at different moments: one exchange over the world decides), else a
    new one. Returns (group, its pool entry)."""
    backend = dist.get_backend(replicate_group)
    timeout = _group_timeout(replicate_group)
    key = (tuple(members), str(backend), timeout)
    pool = _OWN_GROUPS.setdefault(key, [])
    pool[:] = [e for e in pool if _live([e[0]])]  # a destroy_process_group() did it everywhere
    free = [i for i, e in enumerate(pool) if not e[1]]
    common = set(free)
    for other in gather_json(world, free, dst=None):
        common &= set(other)
    if common:
        entry = pool[min(common)]
    else:
        entry = [dist.new_group(members, backend=backend, timeout=timeout,
                                use_local_synchronization=True), True]
        if _live([]):
            pool.append(entry)
    entry[1] = True
    return entry


def _free(entry: list) -> None:
    entry[1] = False


def _group_timeout(group):
    from zero_py.collectives.timeout import group_timeout
    return group_timeout(group)


def _world_timeout():
    return _group_timeout(dist.group.WORLD)


def _mesh_groups(mesh, world_size: int) -> Tuple[Any, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                        f"{type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != MESH_DIMS:
        raise ValueError(f"device_mesh must be 2-D with mesh_dim_names {MESH_DIMS} (replicas, "
                         f"then the ranks of one shard group); got {mesh.ndim}-D with "
                         f"{names or None}: e.g. init_device_mesh(device_type, (n_replicas, "
                         f"shard_size), mesh_dim_names={MESH_DIMS})")
    if mesh.size() != world_size:
        raise ValueError(f"device_mesh holds {mesh.size()} ranks but the world has "
                         f"{world_size}: hybrid sharding's groups must tile the world")
    return mesh.get_group("shard"), mesh.get_group("replicate")


def _members(group) -> Optional[List[int]]:
    """The global ranks of `group` in group-rank order, or None if this rank is not in it."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    try:
        if dist.get_rank(group) < 0:
            return None
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except (RuntimeError, ValueError):
        return None


def check_mesh(per_rank: Sequence[Dict[str, Optional[List[int]]]]) -> Optional[str]:
    """What is wrong with the groups every rank passed ({"shard": ranks, "replicate": ranks},
    in group-rank order; None where the rank is not in the group it passed), or None when they
    form a grid whose columns join the ranks holding the same shard. Pure: the same answer on
    every rank."""
    n = len(per_rank)
    for kind, keyword in (("shard", "process_group"), ("replicate", "replicate_group")):
        missing = [r for r, e in enumerate(per_rank) if e[kind] is None]
        if missing:
            return (f"rank(s) {missing} are not members of the {keyword} they passed: every "
                    f"rank passes its own {kind} group (one that holds it)")
        for r, e in enumerate(per_rank):
            for q in e[kind]:
                if not 0 <= q < n:
                    return (f"rank {r}'s {keyword} holds rank {q}, outside the world of {n}: "
                            "hybrid sharding's groups must tile the world")
                if sorted(per_rank[q][kind]) != sorted(e[kind]):
                    return (f"ranks {r} and {q} passed different {keyword}s ({sorted(e[kind])} "
                            f"and {sorted(per_rank[q][kind])}): the {kind} groups must not "
                            "overlap")
        sizes = sorted({len(e[kind]) for e in per_rank})
        if len(sizes) > 1:
            return f"the {kind} groups have different sizes {sizes}: they must tile the world"
    shard_size, replicas = len(per_rank[0]["shard"]), len(per_rank[0]["replicate"])
    if shard_size * replicas != n:
        return (f"{replicas} replicas of a shard group of {shard_size} ranks make "
                f"{shard_size * replicas} ranks, not the world's {n}: each replicate group "
                "must hold one rank of every shard group")
    for e in per_rank:
        column = e["replicate"]
        rows = {tuple(sorted(per_rank[q]["shard"])) for q in column}
        if len(rows) != len(column):
            return (f"replicate group {column} holds two ranks of one shard group: each "
                    "replicate group must hold one rank of every shard group")
        held = {q: per_rank[q]["shard"].index(q) for q in column}
        if len(set(held.values())) > 1:
            return (f"replicate group {column} joins ranks that hold different shards (their "
                    f"ranks in their shard groups: {held}): order the shard groups so that "
                    "the k-th rank of each is in the same replicate group")
    return None


def make_hybrid_executor(process_group, replicate_group, device_mesh, hybrid,
                         device: torch.device, executor="auto") -> Optional[HybridExecutor]:
    """The HybridExecutor the keywords ask for, or None when they ask for no hybrid sharding
    (only process_group=, or nothing). Collective over the world when they do; every refusal
    is the same error on every rank."""
    check_keywords(process_group, replicate_group, device_mesh, hybrid)
    if not wants_hybrid(replicate_group, device_mesh, hybrid):
        return None
    if not isinstance(executor, str):
        raise TypeError("an executor object cannot be combined with hybrid sharding; pass "
                        "executor='auto', 'torch' or 'nccl' and the groups")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hybrid sharding needs torch.distributed: call "
                           "torch.distributed.init_process_group() (e.g. under torchrun) first")
    from zero_py.collectives import make_executor  # the seam (collectives/__init__.py)
    from zero_py.optim import agreement

    world = make_executor(None, device, "torch", label="world")
    # first, in the form of the plain path's first exchange (a digest all-gather over the
    # group, the world by default): a rank that asks for no hybrid sharding, or for it another
    # way, is then a ValueError on every rank, not gloo aborting on messages of other sizes
    agreement.check(world, [("hybrid sharding", {
        "hybrid": hybrid, "device_mesh": device_mesh is not None,
        "process_group with replicate_group": replicate_group is not None})],
        "hybrid sharding (hybrid=, device_mesh=, replicate_group=)")
    if hybrid == "node":
        process_group, replicate_group = _node_groups(world)
    elif device_mesh is not None:
        process_group, replicate_group = _mesh_groups(device_mesh, world.world_size)
    mine = {"shard": _members(process_group), "replicate": _members(replicate_group)}
    everyone = gather_json(world, mine, dst=None)
    problem = check_mesh(everyone)
    if problem is not None:
        raise ValueError(f"hybrid sharding: {problem}")
    root = everyone[0]["shard"]
    rows = sorted({tuple(e["shard"]) for e in everyone}, key=min)
    # the replicate all-reduces start when a poll finds their reduce-scatter done, a moment
    # that differs per rank: on a group of their own, no other collective (the user's on
    # replicate_group, another optimizer's) can come between them on one rank and not another
    entry = _own_group(world, mine["replicate"], replicate_group)
    replicate = make_executor(entry[0], device, executor, label="replicate")
    weakref.finalize(replicate, _free, entry)
    return HybridExecutor(make_executor(process_group, device, executor), replicate, world,
                          root, [list(g) for g in rows])

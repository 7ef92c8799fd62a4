"""What every rank announces at the start of a pass, a step, a stage-3 forward or a gathered
access, compared across ranks in one small all-reduce (Count).

Under stages 2-3 each backward pass and each step is a sequence of collectives; a rank that ran
one pass more, or called a collective gathered access alone, would pair its collectives with
other ones on its peers (wrong sums, or a hang). So GradReducer (sharding/reducer.py) begins
each of them with a Count: every rank fills its own row (what it is starting, its step, its
pass, whether it refuses to go on, and at a step the fingerprint of its param groups' settings)
and one all-reduce gives every rank all rows (a MAX: every value is >= 0 and the other ranks'
rows are zeros, so MAX gives what SUM would; the executor's all_reduce_max, whose only
per-step caller was the used mask before it rode here, stays exercised every step). Rows
that differ raise the same error on every rank, naming each rank's count, before any
mismatched collective is waited for.
Stage 1 counts no passes; its step still compares the param groups' settings in a Count.
Other small control data rides in further columns of the same all-reduce (sharding/riders.py):
a Count is the one control collective of each point where the ranks must agree.
What a count announces also says what the ranks must agree on beyond the numbers: a stage-3
training forward and a stage-3 backward whether it runs inside no_sync(), a reduced pass
whether it reduces gradients accumulated inside no_sync() (stage 2's backwards inside it
announce nothing), and the finish of the reductions whether clip_grad_norm_ or step() started
it. A pass's count is checked before the pass launches its first reduction, so a refused pass
leaves no collective unmatched and the group goes on.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from zero_py.collectives.stats import control
from zero_py.collectives.work import CollectiveError, issue
from zero_py.sharding.riders import Riders

# what a rank announces at the start of a pass or a step (Count)
PASS, STEP, PASS_WITHOUT_BACKWARD, FORWARD, EVAL_FORWARD, STEP_STRAY, GATHERED = (
    1, 2, 3, 4, 5, 6, 7)
# stage 3: a training forward inside no_sync(), and a backward inside no_sync()
FORWARD_NO_SYNC, PASS_NO_SYNC = 8, 9
# the finish of the reductions that clip_grad_norm_ starts (step() after it finishes nothing):
# a rank that clips where another goes on to step() meets that step's count, not a collective
# of another size or group (a hang until the group's timeout)
CLIP = 10
# a reduced pass that takes gradients accumulated inside no_sync() since the last one (or
# step(), or zero_grad()): its peers must be reducing such gradients too, or be inside no_sync()
PASS_AFTER_NO_SYNC = 11
_NO_SYNC = {FORWARD_NO_SYNC: FORWARD, PASS_NO_SYNC: PASS, PASS_AFTER_NO_SYNC: PASS}
_KIND_NAMES = {PASS: "backward pass", STEP: "step()",
               PASS_WITHOUT_BACKWARD: "step() without a backward since the last step",
               STEP_STRAY: "step() with a param.grad set after the last reduced backward",
               FORWARD: "forward", EVAL_FORWARD: "no_grad forward",
               GATHERED: "model.state_dict(), zero_py.full_state_dict() or zero_py.gathered()",
               FORWARD_NO_SYNC: "forward inside no_sync()",
               PASS_NO_SYNC: "backward inside no_sync()",
               PASS_AFTER_NO_SYNC: "backward pass reducing gradients accumulated inside "
                                   "no_sync()",
               CLIP: "clip_grad_norm_()"}

# a Count's own columns: what, step, pass, refused, hyperparameters' fingerprint
_OWN = 5

# what every rank is told when one called a collective gathered access alone
_CALL_ON_EVERY_RANK = (
    "Under stage 3, model.state_dict(), zero_py.full_state_dict() and zero_py.gathered() "
    "gather the parameters collectively where the ranks do not share one host's memory "
    "(several hosts, CUDA, or ZP_SHM=0), so every rank of the group must call them, at the "
    "same point: e.g. `sd = model.state_dict()` on every rank, then `if rank == 0: "
    "torch.save(sd, path)`; or `sd = zero_py.full_state_dict(model)` on every rank (the "
    "values on rank 0, None elsewhere); a Hugging Face model's save_pretrained(path) called "
    "on every rank writes the files on rank 0 only. On one host with shared memory (the "
    "default for CPU ranks) a read-only access gathers alone and one rank may call it. "
    "Under stages 1-2 with quantized_weights, zero_py.full_state_dict() gathers the exact "
    "values collectively: call it on every rank.")


class Count:
    """Every rank's (what, step, pass, refused) in one MAX all-reduce (each rank fills its own
    row). `problem`: why this rank refuses to go on (e.g. its model was cast after
    zero_py.initialize), raised on every rank by check(). `what`: the gathered access a
    GATHERED count announces, in words."""

    def __init__(self, executor, kind: int, step: int, passes: int,
                 problem: Optional[str] = None, what: Optional[str] = None,
                 hyper: Optional[Tuple[int, Callable[[], str]]] = None,
                 riders: Optional[Riders] = None):
        # hybrid sharding: every replica's ranks (a replica out of step would pair its
        # replicate all-reduces with other ones)
        executor = getattr(executor, "world", executor)
        self.kind, self.step, self.passes = kind, step, passes
        self.problem, self.what = problem, what
        # a step's hyperparameters: (their fingerprint, a callable: this rank's in words)
        self.hyper = hyper
        # what rides on this count (riders.py): the same columns on every rank, filled or not
        self.riders = riders
        width = riders.width if riders is not None else 0
        ws = executor.world_size
        self.rows = torch.zeros(ws, _OWN + width, dtype=torch.int64, device=executor.device)
        mine = torch.zeros(_OWN + width, dtype=torch.int64)
        mine[:_OWN] = torch.tensor(
            [kind, step, passes, problem is not None, hyper[0] if hyper else 0],
            dtype=torch.int64)
        extra = riders.payload() if riders is not None else None
        if extra is not None:
            mine[_OWN:] = extra
        # copied in without blocking: a blocking copy to a device would wait for the work
        # queued on the stream (the forward, at the start of each backward)
        self.rows[executor.rank].copy_(mine, non_blocking=True)
        if kind == GATHERED:
            name = (f"the all-reduce that starts {what} (which gathers collectively here: "
                    "every rank of the group must call it)")
        else:
            name = f"all-reduce of the ranks' pass counts at the start of a {_KIND_NAMES[kind]}"
        with control():
            self.work = issue(name, executor.all_reduce_max, self.rows)
        self.rank = executor.rank

    def check(self) -> None:
        try:
            self.work.wait()
        except CollectiveError as exc:
            if self.kind != GATHERED:
                raise
            # a rank that called it alone: the peers ran no collective of this group
            err = CollectiveError(f"the all-reduce that starts {self.what}", exc.reason)
            err.args = (
                f"zero_py: {self.what} was called on this rank (rank {self.rank}) but not on "
                "every rank of the group: the all-reduce that starts it did not complete "
                f"within the process group's timeout ({exc.reason}). {_CALL_ON_EVERY_RANK}",)
            raise err from exc
        # one copy to the host: the riders read their columns from it
        host = self.rows.cpu()
        listed = host.tolist()
        rows = [r[:_OWN] for r in listed]
        refused = [q for q, r in enumerate(rows) if r[3]]
        if refused:
            if self.problem is not None:
                raise RuntimeError(self.problem)
            ranks = ", ".join(map(str, refused))
            raise RuntimeError(
                f"zero_py: rank{'s' if len(refused) > 1 else ''} {ranks} refused this "
                f"{_KIND_NAMES.get(self.kind, self.kind)} (this is rank {self.rank}): the model "
                "was changed there after zero_py.initialize (a parameter cast, moved or "
                "replaced); see the error on that rank. Cast and move the model before "
                "zero_py.initialize")
        if all(r[:4] == rows[0][:4] for r in rows) and self.hyper is not None:
            differ = [q for q, r in enumerate(rows) if r[4] != rows[self.rank][4]]
            if differ:
                raise RuntimeError(
                    "zero_py: the optimizer's hyperparameters differ between ranks at this "
                    f"step (this is rank {self.rank}; rank{'s' if len(differ) > 1 else ''} "
                    f"{', '.join(map(str, differ))} hold{'' if len(differ) > 1 else 's'} "
                    "other values): each rank updates its own shard of the model, so its "
                    "parts would train with different settings. "
                    f"This rank's param_groups: {self.hyper[1]()}. A scheduler must see the "
                    "same input on every rank: e.g. step ReduceLROnPlateau on a metric "
                    "all-reduced across ranks, and change param_groups (and load a loss "
                    "scaler's state) alike on every rank")
        if all(r[:4] == rows[0][:4] for r in rows):
            if self.riders is not None:
                self.riders.deliver(host[:, _OWN:], [r[_OWN:] for r in listed])
            return
        said = "; ".join(
            f"rank {q}: {_KIND_NAMES.get(k, k)} number {p} in step {st}"
            if k in (FORWARD, EVAL_FORWARD, PASS, FORWARD_NO_SYNC, PASS_NO_SYNC,
                     PASS_AFTER_NO_SYNC) else
            f"rank {q}: {self.what if q == self.rank and self.what else _KIND_NAMES[k]} in "
            f"step {st}" if k == GATHERED else
            f"rank {q}: {_KIND_NAMES.get(k, k)} after {p} backward pass{'es' if p != 1 else ''}"
            f" in step {st}" for q, (k, st, p, _, _) in enumerate(rows))
        if any(r[0] == GATHERED for r in rows):
            other = (" (the same kind of access, of different modules or with another "
                     "modifier_rank: a submodule's state_dict() or gathered() must name the "
                     "same module, and gathered() the same modifier_rank, on every rank)"
                     if all(r[0] == GATHERED and r[1] == rows[0][1] for r in rows) else "")
            raise RuntimeError(
                "zero_py: the ranks did not all start the same gathered access (this is rank "
                f"{self.rank}){other}: {said}. {_CALL_ON_EVERY_RANK}")
        clipped = [q for q, r in enumerate(rows) if r[0] == CLIP]
        if clipped and all(r[0] in (CLIP, STEP, STEP_STRAY) and r[1:3] == rows[0][1:3]
                           for r in rows):
            raise RuntimeError(
                f"zero_py: clip_grad_norm_() was called on some ranks only (this is rank "
                f"{self.rank}): {said}. The clipping norm is a collective over every rank's "
                "gradient shard (and every replica's ranks under hybrid sharding): call it on "
                "every rank, with the same arguments, before step(). Nothing was changed")
        # inside no_sync() now, or else (stage 2, which announces no backward inside it)
        # reducing what was accumulated inside it
        inside = ([q for q, r in enumerate(rows) if r[0] in (FORWARD_NO_SYNC, PASS_NO_SYNC)]
                  or [q for q, r in enumerate(rows) if r[0] == PASS_AFTER_NO_SYNC])
        if inside and all(_NO_SYNC.get(r[0], r[0]) == _NO_SYNC.get(rows[0][0], rows[0][0])
                          and r[1:3] == rows[0][1:3] for r in rows):
            # the same pass on every rank, inside no_sync() on some only: their backwards
            # would differ in collectives (a reduction on some ranks only), a hang
            outside = [q for q in range(len(rows)) if q not in inside]
            raise RuntimeError(
                f"zero_py: no_sync() was entered on some ranks only (this is rank {self.rank}; "
                f"inside no_sync(): rank{'s' if len(inside) > 1 else ''} "
                f"{', '.join(map(str, inside))}; outside: rank{'s' if len(outside) > 1 else ''}"
                f" {', '.join(map(str, outside))}): {said}. A backward outside no_sync() "
                "reduces the gradients collectively (under stage 2 bucket by bucket during "
                "backward, under stage 3 after gathering the parameters collectively) and one "
                "inside it does not, so every rank must enter no_sync() together, around the "
                "same forwards and backwards (e.g. a gradient-accumulation counter that counts "
                "the same on every rank, not `if rank == 0: with model.no_sync(): ...`). "
                "Nothing was reduced or updated by this call: call optimizer.zero_grad() on "
                "every rank to drop the gradients held since the last step, then go on"
                + (" (a zero_grad() on some ranks only, after backwards inside no_sync() on "
                   "every rank, also drops them there alone: call it alike on every rank)"
                   if rows[inside[0]][0] == PASS_AFTER_NO_SYNC else ""))
        raise RuntimeError(
            "zero_py: the ranks ran different numbers of forward or backward passes per step "
            f"(this is rank {self.rank}): {said}. Every rank must run the same number of "
            "backward passes per step (outside no_sync()) and, under stage 3, the same "
            "forwards (a no_grad forward of one rank alone needs every rank on one host, and "
            "not between clip_grad_norm_() and step(), where peers may be writing their "
            "shards); a "
            "rank with no data can run forward and backward on an empty batch or a zero loss "
            "(e.g. model(x[:0]).sum() * 0)")

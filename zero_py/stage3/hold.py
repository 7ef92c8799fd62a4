"""Holding stage-3 units gathered for user code: zero_py.gathered(), state dicts and loads
(Stage3Engine.hold). The units are gathered exactly (never quantized copies), kept for the
block, and freed after it; with a modifier rank its values are broadcast into every rank's
shards on exit, and without one an edit made in the block is refused rather than dropped
(stage3/user_edits.py).

Invariant: on exit every unit the block opened is freed, and a unit gathered before it
(persistent, or an enclosing block's) holds the values it held before, or the new values where
a modifier rank wrote them.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from zero_py.collectives import quantized
from zero_py.stage3.user_edits import (adopt_replaced_data, check_modifier_rank,
                                       param_versions, refuse_dropped_writes)


# a backward of a forward run inside a block (grad enabled): the units' gradients cannot be
# reduced as outside it (the reducer's hooks raise this until the next forward of the model)
TRAINING_FORWARD_HELD = (
    "zero_py stage 3: a backward of a forward run inside `zero_py.gathered(model)` with grad "
    "enabled: the block holds units gathered for reading or editing weights between steps, "
    "and their gradients cannot be reduced as a forward outside it has them. Run the training "
    "forward and backward outside the block (a forward inside it is fine without a backward, "
    "e.g. under torch.no_grad())")


@contextlib.contextmanager
def hold_units(engine, wanted: Sequence[int], modifier_rank: Optional[int] = None,
               what: str = "zero_py.gathered()", announced: bool = False):
    """Stage3Engine.hold (`engine`): gathered() by unit ids. Read-only (no `modifier_rank`)
    where reads_alone(), this rank gathers from the peers' shards alone; otherwise
    collective, announced first unless the caller did (`announced`: one announcement for a
    whole state dict)."""
    engine.refuse_inside_pass(what)
    check_modifier_rank(what, modifier_rank, engine.executor.world_size)
    alone = modifier_rank is None and engine.reads_alone()
    if not alone and not announced:
        engine.announce(what, wanted, modifier_rank)
    opened = [u for u in wanted if not engine.is_gathered(u)]
    # memory_report's gathered_peak is training's working set: what the caller holds
    # here (up to the whole model) is the caller's, and is not counted in it
    meter = engine.flat.meter
    peak_before = meter.peak_bytes
    # exact: what a state dict exports, and what a modifier rank's broadcast writes into
    # every rank's shards, are the parameters themselves, never their quantized copies
    # (quantized_weights: those would replace the peers' shards with a rounded version).
    # A unit gathered already (the persistent parameters) holds such copies, as the last
    # publish left them: it is gathered exactly for the block and given back its copies
    # after, so that training goes on from them as it would have.
    kept = ([u for u in wanted if u not in opened]
            if any(quantized.weights_quantized(s.executor) for s in engine.storages) else [])
    saved = {}
    for u in kept:
        engine._wait(u)
        saved.update({(k, b): s.full_buffer(b).clone() for k, s in enumerate(engine.storages)
                      for b in s.unit_buckets[u]})
    for u in opened + kept:
        engine._gather(u, alone=alone, exact=True)
        if alone and u in opened:  # peers may not hold it: a step inside it refreshes it
            for s in engine.storages:
                s.held_alone.update(s.unit_buckets[u])
    for u in wanted:  # a unit gathered ahead by a forward that raised may be in flight
        engine._wait(u)
    outer = set().union(*engine._held)
    engine._held.append(set(wanted))
    modified = False
    versions = param_versions(engine.storages, wanted) if modifier_rank is None else None
    try:
        yield
        adopt_replaced_data(engine.storages, wanted, modifier=modifier_rank is not None)
        if versions is not None:
            refuse_dropped_writes(engine.storages, wanted, versions)
        if modifier_rank is not None:
            with torch.no_grad(), contextlib.ExitStack() as writing:
                for s in engine.storages:  # one-sided readers wait for the writes
                    writing.enter_context(s.writing())
                for u in wanted:
                    pending = [(s, b, s.executor.broadcast(s.full_buffer(b), modifier_rank))
                               for s in engine.storages for b in s.unit_buckets[u]]
                    for s, b, work in pending:
                        work.wait()
                        s.load_pieces_from(b, s.full_buffer(b))
            modified = True
    finally:
        engine._held.pop()
        for u in opened:
            engine._free(u)
        for u in kept:
            if modified:  # the new values, as a publish leaves them (no step publishes
                # frozen parameters: theirs stay exact, as construction made them)
                for work in [s.gather(b, exact=u in outer or s is not engine.flat)
                             for s in engine.storages for b in s.unit_buckets[u]]:
                    work.wait()
            elif u not in outer:  # an enclosing block keeps its exact values
                with torch.no_grad():
                    for k, s in enumerate(engine.storages):
                        for b in s.unit_buckets[u]:
                            s.full_buffer(b).copy_(saved[(k, b)])
        meter.peak_bytes = max(peak_before, meter.bytes)

"""A managed model's full values, for every stage: zero_py.gathered() (full parameters inside a
block, a modifier rank's edits broadcast on exit) and zero_py.full_state_dict() (the state dict
with full tensors on one rank). Under stage 3 they go through the engine and
stage3/state_dict.py; under stages 1-2 the parameters are already whole."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional, Set, Tuple

import torch
import torch.nn as nn

from zero_py.collectives import quantized
from zero_py.optim import compat
from zero_py.optim.optimizer import ZeroOptimizer
from zero_py.stage3 import state_dict as stage3_state_dict
from zero_py.stage3.engine import Stage3Engine
from zero_py.stage3.user_edits import check_modifier_rank


def _managed_by(model_or_params) -> Tuple[Optional[ZeroOptimizer], Optional[Set[int]]]:
    if isinstance(model_or_params, nn.Module):
        opt = compat.manager_of(model_or_params)
        return opt, {id(p) for p in model_or_params.parameters()}
    return None, {id(p) for p in model_or_params}


def _engine(opt) -> Optional[Stage3Engine]:
    return getattr(opt, "_engine", None)


@contextlib.contextmanager
def gathered(module_or_params, modifier_rank: Optional[int] = None, *,
             optimizer: Optional[ZeroOptimizer] = None):
    """Full parameters inside the block. Every rank enters it with the same arguments, except
    under stage 3 without a modifier rank where the ranks share one host's memory (CPU ranks
    on gloo, the default): there each rank reads every rank's shards on its own, and one rank
    may enter it alone (see zero_py/stage3/state_dict.py). Elsewhere a rank that enters it
    alone raises (after the process group's timeout at the latest).

    `module_or_params`: a model given to zero_py.initialize, one of its submodules, or some of
    its parameters (then pass `optimizer=`, the one initialize returned, unless the model
    itself is given). With `modifier_rank=r`, rank r's edits made in the block (under
    torch.no_grad()) are broadcast and become every rank's parameters (shards and fp32 masters)
    on exit; without it, edits are discarded. Under stages 1-2 the parameters are always full;
    the block then only applies the modifier rank's edits."""
    opt, ids = _managed_by(module_or_params)
    opt = optimizer or opt
    if opt is None:
        raise ValueError("zero_py.gathered needs the model given to zero_py.initialize, or "
                         "optimizer= (what initialize returned) with a submodule or parameters")
    engine = _engine(opt)
    if engine is not None:
        with engine.gathered(ids, modifier_rank):
            yield
        if modifier_rank is not None:
            opt.sync_master_from_params()
        return
    # before the block: found by the broadcast on exit, the ranks had kept their own edits
    check_modifier_rank("zero_py.gathered()", modifier_rank, opt.executor.world_size)
    fp = opt._flat
    requantize = modifier_rank is not None and quantized.weights_quantized(opt._wire)
    buckets = sorted({fp.param_bucket[i] for i, p in enumerate(fp.params) if id(p) in ids})
    if requantize:
        # quantized_weights: the peers' pieces here are quantized copies, which the broadcast
        # below would make every rank's own pieces; the block starts from the exact values
        with torch.no_grad():
            fp.all_gather(opt.executor, buckets)
    try:
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                # a parameter given new values as a whole in the block (`p.data = t`, as
                # vector_to_parameters does) is an edit too: into the flat buffer, where the
                # broadcast and the step read it (step() would refuse it otherwise)
                for i in fp.moved_params():
                    p = fp.params[i]
                    if id(p) in ids and p.numel() == fp.param_numel[i]:
                        view = fp.param_view(i)
                        view.copy_(fp.flat_of(i, p.data))
                        p.data = fp.shaped(i, view)
                for i, p in enumerate(fp.params):
                    if id(p) in ids:  # its flat range: 1-D and dense, whatever its strides
                        whole = p.numel() == fp.param_numel[i]
                        opt.executor.broadcast(fp.param_view(i) if whole else p.data,
                                               modifier_rank).wait()
            opt.sync_master_from_params()
    finally:
        if requantize:  # the copies as a publish of the (new) pieces leaves them
            with torch.no_grad():
                fp.all_gather(opt._wire, buckets)


def full_state_dict(model: nn.Module, rank: int = 0) -> Optional[Dict[str, torch.Tensor]]:
    """The model's state_dict with full tensors (cloned, on the CPU) on group rank `rank`, None
    elsewhere. Under stage 3 the units are gathered one at a time. Collective: every rank
    calls it, except under stage 3 where the ranks share one host's memory (then `rank` may
    call it alone; see zero_py/stage3/state_dict.py). The values are the trained ones, exact,
    with quantized_weights too (stages 1-2: where model.state_dict() holds the peers' pieces
    as the wire's copies)."""
    opt = compat.manager_of(model)
    if opt is None:
        raise ValueError("full_state_dict needs a model given to zero_py.initialize")
    engine = _engine(opt)
    if engine is not None:
        with opt._comm.outside():  # its gathers are in no step's comm_stats
            return stage3_state_dict.full_state_dict(model, engine, rank)
    if quantized.weights_quantized(opt._wire):
        with opt._comm.outside():
            return _exact_flat_state_dict(model, opt, rank)
    if opt.executor.rank != rank:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _exact_flat_state_dict(model: nn.Module, opt: ZeroOptimizer, rank: int
                           ) -> Optional[Dict[str, torch.Tensor]]:
    """Stages 1-2 with quantized_weights: every rank holds its peers' pieces as int8 (or bf16)
    copies, so the trained values are put together from every rank's own pieces, all-gathered
    exactly (collective: announced first, so that a rank calling it alone raises instead of
    waiting for ever)."""
    fp = opt._flat
    opt._reducer.announce_gathered("zero_py.full_state_dict()")
    regions = {b: torch.empty_like(fp.bucket_region(b)) for b in range(fp.n_buckets)}
    with torch.no_grad():
        for work in [opt.executor.all_gather(regions[b], fp.bucket_piece(b)) for b in regions]:
            work.wait()
    if opt.executor.rank != rank:
        return None
    exact = {id(p): fp.shaped(i, regions[fp.param_bucket[i]][
                 fp.param_offset[i]:fp.param_offset[i] + fp.param_numel[i]])
             for i, p in enumerate(fp.params)}
    return {k: exact.get(id(v), v).detach().to("cpu", copy=True)
            for k, v in model.state_dict(keep_vars=True).items()}

"""ZeroOptimizer's state dicts (a mixin of zero_py/optim/optimizer.py): this rank's shard in
torch's format, the consolidated torch-format dict, loading either at any world size, and the
per-slice views that checkpoints (zero_py/checkpoint/) read and fill.

The state dicts run with the optimizer resident (ZeroOptimizer.resident(): under
offload_optimizer="nvme" the shard's masters and states are read in for the call and written
back after it: a state dict is in memory anyway). Checkpoints of such an optimizer stream its
records instead (zero_py/checkpoint/offloaded.py) and use the per-slice views only when
resident. The dict formats and their checks are in state_dict.py.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional

import torch

from zero_py import kernels
from zero_py.collectives import gather_object
from zero_py.optim import agreement, dcp
from zero_py.optim import state_dict as sd_util
from zero_py.optim.streamed import StreamedUpdate
from zero_py.optim.update import (BUFFER, MAX_SQ, added_state, fused_kind,
                                  optional_state, refuse_unhonoured_options, state_keys)
from zero_py.sharding.memory_order import MemoryOrder

_STEP_IN_STATE = (kernels.OPT_ADAMW, kernels.OPT_ADAM, kernels.OPT_ADAGRAD)


def rounding_seed_base_of(rank: int) -> int:
    """Rank `rank`'s stochastic-rounding seed before its first step (the seed counts steps)."""
    return 0x5EED + 7919 * rank


def _rounds_to(master: torch.Tensor, piece: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Where the bf16/fp16 `piece` is a rounding of the fp32 `master`: the nearest, or under
    stochastic rounding either neighbour (bf16 only: stochastic_rounding leaves fp16
    parameters rounded to nearest, so an fp16 write to the other neighbour is followed)."""
    nearest = master.to(piece.dtype)
    same = nearest == piece
    if stochastic and piece.dtype == torch.bfloat16:
        away = torch.where(master > nearest.float(), float("inf"), float("-inf"))
        same |= torch.nextafter(nearest, away.to(piece.dtype)) == piece
    return same


class StateDicts:
    """The state-dict half of ZeroOptimizer (it reads the optimizer's layout, updater, masters,
    step counts and executor)."""

    def _slice_state(self, s, copy: bool = True) -> Optional[dict]:
        """Managed parameter s.param's state on this rank (its slice, flattened), or None
        before its first step. Non-fp32 parameters carry their fp32 master as master_param.
        copy=False gives views of the live tensors (a checkpoint writes them out at once)."""
        step = self._step_count[s.param]
        if step == 0:
            return None
        state = self._update.slice_state(s, copy)
        if self.uses_fused_kernel and s.param in self._update.no_momentum_yet:
            state.pop(BUFFER, None)  # stepped without momentum only: torch.optim holds none
        if self._step_in_state():
            state = {"step": torch.tensor(float(step), dtype=torch.float32), **state}
        if "master_param" in state:  # read from NVMe with the slice's state
            return state
        master = self._masters.piece(s.bucket)
        if master is not None:
            view = master[s.piece_lo:s.piece_hi]
            state["master_param"] = view.clone() if copy else view
        return state

    def _step_in_state(self) -> bool:
        """Whether _slice_state carries the step as an fp32 tensor (torch.optim's own habit for
        these classes); a checkpoint that streams the state records it without reading it."""
        return self.uses_fused_kernel and self._kind in _STEP_IN_STATE

    def _install_slice(self, s, state: dict) -> None:
        """Slice s's state from `state` (as _slice_state gives it: per-element tensors of the
        slice, a step, optionally master_param); the fp32 master follows the parameter unless
        master_param is given."""
        self._update.install(s, state)
        self._step_count[s.param] = int(float(state.get("step", 1)))
        master = self._masters.piece(s.bucket)
        if master is not None and "master_param" in state:
            master[s.piece_lo:s.piece_hi].copy_(state["master_param"].reshape(-1))

    def _allocate_states(self, filled) -> None:
        """Fresh optimizer state for a load that is about to fill the slices `filled` through
        _state_views (fused path; the torch.optim path allocates as it installs)."""
        if self.uses_fused_kernel:
            self._update.allocate(filled)

    def _state_views(self, s) -> Optional[Dict[str, torch.Tensor]]:
        """Live views of slice s's per-element state and its fp32 master ("master_param", when
        the parameter has one), for a loader to fill in place; None on the torch.optim path,
        whose state goes through _install_slice."""
        if not self.uses_fused_kernel:
            return None
        views = self._update.state_views(s)
        master = self._masters.piece(s.bucket)
        if master is not None:
            views["master_param"] = master[s.piece_lo:s.piece_hi]
        return views

    def _rounding_seed_base(self) -> int:
        """The stochastic-rounding seed of this rank before its first step (it counts steps)."""
        return rounding_seed_base_of(self.executor.rank)

    def _groups_for_dict(self) -> List[dict]:
        index = {id(p): k for k, p in enumerate(self._all_params)}
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]

    def resident(self):
        """A context in which the optimizer's masters and states are in memory: a no-op, except
        under offload_optimizer="nvme", where they are read from the offload file on entry and
        written back on exit (state dicts run inside it; checkpoints stream the optimizer's
        records instead, unless called inside it), and under
        offload_params="nvme", where the stage-3 parameter shards are read in and written back
        the same way (ShardedParams.resident). Early updates of overlap_step not yet taken by a
        step are put back first: they are guesses."""
        return self._resident_both()

    def discard_early_updates(self, buckets=None) -> None:
        """overlap_step's early updates not yet taken by a step put back (they are guesses):
        what checkpoints and state dicts need before they read the optimizer (optimizer.state[p]
        those of p's bucket)."""
        if getattr(self, "_early", None) is not None:
            self._early.discard(buckets)

    @contextlib.contextmanager
    def params_resident(self):
        """The parameter part of resident(): early updates put back (discard_early_updates),
        and under offload_params="nvme" the stage-3 parameter shards (trainable and frozen)
        read in and written back (ShardedParams.resident)."""
        self.discard_early_updates()
        with contextlib.ExitStack() as stack:
            for storage in (self._flat, getattr(self._flat, "frozen_storage", None)):
                if getattr(storage, "nvme", None) is not None:
                    stack.enter_context(storage.resident())
            yield

    @contextlib.contextmanager
    def _resident_both(self):
        # the parameter shards first, so the optimizer's write-back at the exit can read them
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.params_resident())
            if isinstance(self._update, StreamedUpdate):
                stack.enter_context(self._update.resident())
            yield

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, in torch's format plus a "zero_py" entry
        saying which slice of each parameter it holds. Every rank saves its own. Hooks
        registered with register_state_dict_pre_hook / _post_hook run as in torch.optim.

        Called by torch.distributed.checkpoint's get_optimizer_state_dict (or set_'s, which
        reads it to place what it loads), it gives the full torch-format dict on every rank
        instead (collective there): DCP gathers only FSDP's and DTensor's shards, and would
        hand back this rank's slices under the full names (zero_py/optim/dcp.py)."""
        if dcp.caller(("_get_optim_state_dict",)) is not None:
            if self.loss_scaler is not None and not dcp.loading():
                raise ValueError(dcp.LOSS_SCALER_MESSAGE)
            full = self._full_state_dict(None)
            if dcp.loading():
                return dcp.with_placeholders(self, full)
            if self._managed_index and not any(full["state"].get(i)
                                               for i in self._managed_index):
                # the template of the torchtitan-style resume: dcp.load fills it in place
                template = dcp.template_state(self, full)
                if template is not None:
                    return template
                # as a template for dcp.load, it would silently load no optimizer state
                warnings.warn(dcp.STATELESS_MESSAGE.format(cls=self.optimizer_class.__name__),
                              stacklevel=2)
            return full
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self.resident():
            shard = self._shard_state_dict()
        return self._run_post_hooks(shard)

    def _run_post_hooks(self, state_dict: dict) -> dict:
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _shard_state_dict(self) -> dict:
        state, slices = {}, {}
        for s in self._flat.slices:
            index = self._managed_index[s.param]
            slices[index] = (s.param_lo, s.param_hi)
            st = self._slice_state(s)
            if st:  # none, as torch.optim.SGD keeps for a parameter stepped without momentum
                state[index] = self._as_torch_keeps(s, st)
        meta = {"format": sd_util.FORMAT_VERSION, "stage": self.stage,
                "world_size": self.executor.world_size, "rank": self.executor.rank,
                "optimizer": self.optimizer_class.__name__, "slices": slices,
                "rounding_seed": self._sr_seed, "dim_orders": sd_util.dim_orders(self)}
        return {"state": state, "param_groups": self._groups_for_dict(), "zero_py": meta,
                "loss_scaler": self._scaler_state()}

    def _as_torch_keeps(self, s, state: dict) -> dict:
        """Slice s's state less Adam's max_exp_avg_sq where torch.optim keeps none: in a group
        without amsgrad, for a parameter never stepped with it (its max is all zero). zero_py
        keeps the tensor for every parameter once any group has amsgrad; a dict with it for
        the other groups' parameters would not be torch.optim's (merge_shards fills the
        slices of a parameter whose max some rank left out with zeros, which they are)."""
        if (self.uses_fused_kernel and MAX_SQ in state
                and MAX_SQ in optional_state(self._kind, self.param_groups[
                    self._flat.bucket_group[s.bucket]])
                and not state[MAX_SQ].any()):
            state = {k: v for k, v in state.items() if k != MAX_SQ}
        return state

    def _scaler_state(self) -> Optional[dict]:
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else None

    def consolidate_state_dict(self, to: int = 0) -> Optional[dict]:
        """The full optimizer state dict, in torch.optim's own format (loadable by
        optimizer_class), returned on group rank `to` and None elsewhere. Collective: every rank
        must call it. State-dict pre hooks run on every rank, post hooks on the full dict.
        A `to` that is not a rank of the group, or not the same on every rank, is refused on
        every rank before anything runs (one rank out of range would have gathered on no rank
        and returned None everywhere)."""
        shard = getattr(self.executor, "shard", self.executor)  # hybrid: the group it gathers
        with self._comm.outside():  # in no step's comm_stats, as the gather below
            agreement.check(shard, [("consolidate_state_dict's to", to)],
                            "ZeroOptimizer.consolidate_state_dict")
        if (not isinstance(to, int) or isinstance(to, bool)
                or not 0 <= to < shard.world_size):
            raise ValueError(
                f"consolidate_state_dict(to={to!r}): `to` is the rank, within the optimizer's "
                f"process group of {shard.world_size}, that gets the full dict: an int from 0 "
                f"to {shard.world_size - 1} (other ranks get None); nothing was gathered")
        return self._full_state_dict(to)

    def _full_state_dict(self, to: Optional[int]) -> Optional[dict]:
        """consolidate_state_dict(to), or on every rank where `to` is None."""
        with self._comm.outside():  # in no step's comm_stats
            return self._gather_state_dict(to)

    def _gather_state_dict(self, to: Optional[int]) -> Optional[dict]:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self.resident():
            shard = self._shard_state_dict()
        # the param groups are the same on every rank (each step checks): `to` keeps its own,
        # unsent, as torch.optim's state_dict() does. gather_object reads what it receives
        # with torch.load(weights_only=True), which refuses values a group may hold (a NumPy
        # float lr written by a schedule; a set under torch 2.4): it raised on `to` alone.
        groups = shard.pop("param_groups")
        gathered = gather_object(self.executor, shard, to)
        if gathered is None:
            return None
        gathered[0]["param_groups"] = groups
        # each parameter's memory order: its state comes out shaped and strided like it
        orders = {self._managed_index[i]: order
                  for i, order in enumerate(self._flat.param_orders)}
        orders.update({k: MemoryOrder.row_major_of(p.shape)
                       for k, p in enumerate(self._all_params) if k not in orders})
        full = sd_util.merge_shards(gathered, orders)
        # parameters without elements hold no state here; torch.optim's dict has theirs (empty
        # moments and a step count), and DCP refuses to load a dict without it into a
        # torch.optim optimizer: give them the state of a parameter stepped as often as the
        # most-stepped one (their values are empty whatever the count)
        step = max(self._step_count, default=0)
        for i in dcp.empty_params(self) if step else ():
            st = dcp.empty_param_state(self, self._all_params[i], step)
            if st is not None:
                full["state"][i] = st
        full["state"] = {k: full["state"][k] for k in sorted(full["state"])}
        full["loss_scaler"] = self._scaler_state()
        # where the stochastic-rounding stream stands (the shard dicts carry it as their seed):
        # a run loaded from this dict rounds its next update as the uninterrupted run would
        full["rounding_steps"] = self._sr_seed - self._rounding_seed_base()
        return self._run_post_hooks(full)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads either this rank's shard dict (from state_dict() of a run with the same world
        size and layout) or a full torch-format dict (from consolidate_state_dict(), or from a
        plain torch.optim optimizer of the same class), at any world size. Everything is checked
        before anything changes: a dict that does not fit (missing entries, a tensor of another
        shape, another optimizer class, a bad loss-scaler state) is an error naming what differs,
        and the optimizer stays as it was. Collective: every rank loads, and the ranks check that
        they agree (a dict refused on one rank, or shard dicts saved at different steps, raise
        on every rank). Load hooks run as in torch.optim."""
        if not isinstance(state_dict, dict):
            raise TypeError("load_state_dict takes the dict that state_dict() or "
                            "consolidate_state_dict() returned (or a torch.optim optimizer's "
                            f"state_dict()), got {type(state_dict).__name__}")
        state_dict = dcp.drop_placeholders(state_dict.copy())
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        try:
            groups, shard, saved_state, scaler = sd_util.check_loadable(self, state_dict)
            problem = None
        except (TypeError, ValueError) as exc:
            problem = exc
        # every rank loads, or none: a rank whose dict is refused, or that resumes from another
        # step than its peers, makes every rank raise (one small collective, in no step's
        # comm_stats)
        with self._comm.outside():
            agreement.check(self.executor, [
                ("the loaded state dict", f"refused: {problem}" if problem else "accepted"),
                *(() if problem else self._load_entries(state_dict, shard))],
                "ZeroOptimizer.load_state_dict")
            if problem is not None:
                raise problem
            with self.resident():
                self._load_checked(state_dict, groups, shard, saved_state, scaler)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def follow_loaded_params(self) -> None:
        """The fp32 masters follow the parameters after a stage-3 model.load_state_dict (its
        load hook ends here), elementwise as follow_masters has them (an fp32 parameter's
        host copy is pulled). Masters on NVMe follow as sync_master_from_params has them."""
        if isinstance(self._update, StreamedUpdate) and not self._update.is_resident:
            self.sync_master_from_params()
            return
        self.discard_early_updates()
        if self._host is not None:
            self._host.pull_params()
        self.follow_masters()
        if self._written is not None:
            self._written.mark()

    def follow_masters(self, buckets=None) -> None:
        """The bf16/fp16 parameters' fp32 masters (of `buckets`, or all) follow the
        parameters where a write gave them other values: elementwise, a master whose rounding
        is the parameter's value is kept. torch.distributed.checkpoint's set_state_dict loads
        the optimizer before the model: the loaded masters (master_param) must survive the
        model's load of their own roundings (copied, as sync_master_from_params does, they
        lost their low bits: a resumed bf16 run was up to 1 ulp off the one that never
        stopped). With stochastic_rounding, either neighbour of the master is its rounding."""
        with torch.no_grad():
            for b in range(self._flat.n_buckets) if buckets is None else buckets:
                master = self._masters.piece(b)
                if master is not None:
                    piece = self._flat.bucket_piece(b).to(master.device)
                    torch.where(_rounds_to(master, piece, self.stochastic_rounding), master,
                                piece.float(), out=master)

    def _load_checked(self, state_dict: dict, groups: List[dict], shard: bool,
                      saved_state: dict, scaler: Optional[dict]) -> None:
        """load_state_dict's changes, once every rank accepted the dict."""
        self._set_hyperparameters(groups)
        if shard:
            self._sr_seed = int(state_dict["zero_py"].get("rounding_seed", self._sr_seed))
        elif state_dict.get("rounding_steps") is not None:
            self._sr_seed = self._rounding_seed_base() + int(state_dict["rounding_steps"])
        if scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self._step_count = [0] * len(self._step_count)
        self._had_grad = [0] * len(self._had_grad)
        self._update.reset()
        if self.uses_fused_kernel:
            self._update.add_keys(self._state_to_add(self.param_groups))
        self.sync_master_from_params()
        for s in self._flat.slices:
            st = saved_state.get(self._managed_index[s.param])
            if not st:
                continue
            if not shard:
                st = sd_util.slice_full_state(st, s.param_lo, s.param_hi,
                                              self._flat.param_orders[s.param])
            self._install_slice(s, st)
        self._share_step_counts()

    def _share_step_counts(self) -> None:
        """Every rank's step count of every parameter, after a load that set only those of the
        slices this rank holds: each rank counts every parameter's steps as they run (a
        checkpoint's manifest, written by rank 0, records them all), so a parameter held wholly
        by another rank would otherwise count 0 steps here, and save_checkpoint would write a
        manifest that says it has no state, beside the file holding it."""
        if not self._step_count:
            return
        counts = torch.tensor(self._step_count, dtype=torch.int64, device=self.executor.device)
        self.executor.all_reduce_max(counts).wait()
        self._step_count = [int(c) for c in counts.tolist()]

    def _load_entries(self, state_dict: dict, shard: bool) -> List[tuple]:
        """What must match across ranks in a loaded dict: its kind, the hyperparameters, the
        loss-scaler state and, for shard dicts (one file per rank), the number of updates the
        saving rank had applied (its rounding seed counts them)."""
        entries = [("the loaded dict's kind", "shard" if shard else "full"),
                   ("the loaded param groups", [{k: v for k, v in g.items() if k != "params"}
                                                for g in state_dict["param_groups"]]),
                   ("the loaded loss scaler", state_dict.get("loss_scaler")
                    if self.loss_scaler is not None else None)]
        if shard:
            meta = state_dict["zero_py"]
            base = rounding_seed_base_of(int(meta["rank"]))
            seed = meta.get("rounding_seed")
            entries.append(("updates applied before the save",
                            None if seed is None else int(seed) - base))
        else:
            entries.append(("updates applied before the save",
                            state_dict.get("rounding_steps")))
        return entries

    def _check_hyperparameters(self, saved_groups: List[dict]) -> List[dict]:
        """The param groups with `saved_groups`' hyperparameters (params kept), checked to fit
        this optimizer's update path and state; changes nothing."""
        new = [{**group, **{k: v for k, v in saved.items() if k != "params"}}
               for group, saved in zip(self.param_groups, saved_groups)]
        refuse_unhonoured_options(new)
        if (fused_kind(self.optimizer_class, new) is None) == self.uses_fused_kernel:
            raise ValueError("the loaded hyperparameters (e.g. a tensor lr, differentiable) need "
                             "another update path than this optimizer was built with; construct "
                             "ZeroOptimizer with the same options as the saved run")
        keys = state_keys(self._kind, new) if self.uses_fused_kernel else None
        if keys is not None and keys != self._update.keys:
            # a momentum switched on after construction (OneCycleLR) adds SGD's buffer, as a
            # step with it would; any other difference is refused
            extra = added_state(self._kind, self._update.keys, new)
            if not extra or keys != self._update.keys + extra:
                raise ValueError("the loaded hyperparameters need other optimizer state than "
                                 "this optimizer keeps (e.g. amsgrad switched on, or momentum "
                                 "switched off); construct ZeroOptimizer with the same options "
                                 "as the saved run")
            self._state_to_add(new)  # refused where the state's layout is fixed
        return new

    def _set_hyperparameters(self, groups: List[dict]) -> None:
        """Takes checked groups (_check_hyperparameters); the group dicts stay the same objects
        (LR schedulers and the updaters hold them)."""
        for group, new in zip(self.param_groups, groups):
            group.update({k: v for k, v in new.items() if k != "params"})

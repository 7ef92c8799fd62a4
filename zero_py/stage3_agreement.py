"""What the ranks agree on before stage 3 shards anything (optim/agreement.py): the arguments
(or the refusal of one rank), the settings, every parameter with its unit and param group, the
buffers (agree_stage3); and, under offload_params="nvme", the parameter file: its arguments
checked (check_params_on_nvme), its factory (param_file) and every rank having made it
(agree_param_file)."""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch
import torch.nn as nn

from zero_py.buffers import buffer_entries
from zero_py.offload import ParamStore, check_offload_dir
from zero_py.optim import agreement
from zero_py.optim.arguments import fingerprint
from zero_py.optim.optimizer import ZeroOptimizer


def param_groups(params) -> List[dict]:
    """Param groups as torch.optim normalizes them: a list of dicts with a list of params."""
    groups = list(params)
    if not groups:
        return []
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        ps = g["params"]
        out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return out



def check_params_on_nvme(kwargs: dict) -> None:
    """offload_params="nvme" needs the optimizer on NVMe too, with an offload_dir."""
    if kwargs.get("offload_optimizer") != "nvme":
        raise ValueError(
            "offload_params='nvme' needs offload_optimizer='nvme' (with the same offload_dir): "
            "the step updates each bucket's parameters and optimizer states together and flips "
            "both files only when every write has landed, so a failed write keeps the last good "
            f"step; got offload_optimizer={kwargs.get('offload_optimizer')!r}. Pass "
            "offload_optimizer='nvme', or offload_params='cpu'")
    if kwargs.get("offload_dir") is None:
        raise ValueError("offload_params='nvme' needs offload_dir=PATH: a directory on the NVMe "
                         "drive for the parameter and optimizer files")
    check_offload_dir(kwargs["offload_dir"], "offload_params")


def param_file(offload_dir, rank: int, what: str):
    """The factory of a ShardedParams' ParamStore (offload_params="nvme")."""
    return lambda flat: ParamStore(flat, offload_dir, rank, what)


def agree_param_file(executor, flat) -> None:
    """After each rank tried to make its parameter file: every rank goes on, or every rank
    raises (the rank that failed its own OSError, the others an error naming it)."""
    problem = getattr(flat, "param_file_error", None)
    try:
        agreement.check(executor, [("the NVMe parameter file", f"failed: {problem}"
                                    if problem else "made")],
                        "zero_py.initialize(offload_params='nvme')")
    except ValueError:
        if problem is not None:
            raise problem from None
        raise
    if problem is not None:
        raise problem



# ZeroOptimizer's own settings (the rest of initialize's keywords go to the optimizer class)
_ZERO_OPTIONS = ("bucket_bytes", "align_bytes", "grad_reduce_dtype", "loss_scaler",
                 "stochastic_rounding", "offload_optimizer")



def agree_stage3(model: nn.Module, executor, optimizer_class, groups: Optional[List[dict]],
                  units, unit_of, kwargs: dict, stage3_options: dict,
                  problem: Optional[Exception]) -> None:
    """Stage 3's agreement (optim/agreement.py), before the first gather or broadcast: whether
    the arguments were accepted, the settings, every parameter with its unit (the wrap
    policy's result), the buffers."""
    if problem is not None:
        agreement.check(executor, [("arguments", f"refused: {problem}")], "zero_py.initialize")
        return
    defaults = inspect.signature(ZeroOptimizer.__init__).parameters
    options = {k: kwargs.get(k, defaults[k].default) for k in _ZERO_OPTIONS}
    # offload_dir is a local path: each rank may use its own drive
    options.update({k: v for k, v in kwargs.items() if k not in options and k != "offload_dir"})
    options.update(stage3_options)
    if groups is None:  # a meta model: one group of every parameter
        groups = param_groups(model.parameters())
    group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
    unit_name = [name or "(root)" for name, _ in units]
    entries = [agreement.param_entry(i, name, p, unit=unit_name[unit_of[id(p)]],
                                     group=group_of.get(id(p)))
               for i, (name, p) in enumerate(model.named_parameters())]
    entries += buffer_entries(model)
    entries.append(("units", [[n, type(m).__name__] for n, m in units]))
    agreement.check(executor, [("arguments", "accepted")] + fingerprint(
        3, executor, optimizer_class, options, groups, entries), "zero_py.initialize")


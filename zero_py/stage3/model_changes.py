"""What was changed in a stage-3 model since zero_py.initialize that the engine would silently
undo: a parameter cast or moved (model.half(), model.to(torch.bfloat16), model.double(),
model.to(device): only its shard slice changed, and the next gather puts back the dtype and
device it was sharded with), its .data replaced, the Parameter itself replaced in its module
(which the engine no longer gathers), or a submodule holding parameters replaced, added or
deleted (its parameters neither gathered nor reduced).

ModelChanges records what initialize saw; the engine asks it at each forward and step
(Stage3Engine.check_model), under a microsecond a parameter or module, and refuses on every
rank what it finds.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from zero_py.sharding.between_uses import describe
from zero_py.sharding.storage import ShardedParams
from zero_py.stage3.user_edits import changed_registration


class ModelChanges:
    def __init__(self, model: nn.Module, storages: Sequence[ShardedParams]):
        self.storages = list(storages)
        # where the model registers each sharded parameter: the ones replaced since (e.g. by
        # model.to(device), where torch makes new Parameters)
        managed = {id(p) for s in self.storages for p in s.params}
        self._registered = [(m, f"{mn}.{n}" if mn else n, n, p)
                            for mn, m in model.named_modules() for n, p in m._parameters.items()
                            if p is not None and id(p) in managed]
        # each module's children as initialize saw them, and whether each holds parameters
        self._children = [(mn, m, dict(m._modules),
                           {k: c is not None and next(c.parameters(), None) is not None
                            for k, c in m._modules.items()})
                          for mn, m in model.named_modules()]
        # every module's children as (name, id) in one list: a changed one changes the list
        # (`was` keeps the old children alive, so an equal id is the same module). Compared in
        # one comprehension at each forward and step: about 3x faster than module by module
        self._ids = self._child_ids()

    def _child_ids(self) -> list:
        return [(k, id(c)) for _, m, _, _ in self._children for k, c in m._modules.items()]

    def submodules(self) -> Optional[str]:
        """None, or why a submodule holding parameters replaced, added or deleted is refused."""
        if self._child_ids() == self._ids:
            return None
        for mn, m, was, held in self._children:
            now = m._modules
            if len(now) == len(was) and all(now.get(k) is c for k, c in was.items()):
                continue
            for k in {**was, **now}:
                old, new = was.get(k), now.get(k)
                new_held = new is not None and next(new.parameters(), None) is not None
                if old is new or not (held.get(k) or new_held):
                    continue  # a module without parameters (e.g. a Dropout) stays harmless
                where = f"{mn}.{k}" if mn else k
                what = ("deleted" if new is None else "added" if k not in was else
                        f"replaced by a {type(new).__name__}")
                return (
                    f"zero_py stage 3: the model was changed after zero_py.initialize: "
                    f"submodule {where!r} was {what}. Stage 3 gathers, reduces and trains the "
                    "parameters it sharded at initialize; a new module's parameters would be "
                    "neither gathered nor reduced (each rank would train its own copy) and the "
                    "old ones would no longer be trained. Change the model (adapters, "
                    "resized embeddings, replaced heads) before zero_py.initialize, or build "
                    "a new model and optimizer with zero_py.initialize after the change.")
        return None

    def params(self) -> Optional[str]:
        """None, or why a parameter cast, moved, replaced or given new .data is refused."""
        found = []
        for m, name, n, p in self._registered:
            now = m._parameters.get(n)
            if now is not p:
                special = changed_registration(m, name, n, p, now)
                if special is not None:  # not a cast: functional_call, prune (user_edits.py)
                    return special
                with torch._C.DisableTorchFunctionSubclass():
                    what = ("removed" if now is None else
                            f"replaced by another Parameter ({now.dtype} on {now.device})")
                found.append(f"parameter {name!r} was {what}")
        for s in self.storages:
            for i, now, was in s.changed_params():
                found.append(f"parameter {describe(s.params[i])} is {now}, but it was sharded "
                             f"as {was}" if now != was else
                             f"the .data of parameter {describe(s.params[i])} was replaced "
                             "(`p.data = t`, e.g. by torch.nn.utils.vector_to_parameters; "
                             "or model.to(\"cpu:0\") of a CPU model, a copy, as "
                             "transformers.Trainer makes: train with zero_py.integrations."
                             "hf_trainer.ZeroTrainer)")
        if not found:
            return None
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        return (
            f"zero_py stage 3: the model was changed after zero_py.initialize: {found[0]}{more}. "
            "Under stage 3 a cast or a move after initialize (model.half(), "
            "model.to(torch.bfloat16), model.double(), model.to(device)) changes only this "
            "rank's shard slices, and the next gather would silently bring back the sharded "
            "dtype and device (a replaced Parameter would no longer be gathered or trained). "
            "Cast and move the model before zero_py.initialize: for mixed precision, "
            "model.to(torch.bfloat16) (or float16) before initialize keeps an fp32 master of "
            "every shard and updates it there (add grad_reduce_dtype=torch.float32 for an fp32 "
            "gradient sum, loss_scaler=zero_py.LossScaler() for fp16), or pass config= with a "
            "DeepSpeed bf16/fp16 section, which casts it for you; to compute in low precision "
            "over fp32 parameters, run the forward under torch.autocast. To change values, "
            "use model.load_state_dict(...) or write them inside `with "
            "zero_py.gathered(module, modifier_rank=0, optimizer=optimizer):`.")

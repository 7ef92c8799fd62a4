"""What a gradient reaching the reducer (sharding/reducer.py) must be, and the errors that say
what to change when it is not: zero_py's post-accumulate-grad hook runs last on its parameter,
the gradient is dense and of the size planned when the optimizer was built.

Pure checks: nothing here changes state, so a refusal raised from a gradient hook leaves the
reducer as it was."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def _runs_after(p: torch.Tensor, mine: Callable) -> bool:
    """Whether p has a post-accumulate-grad hook that runs after `mine` (registered later)."""
    hooks = p._post_accumulate_grad_hooks
    return bool(hooks) and next(reversed(hooks.values())) is not mine


def late_hook(params: Sequence[torch.Tensor], hooks: Sequence[Callable],
              name_of: Callable[[int], str]) -> Optional[str]:
    """None, or why a post-accumulate-grad hook registered after the reducer's (`hooks`, one
    per parameter) is refused: torch runs them in order of registration, so it would find
    param.grad taken into the shard and set to None, its change of the gradient lost (under
    DDP such a hook runs before the reduction, whenever it was registered). Checked as a
    backward's first gradient arrives (stage 2) and at each forward (stage 3, whose backward
    opens its pass before the first gradient), before anything is reduced. The hooks are read
    without __torch_function__: through it (a stage-3 parameter between uses is a BetweenUses)
    each read cost about 8 us, 2 ms a check at 269 parameters."""
    with torch._C.DisableTorchFunctionSubclass():
        late = next((i for i, (p, mine) in enumerate(zip(params, hooks))
                     if _runs_after(p, mine)), None)
    if late is None:
        return None
    return (
        f"zero_py: parameter {name_of(late)} has a post-accumulate-grad hook registered after "
        "the optimizer was built; zero_py's own takes the gradient into its shard and sets "
        "param.grad to None, so that hook would run on None and its change of the gradient "
        "would be lost. Register it before zero_py.initialize / ZeroOptimizer (it then runs "
        "first, before the reduction, as under DDP), or use param.register_hook, which runs "
        "before the gradient is accumulated")


def check_grad(flat, i: int, g: torch.Tensor, name_of: Callable[[int], str]) -> None:
    """Raises unless g can be parameter i's gradient in `flat` (a FlatLayout)."""
    if g.is_sparse:
        raise RuntimeError(f"zero_py: parameter {name_of(i)} has a sparse gradient; sparse "
                           "gradients are not supported (use a dense nn.Embedding)")
    n = flat.param_numel[i]
    if g.numel() == n:
        return
    if not flat.params_sharded:  # stages 1-2: the parameter itself changed size
        raise RuntimeError(
            f"zero_py: parameter {name_of(i)} got a gradient of shape {tuple(g.shape)}, but it "
            f"had shape {flat.param_shapes[i]} when the optimizer was built: it was resized "
            "since (e.g. model.resize_token_embeddings), and the layout of the flat buffers is "
            "fixed then; resize the model before zero_py.initialize / ZeroOptimizer")
    raise RuntimeError(
        f"zero_py: parameter {name_of(i)} got a gradient of {g.numel()} elements, expected "
        f"{n}; under stage 3 a parameter outside the model's forward is its shard slice, so "
        "compute with it inside the forward (or `with zero_py.gathered(model):`)")

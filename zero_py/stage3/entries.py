"""Entry points of a stage-3 model: its submodules that scripts and libraries call on their
own, outside the model's forward, each call run by the engine as a forward of the model.

Their own parameters are in the root unit, which only a forward of the model gathers: outside
it they would be this rank's shard slices. The usual calls: transformers' generate() runs an
encoder-decoder's `get_encoder()` by itself; a multimodal script embeds with
`model.get_input_embeddings()(ids)` and passes `inputs_embeds=`; a chunked loss applies
`model.lm_head(hidden)` after the forward; scripts read `model.model(...)`'s hidden states.
Modules inside another unit are not entry points (their unit's own hooks refuse a call
outside the model's forward, with what to do instead).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch.nn as nn


def entry_points(model: nn.Module, units: Sequence[Tuple[str, nn.Module]]) -> List[nn.Module]:
    """The modules of the root unit's part of `model` (not the root, not inside another unit)
    that hold parameters, and the model's get_encoder() / get_decoder() even where the wrap
    policy made them units of their own."""
    inner = {id(m) for _, unit in units[1:] for m in unit.modules()}
    found = [m for m in model.modules()
             if m is not model and id(m) not in inner and next(m.parameters(), None) is not None]
    present = {id(m) for m in model.modules()}
    for getter in ("get_encoder", "get_decoder"):
        fn = getattr(model, getter, None)
        try:
            m = fn() if callable(fn) else None
        except Exception:  # noqa: BLE001 - a model without one raises its own way
            m = None
        if (isinstance(m, nn.Module) and m is not model and id(m) in present
                and all(m is not f for f in found)):
            found.append(m)
    return found

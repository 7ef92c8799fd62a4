"""Entry points of a stage-3 model: its submodules that scripts and libraries call on their
own, outside the model's forward, each call run by the engine as a forward of the model.

Their own parameters are in the root unit, which only a forward of the model gathers: outside
it they would be this rank's shard slices. The usual calls: transformers' generate() runs an
encoder-decoder's `get_encoder()` by itself; a multimodal script embeds with
`model.get_input_embeddings()(ids)` and passes `inputs_embeds=`; a chunked loss applies
`model.lm_head(hidden)` after the forward; scripts read `model.model(...)`'s hidden states.
Units and the modules inside them are not entry points (a unit's own hooks refuse a call
outside the model's forward, with what to do instead).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch.nn as nn


def entry_points(model: nn.Module, units: Sequence[Tuple[str, nn.Module]]) -> List[nn.Module]:
    """The modules of the root unit's part of `model` (not the root, not a unit, not inside
    one) that hold parameters: an encoder or decoder a wrap policy made a unit of its own is
    not one (calling it alone is refused as any unit's call is)."""
    inner = {id(m) for _, unit in units[1:] for m in unit.modules()}
    return [m for m in model.modules()
            if m is not model and id(m) not in inner and next(m.parameters(), None) is not None]

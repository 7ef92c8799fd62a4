"""Checks of collective arguments that every executor shares (torch.distributed's and the native
NCCL one), with the messages users see: a bad call raises before anything is sent, on the rank
that made it."""

from __future__ import annotations

import torch


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the memory of the two (contiguous) tensors overlaps."""
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()


def check_all_to_all(output: torch.Tensor, input: torch.Tensor, world_size: int) -> None:
    """An all-to-all's tensors: one dtype and device, contiguous, the same number of elements,
    a multiple of world_size (equal chunks), and no overlap (it cannot run in place)."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        raise TypeError(f"all_to_all takes tensors, got {type(output).__name__} and "
                        f"{type(input).__name__}")
    if input.dtype != output.dtype or input.numel() != output.numel() or \
            input.numel() % world_size or input.device != output.device:
        raise ValueError(f"all_to_all: input and output must have the same number of "
                         f"elements, a multiple of world_size ({world_size}), one dtype and one "
                         f"device; got input {input.numel()} of {input.dtype} on "
                         f"{input.device}, output {output.numel()} of {output.dtype} on "
                         f"{output.device}")
    if not input.is_contiguous() or not output.is_contiguous():
        raise ValueError("all_to_all: input and output must be contiguous (call .contiguous())")
    if input.numel() and overlaps(output, input):
        raise ValueError("all_to_all: output and input overlap; an all-to-all cannot run in "
                         "place (give output its own memory)")

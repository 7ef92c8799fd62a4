"""`python -m zero_py consolidate` and `python -m zero_py inspect`: checkpoints from the shell,
one process, no torch.distributed."""

from __future__ import annotations

import sys


def _consolidate(args) -> int:
    import torch

    from zero_py.tools.env import proc_status_kib, reset_peak_rss

    from zero_py.checkpoint.consolidate import consolidate
    from zero_py.checkpoint.reader import CheckpointError

    dtype = None
    if args.dtype:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            print(f"--dtype {args.dtype}: not a torch dtype (e.g. bfloat16, float32)",
                  file=sys.stderr)
            return 2
    measured = reset_peak_rss()  # the peak of consolidation alone, not of the imports
    before = proc_status_kib("VmRSS")
    try:
        sizes = consolidate(args.checkpoint, args.out, dtype, args.optimizer,
                            verify=not args.no_verify)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"consolidate: {exc}", file=sys.stderr)
        return 1
    memory = (f"; resident memory {before / 1024:.1f} MiB before, at most "
              f"{proc_status_kib('VmHWM') / 1024:.1f} MiB during it" if measured else "")
    print(f"wrote {args.out} ({sizes['weights']:,} bytes)"
          + (f" and {args.optimizer} ({sizes['optimizer']:,} bytes)" if args.optimizer else "")
          + memory)
    return 0


def _inspect(args) -> int:
    from zero_py.checkpoint.consolidate import describe
    from zero_py.checkpoint.reader import CheckpointError

    try:
        print(describe(args.checkpoint, verify=not args.no_verify))
    except (CheckpointError, OSError) as exc:
        print(f"inspect: {exc}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    p = sub.add_parser("consolidate", help="a checkpoint as one .safetensors file of full "
                       "weights (and optionally the optimizer state), streaming",
                       description="Writes the full model weights of a zero_py checkpoint as "
                       "one safetensors file that model.load_state_dict(safetensors.torch."
                       "load_file(OUT)) accepts. One process, one tensor in memory at a time.")
    p.add_argument("checkpoint", help="the checkpoint directory")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--dtype", help="cast the parameters to this dtype (e.g. bfloat16); default: "
                   "each parameter's own")
    p.add_argument("--optimizer", metavar="FILE", help="also write the full optimizer state "
                   "here (torch.optim's state in flat form: see "
                   "zero_py.checkpoint.consolidate.torch_optimizer_state)")
    p.add_argument("--no-verify", action="store_true", help="skip the checksums")
    p.set_defaults(func=_consolidate)
    p = sub.add_parser("inspect", help="print a checkpoint's manifest as a table and check its "
                       "files", description="Prints a zero_py checkpoint's manifest (step, world "
                       "size, stage, parameters, bytes) and checks every file's CRC-32C.")
    p.add_argument("checkpoint", help="the checkpoint directory")
    p.add_argument("--no-verify", action="store_true", help="skip the checksums")
    p.set_defaults(func=_inspect)

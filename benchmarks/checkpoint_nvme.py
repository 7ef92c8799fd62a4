"""Peak resident memory and time of save_checkpoint / load_checkpoint for an optimizer offloaded
to NVMe: the streamed copy (zero_py/checkpoint/offloaded.py) beside the same calls made inside
optimizer.resident() (which reads the whole shard into memory, as checkpoints did before).

    python benchmarks/checkpoint_nvme.py [N_LAYERS]     (1 rank, N Linear(1024, 1024) layers)

Peak RSS is VmHWM, reset before each call through /proc/self/clear_refs (Linux)."""

import contextlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_py
from zero_py.tools.env import cpu_model


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(n)])
    d = tempfile.mkdtemp()
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, lr=1e-3,
                                    offload_optimizer="nvme", offload_dir=d)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())
    slot = opt.memory_report()["nvme_optimizer_states"] / 2
    print(f"params {params / 1e6:.1f} M, optimizer shard on NVMe {slot / 1e6:.0f} MB; "
          f"CPU: {cpu_model()}")
    for mode in ("streamed", "resident", "streamed", "resident"):
        ctx = opt.resident if mode == "resident" else contextlib.nullcontext
        res = []
        for what in ("save", "load"):
            base = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            t = time.perf_counter()
            with ctx():
                if what == "save":
                    zero_py.save_checkpoint(f"{d}/ck", model, opt)
                else:
                    zero_py.load_checkpoint(f"{d}/ck", model, opt)
            res.append(f"{what} {time.perf_counter() - t:.2f} s, peak RSS "
                       f"+{(_status('VmHWM') - base) / 1e6:.0f} MB")
        print(mode, "; ".join(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Runs a test body in several processes joined by a gloo process group, on the CPU.

run(fn, world_size, *args) starts world_size fresh processes (spawn), each calling
fn(rank, world_size, *args) after init_process_group("gloo") through a FileStore, and returns
the list of their return values (rank order). A failure on any rank fails the caller, with
that rank's traceback.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, fn, world_size, store_path, out_dir, args):
    torch.set_num_threads(1)
    os.environ.setdefault("ZP_NUM_THREADS", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
        # Free the test's objects (optimizers hold the group and work in reference cycles) and
        # let every rank finish its collectives before any rank tears down its group: a rank
        # that destroyed its gloo group while peers were still exchanging with it was seen to
        # die with "terminate called without an active exception" (4 ranks on 2 cores, in CI).
        # Only on success: a failed rank must exit at once so that its peers fail fast.
        del result
        gc.collect()
        dist.barrier()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run(fn, world_size, *args, timeout=300):
    with tempfile.TemporaryDirectory(prefix="zp_dist_") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(fn, world_size, store, tmp, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"ranks still running after {timeout} s: a hang")
        except mp.ProcessRaisedException as exc:
            raise AssertionError(f"a rank failed:\n{exc}") from None
        results = []
        for rank in range(world_size):
            out = torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False)
            if not out["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{out['error']}")
            results.append(out["result"])
        return results

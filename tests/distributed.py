"""Runs a test body in several processes joined by a gloo process group, on the CPU.

run(fn, world_size, *args) starts world_size fresh processes, each calling
fn(rank, world_size, *args) after init_process_group("gloo") through a FileStore, and returns
the list of their return values (rank order). A failure on any rank fails the caller, with
that rank's traceback.

The processes are forked from a forkserver that has imported torch once (importing it takes
each spawned process ~2 s of CPU, most of a small test's time on a 2-vCPU machine). Each rank
takes the caller's environment as it is at the call, as a spawned process would. What only a
new program reads, at its start (the C library's MALLOC_* tunables, LD_*, OMP_*, PYTHON*),
cannot reach a forked process: where the caller's environment differs from the forkserver's
in one of those, the ranks are spawned instead (ZP_TEST_START_METHOD=spawn spawns them always).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import traceback

import multiprocessing

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# read by a program at its start only: a forked rank would not see a change
_AT_START = ("MALLOC_", "LD_", "OMP_", "MKL_", "PYTHON", "GLIBC_")
_server_env = None  # the environment the forkserver started with


def _start_method() -> str:
    global _server_env
    if _server_env is None:
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
        _server_env = dict(os.environ)
    if os.environ.get("ZP_TEST_START_METHOD"):  # e.g. spawn, to rule the forkserver out
        return os.environ["ZP_TEST_START_METHOD"]
    now = dict(os.environ)
    changed = {k for k in set(now) | set(_server_env) if now.get(k) != _server_env.get(k)}
    return "spawn" if any(k.startswith(_AT_START) for k in changed) else "forkserver"


def _worker(rank, fn, world_size, store_path, out_dir, args, env):
    os.environ.clear()
    os.environ.update(env)
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
        ctx = mp.start_processes(_worker, args=(fn, world_size, store, tmp, args,
                                                dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=_start_method())
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

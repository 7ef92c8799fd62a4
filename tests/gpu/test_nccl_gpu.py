"""The native NCCL executor on a GPU, world size 1 in the pytest process (NCCL puts one rank per
GPU; several ranks on one GPU go through the torch.distributed executor, test_training_gpu.py):
every collective on random data, ordering after the caller's stream, CPU tensors through the
device, and failures: a collective that outlives the timeout aborts the communicator and
every later call raises with the reason instead of hanging.

Where the machine has two GPUs or more (skipped, with the reason, where it has one), one rank
per GPU in spawned processes joined by an NCCL process group (_run_on_gpus): the executor's
all_to_all against torch.distributed's all_to_all_single, and training with quantized_grads
(the qgZ all-to-all) and with a bf16 wire summed in fp32 on the NCCL executor against the
same training on the torch.distributed executor."""

import gc
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zero_py
from models import gpt_batch, gpt_loss, tiny_gpt
from zero_py.collectives import NcclExecutor, make_executor

DEV = torch.device("cuda", 0)
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 GPUs or more (NCCL puts one "
                                                       f"rank per GPU); this machine has {N_GPUS}")


@pytest.fixture
def ex(single_rank_group):
    return NcclExecutor(single_rank_group, DEV, timeout=60.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_collectives_at_world_size_1(ex, dtype):
    x = torch.randn(1_000_003, device=DEV).to(dtype)
    out = torch.full_like(x, float("nan"))
    ex.reduce_scatter(out, x).wait()
    assert torch.equal(out, x)
    gathered = torch.full_like(x, float("nan"))
    ex.all_gather(gathered, x).wait()
    assert torch.equal(gathered, x)
    inplace = x.clone()
    ex.all_gather(inplace, inplace).wait()  # input aliases its chunk of the output
    assert torch.equal(inplace, x)
    y = x.clone()
    ex.all_reduce(y).wait()
    assert torch.equal(y, x)
    ex.all_reduce_max(y).wait()
    ex.broadcast(y, 0).wait()
    assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_all_to_all_at_world_size_1(ex, dtype):
    x = (torch.randn(1_000_003, device=DEV).abs() * 50).to(dtype)
    out = torch.zeros_like(x)
    ex.all_to_all(out, x).wait()
    assert torch.equal(out, x)  # one rank: its one chunk comes back (NCCL's send to itself)
    assert ex.stats.snapshot()["all_to_all"] == {"calls": 1, "bytes_sent": 0,
                                                 "bytes_received": 0}
    host_out = torch.zeros(6, dtype=torch.int64)
    ex.all_to_all(host_out, torch.arange(6)).wait()  # CPU tensors: through the device
    assert host_out.tolist() == list(range(6))
    with pytest.raises(ValueError, match="overlap"):
        ex.all_to_all(x, x)
    with pytest.raises(ValueError, match="same number of elements"):
        ex.all_to_all(out[:10], x)


def test_collective_is_ordered_after_the_callers_stream(ex):
    x = torch.randn(50_000_000, device=DEV)
    y = x * 3.0  # queued on the current stream; the collective must see its result
    w = ex.all_reduce(y)
    w.wait()
    z = y - 3.0 * x  # ordered after the collective by wait()
    assert z.abs().max().item() == 0.0
    assert w.is_completed() or True  # after wait the handle is spent
    torch.cuda.synchronize()


def test_cpu_tensors_go_through_the_device(ex):
    mask = torch.randint(0, 2, (37,), dtype=torch.uint8)
    want = mask.clone()
    ex.all_reduce_max(mask).wait()
    assert torch.equal(mask, want)
    stats = torch.tensor([3.5, 1.0], dtype=torch.float64)
    ex.all_reduce(stats, dist.ReduceOp.SUM).wait()
    assert stats.tolist() == [3.5, 1.0]


def test_bad_arguments_say_what_to_change(ex):
    x = torch.randn(10, device=DEV)
    with pytest.raises(ValueError, match="world_size"):
        ex.reduce_scatter(torch.empty(3, device=DEV), x)
    with pytest.raises(ValueError, match="this NCCL executor runs on"):
        ex.all_reduce(torch.randn(4, dtype=torch.float32, device="meta"))
    with pytest.raises(ValueError, match="SUM, PRODUCT, MAX or MIN"):
        ex.all_reduce(x, dist.ReduceOp.BAND)
    with pytest.raises(ValueError, match="src"):
        ex.broadcast(x, 3)


def test_timeout_aborts_instead_of_hanging(single_rank_group):
    ex = NcclExecutor(single_rank_group, DEV, timeout=1.0)
    x = torch.randn(1024, device=DEV)
    with torch.cuda.stream(ex.stream):
        torch.cuda._sleep(6_000_000_000)  # seconds of spinning ahead of the collective
    work = ex.all_reduce(x)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        while time.monotonic() - start < 30:
            ex.check()
            time.sleep(0.05)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="has failed"):
        work.wait()
    with pytest.raises(RuntimeError, match="has failed"):
        ex.all_reduce(x)
    torch.cuda.synchronize()


def test_abort_reports_its_reason(ex):
    ex.abort("test abort")
    with pytest.raises(RuntimeError, match="test abort"):
        ex.all_reduce(torch.randn(8, device=DEV))


def test_make_executor_picks_by_device_and_backend(single_rank_group):
    from zero_py.collectives import TorchDistExecutor
    # a gloo group over CUDA tensors: the torch.distributed executor (several ranks may share a
    # GPU); asked for by name: the native one
    assert isinstance(make_executor(single_rank_group, DEV), TorchDistExecutor)
    assert isinstance(make_executor(single_rank_group, DEV, "nccl"), NcclExecutor)


# -- one rank per GPU ----------------------------------------------------------------------------

def _gpu_worker(rank, fn, world_size, store_path, out_dir, args):
    # deterministic kernels, so that two trainings in one process differ only by the executor
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"{rank}.pt"))
        del result
        gc.collect()  # the executors (their communicators) before the group
        dist.barrier()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def _run_on_gpus(fn, world_size, *args, timeout=600):
    """fn(rank, world_size, *args) on `world_size` spawned processes, rank r on GPU r, joined by
    an NCCL process group (tests/distributed.py's run, with NCCL); their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="zp_gpus_") as tmp:
        ctx = mp.start_processes(_gpu_worker, args=(fn, world_size, os.path.join(tmp, "store"),
                                                    tmp, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"ranks still running after {timeout} s: a hang")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise AssertionError(f"a rank failed:\n{exc}") from None
        results = []
        for rank in range(world_size):
            out = torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False)
            if not out["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{out['error']}")
            results.append(out["result"])
        return results


def _all_to_all_against_torch(rank, ws):
    dev = torch.device("cuda", rank)
    ex = NcclExecutor(dist.group.WORLD, dev, timeout=120.0)
    gen = torch.Generator(device=dev).manual_seed(rank)
    # odd chunks (unaligned chunk addresses), a large one, and the qgZ packets' bytes
    for chunk, dtype in [(1, torch.float32), (1001, torch.bfloat16), (777, torch.uint8),
                         (4_000_037, torch.float32), (12_345, torch.float64),
                         (3, torch.int64)]:
        x = (torch.randn(ws * chunk, device=dev, generator=gen) * 100).to(dtype)
        out = torch.zeros_like(x)
        ex.all_to_all(out, x).wait()
        # torch's on its own communicator, after ours (two communicators in flight at once
        # could order their kernels differently on two ranks)
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x)
        torch.cuda.synchronize(dev)
        assert torch.equal(out, want), (chunk, dtype)
    host = torch.arange(ws * 5, dtype=torch.float32) + 1000 * rank  # through the device
    host_out = torch.empty_like(host)
    ex.all_to_all(host_out, host).wait()
    want = torch.cat([torch.arange(rank * 5, rank * 5 + 5, dtype=torch.float32) + 1000 * r
                      for r in range(ws)])
    assert torch.equal(host_out, want)
    return ex.stats.snapshot()["all_to_all"]


@needs_two_gpus
def test_all_to_all_matches_torch_at_several_ranks():
    ws = min(N_GPUS, 4)
    for counted in _run_on_gpus(_all_to_all_against_torch, ws):
        assert counted["calls"] == 7


def _train_both(rank, ws, stage, options, steps):
    """The same training on the NCCL executor and on the torch.distributed executor (over the
    NCCL process group: all_to_all_single): losses per step, the model's state dict after
    training (full values at every stage) and the kinds of collectives the step issued."""
    dev = torch.device("cuda", rank)
    out = {}
    for executor in ("nccl", "torch"):
        torch.manual_seed(0)
        model = tiny_gpt().to(dev)
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=3e-3,
                                        bucket_bytes=8192, executor=executor, **options)
        inner = opt._wire.inner if hasattr(opt._wire, "inner") else opt._wire
        assert type(inner).__name__ == {"nccl": "NcclExecutor",
                                        "torch": "TorchDistExecutor"}[executor]
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            loss = gpt_loss(model, tuple(t.to(dev) for t in gpt_batch(gen)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        kinds = opt.comm_stats().get("shard", {})
        state = {k: v.float().cpu() for k, v in model.state_dict().items()}
        out[executor] = (losses, state, sorted(kinds))
        del model, opt
        gc.collect()
    return out


@needs_two_gpus
@pytest.mark.parametrize("stage,options", [
    (2, {"quantized_grads": "int8"}),
    (2, {"quantized_grads": "int4", "quantize_block": 64, "quantized_weights": "int8"}),
    (3, {"quantized_grads": "int8"}),
    (2, {"grad_reduce_dtype": torch.bfloat16, "grad_accum_dtype": torch.float32}),
])
def test_quantized_training_on_nccl_matches_the_torch_executor(stage, options):
    """qgZ on the NCCL executor: the same packets, exchanged by its all_to_all instead of
    all_to_all_single, summed by the same code in the same order, so the two runs agree (bit
    for bit where the forward and backward are deterministic; compared within 1e-5 here)."""
    ws = min(N_GPUS, 4)
    for rank, runs in enumerate(_run_on_gpus(_train_both, ws, stage, options, 6)):
        (l_nccl, m_nccl, k_nccl), (l_torch, m_torch, k_torch) = runs["nccl"], runs["torch"]
        assert "all_to_all" in k_nccl and k_nccl == k_torch, (k_nccl, k_torch)
        torch.testing.assert_close(torch.tensor(l_nccl), torch.tensor(l_torch), rtol=1e-5,
                                   atol=1e-6, msg=f"losses, rank {rank}")
        assert m_nccl.keys() == m_torch.keys()
        for name in m_nccl:
            torch.testing.assert_close(m_nccl[name], m_torch[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{name}, rank {rank}")

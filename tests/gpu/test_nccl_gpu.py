"""The native NCCL executor on a GPU, world size 1 in the pytest process (NCCL puts one rank per
GPU; several ranks on one GPU go through the torch.distributed executor, test_training_gpu.py):
every collective on random data, ordering after the caller's stream, CPU tensors through the
device, and failures: a collective that outlives the timeout aborts the communicator and
every later call raises with the reason instead of hanging."""

import time

import pytest
import torch
import torch.distributed as dist

from zero_py.collectives import NcclExecutor, make_executor

DEV = torch.device("cuda", 0)


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

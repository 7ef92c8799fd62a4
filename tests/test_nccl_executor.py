"""The executor choice and the NCCL executor's Python side, on a machine of any kind: what
make_executor and ZeroOptimizer pick or refuse, the NCCL codes of torch's ops and dtypes, and
that a machine without a GPU or NCCL gets an error that says why (tests/gpu/ runs the executor
itself)."""

import pytest
import torch
import torch.distributed as dist

import zero_py
from zero_py.collectives import nccl
from zero_py.collectives import TorchDistExecutor, make_executor


def test_ops_and_dtypes_map_to_nccls_codes():
    assert [nccl.nccl_op(o) for o in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT,
                                      dist.ReduceOp.MAX, dist.ReduceOp.MIN)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="SUM, PRODUCT, MAX or MIN"):
        nccl.nccl_op(dist.ReduceOp.BAND)
    assert nccl.nccl_dtype(torch.bfloat16) == 9 and nccl.nccl_dtype(torch.float64) == 8
    assert nccl.nccl_dtype(torch.uint8) == 1 and nccl.nccl_dtype(torch.float16) == 6
    with pytest.raises(ValueError, match="complex64"):
        nccl.nccl_dtype(torch.complex64)


def test_library_search_starts_with_the_loaded_one(monkeypatch):
    monkeypatch.setenv("ZP_NCCL_LIBRARY", "/opt/x/libnccl.so.2")
    c = nccl.library_candidates()
    assert c[0] == "/opt/x/libnccl.so.2" and c[1] is None


def test_make_executor_choices(single_rank_group):
    assert isinstance(make_executor(single_rank_group, torch.device("cpu")),
                      TorchDistExecutor)
    assert isinstance(make_executor(single_rank_group, torch.device("cpu"), "torch"),
                      TorchDistExecutor)
    with pytest.raises(ValueError, match="needs CUDA parameters"):
        make_executor(single_rank_group, torch.device("cpu"), "nccl")
    with pytest.raises(ValueError, match="'auto', 'nccl', 'torch'"):
        make_executor(single_rank_group, torch.device("cpu"), "mpi")
    with pytest.raises(TypeError, match="has no reduce_scatter"):
        make_executor(single_rank_group, torch.device("cpu"), object())
    mine = TorchDistExecutor(single_rank_group)
    assert make_executor(single_rank_group, torch.device("cpu"), mine) is mine


def test_zero_optimizer_executor_argument(single_rank_group):
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="needs CUDA parameters"):
        zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, executor="nccl")
    opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, executor="torch", lr=0.1)
    assert isinstance(opt.executor, TorchDistExecutor)
    meta = torch.nn.Linear(8, 4, device="meta")
    with pytest.raises(ValueError, match="CPU and CUDA"):
        zero_py.ZeroOptimizer(meta.parameters(), torch.optim.AdamW)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_the_nccl_executor_says_why(single_rank_group):
    why = nccl.unavailable_reason()
    assert why is not None
    with pytest.raises(RuntimeError, match="NCCL executor is unavailable") as err:
        nccl.NcclExecutor(single_rank_group)
    assert why in str(err.value) and "executor='torch'" in str(err.value)

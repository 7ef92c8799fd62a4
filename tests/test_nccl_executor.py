"""The executor choice and the NCCL executor's Python side, on a machine of any kind: what
make_executor and ZeroOptimizer pick or refuse, the NCCL codes of torch's ops and dtypes, and
that a machine without a GPU or NCCL gets an error that says why (tests/gpu/ runs the executor
itself), and the NCCL all-to-all's checks, counting and call through a stand-in for the
communicator."""

import os

import pytest
import torch
import torch.distributed as dist

import zero_py
from zero_py.collectives import TorchDistExecutor, arguments, make_executor, nccl, quantized
from zero_py.collectives.stats import CommStats
from zero_py.collectives.work import Work


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
    with pytest.raises(ValueError, match="on the meta device .*zero_py.initialize"):
        zero_py.ZeroOptimizer(meta.parameters(), torch.optim.AdamW)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_the_nccl_executor_says_why(single_rank_group):
    why = nccl.unavailable_reason()
    assert why is not None
    with pytest.raises(RuntimeError, match="NCCL executor is unavailable") as err:
        nccl.NcclExecutor(single_rank_group)
    assert why in str(err.value) and "executor='torch'" in str(err.value)


def test_nccl_unique_id_keys_agree_after_a_subgroups_executor(monkeypatch):
    """4 ranks: ranks 2 and 3 built a stage-3 model over their own group (two communicators:
    its executor and its gather channel), then every rank builds one over the world. Rank 2
    must read the world communicator's id under the key rank 0 wrote (a count of all of a
    process's communicators sent it to another key: a hang in store.get)."""
    store = {}

    class Store:
        def set(self, key, value):
            store[key] = value

        def get(self, key):
            if key not in store:
                raise AssertionError(f"{key} is never set: this rank would wait for ever")
            return store[key]

    class Native:
        def nccl_unique_id(self):
            return os.urandom(128)

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Store())
    monkeypatch.setattr(nccl.cuda, "native", lambda: Native())

    def exchange(ranks, group_rank):
        ex = nccl.NcclExecutor.__new__(nccl.NcclExecutor)
        ex.rank, ex.group = group_rank, None
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: ranks)
        return ex._exchange_id()

    monkeypatch.setattr(nccl, "_IDS_MADE", {}, raising=False)  # rank 0's process
    world_id = exchange([0, 1, 2, 3], 0)
    monkeypatch.setattr(nccl, "_IDS_MADE", {}, raising=False)  # rank 2's process
    sub_id = exchange([2, 3], 0)
    assert exchange([2, 3], 0) != sub_id  # the channel: a communicator of its own
    assert exchange([0, 1, 2, 3], 2) == world_id


def _stand_in(world_size=4, rank=1):
    """An NcclExecutor without a GPU: its Python checks and counting, with the native call
    (_issue) recorded instead of made."""
    ex = nccl.NcclExecutor.__new__(nccl.NcclExecutor)
    ex.stats, ex.world_size, ex.rank = CommStats("shard"), world_size, rank
    ex.device = torch.device("meta")
    ex.issued = []

    def fake_issue(coll, send, recv, count, op=0, root=0):
        ex.issued.append((coll, send, recv, count))
        return Work(None)
    ex._issue = fake_issue
    return ex


def test_nccl_all_to_all_issues_one_grouped_exchange(monkeypatch):
    ex = _stand_in()
    buf = torch.empty(2 * 48, dtype=torch.bfloat16, device="meta")  # distinct fake addresses
    output, input = buf[:48], buf[48:]
    ex.all_to_all(output, input)
    (coll, send, recv, count), = ex.issued
    assert (coll, count) == (nccl.ALL_TO_ALL, 12)  # elements to and from each of 4 ranks
    assert send is input and recv is output
    assert ex.stats.snapshot() == {"all_to_all": {"calls": 1, "bytes_sent": 72,
                                                  "bytes_received": 72}}
    # CPU tensors go through the device: the device copies are what is issued and counted
    # (two meta tensors share the fake address 0: the overlap check would refuse them)
    monkeypatch.setattr(arguments, "overlaps", lambda a, b: False)
    ex.all_to_all(torch.empty(8), torch.arange(8, dtype=torch.float32))
    coll, send, recv, count = ex.issued[-1]
    assert (coll, count, send.device.type, recv.device.type) == (nccl.ALL_TO_ALL, 2, "meta",
                                                                 "meta")
    assert ex.stats.snapshot()["all_to_all"] == {"calls": 2, "bytes_sent": 72 + 24,
                                                 "bytes_received": 72 + 24}


def test_nccl_all_to_all_checks_its_arguments():
    ex = _stand_in()
    meta = dict(device="meta")
    buf = torch.empty(200, **meta)
    bad = [
        ((buf[:40], buf[40:80].to(torch.bfloat16)), ValueError, "one dtype"),
        ((buf[:40], buf[40:84]), ValueError, "same number of elements"),
        ((buf[:42], buf[100:142]), ValueError, r"multiple of world_size \(4\)"),
        ((buf[:40], buf[20:60]), ValueError, "overlap"),
        ((buf[:40], torch.empty(40)), ValueError, "input is on cpu; this NCCL executor runs on"),
        ((buf[:40], buf[40:120:2]), ValueError, "input must be contiguous"),
        ((buf[:40], [0.0] * 40), TypeError, "input must be a torch.Tensor"),
        ((torch.empty(8, dtype=torch.complex64, **meta),
          torch.empty(8, dtype=torch.complex64, **meta)), ValueError, "not torch.complex64"),
    ]
    for (output, input), exc, match in bad:
        with pytest.raises(exc, match=match):
            ex.all_to_all(output, input)
    assert ex.issued == [] and ex.stats.snapshot() == {}  # nothing refused went out


def test_nccl_all_to_all_on_a_library_without_send_recv():
    """NCCL older than 2.7 loads (every other collective runs); all_to_all says why it cannot
    run, quantized_grads is refused with that reason, and a bf16 wire summed in fp32 reduces
    in the wire dtype instead."""
    ex = _stand_in()
    ex.all_to_all_unavailable = "the loaded NCCL (version code 2604) has no ncclSend/ncclRecv"
    buf = torch.empty(80, **dict(device="meta"))
    with pytest.raises(RuntimeError, match="no all_to_all here: the loaded NCCL .* 2604"):
        ex.all_to_all(buf[:40], buf[40:])
    assert quantized.all_to_all_unavailable(ex) == ex.all_to_all_unavailable
    grads = quantized.spec("int8", 256, "quantized_grads")
    with pytest.raises(ValueError, match="quantized_grads needs .*version code 2604"):
        quantized.QuantizedExecutor(ex, grads=grads)
    wire = quantized.QuantizedExecutor(ex)  # widening only
    wire.reduce_scatter(torch.empty(10, device="meta"),
                        torch.empty(40, dtype=torch.bfloat16, device="meta"))
    assert [i[0] for i in ex.issued] == [nccl.REDUCE_SCATTER]


def test_quantized_collectives_use_the_nccl_all_to_all(monkeypatch):
    """With NCCL >= 2.7 the NCCL executor takes quantized_grads (qgZ) and sums a bf16 wire in
    fp32 through its all_to_all (the data path runs on a GPU: tests/gpu/test_nccl_gpu.py)."""
    ex = _stand_in()
    assert quantized.all_to_all_unavailable(ex) is None
    quantized.QuantizedExecutor(ex, grads=quantized.spec("int4", 64, "quantized_grads"))
    # meta tensors share address 0
    monkeypatch.setattr(arguments, "overlaps", lambda a, b: False)
    quantized.QuantizedExecutor(ex).reduce_scatter(
        torch.empty(10, device="meta"), torch.empty(40, dtype=torch.bfloat16, device="meta"))
    (coll, send, recv, count), = ex.issued
    assert (coll, count, send.dtype, recv.numel()) == (nccl.ALL_TO_ALL, 10, torch.bfloat16, 40)


def test_hybrid_executor_has_no_all_to_all_of_its_own():
    """A hybrid mesh reduces across its replicas after the shard group: the shard executor's
    all_to_all (reached through HybridExecutor.__getattr__) would leave them out."""
    from zero_py.collectives.hybrid import HybridExecutor

    hybrid = HybridExecutor.__new__(HybridExecutor)
    hybrid.shard = _stand_in()
    assert "replicas" in quantized.all_to_all_unavailable(hybrid)

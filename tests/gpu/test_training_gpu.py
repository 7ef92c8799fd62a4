"""ZeRO training on a GPU against single-GPU torch training, same seed and data:

- stages 1 and 2 on the native NCCL executor at world size 1, fp32 (AdamW; loss per step and
  every parameter after 24 steps within 1e-5 relative: the two differ only in the optimizer's
  op order) and bf16 parameters with fp32 masters (against torch training bf16 parameters
  from fp32 masters by hand; within 2e-2 relative: bf16 rounding of the forward);
- several ranks on one GPU (gloo over CUDA tensors, the torch.distributed executor): stage 2
  against DDP, each rank's shard, states and masters on the device, and peak memory per rank.

TODO(stage 3): the stage-3 GPU test (zero_py.initialize(..., stage=3) on NCCL at world size 1
against the same single-GPU reference) is added with zero_py/stage3.py.
"""

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py

DEV = torch.device("cuda", 0)
STEPS = 24


def _batch_to(batch, device):
    return tuple(t.to(device) for t in batch)


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_stages_on_nccl_match_single_gpu_torch(single_rank_group, model_name, stage):
    make, batch_fn, loss_fn = models.MODELS[model_name]
    torch.manual_seed(0)
    ref = make().to(DEV)
    zmodel = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=stage, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=4096, executor="nccl")
    assert type(zopt.executor).__name__ == "NcclExecutor" and zopt.uses_fused_kernel
    assert zopt._flat.n_buckets > 1
    gen = torch.Generator().manual_seed(1000)
    for step in range(STEPS):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        assert rel <= 1e-5, f"step {step}: loss differs by {rel:.2e}"
    for (name, a), b in zip(zmodel.named_parameters(), ref.parameters()):
        assert a.device == DEV
        assert models.max_rel_diff(a, b) <= 1e-5, name
    for t in zopt._update.states:
        assert t.device == DEV


def test_bf16_stage_2_on_nccl_matches_fp32_master_torch(single_rank_group):
    make, batch_fn, loss_fn = models.MODELS["gpt"]
    torch.manual_seed(0)
    ref = make().to(DEV).to(torch.bfloat16)
    zmodel = copy.deepcopy(ref)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=2, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=8192, executor="nccl",
                                 grad_reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(STEPS):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    assert worst <= 2e-2
    for a, b in zip(zmodel.parameters(), ref.parameters()):
        assert a.dtype == torch.bfloat16
        assert models.max_rel_diff(a.float(), b.float()) <= 2e-2


def _ranks_on_one_gpu(rank, world_size):
    torch.cuda.set_device(0)
    make, batch_fn, loss_fn = models.MODELS["mlp"]
    torch.manual_seed(0)
    ref = make().to(DEV)
    zmodel = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    torch.cuda.reset_peak_memory_stats()
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=2, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=4096, executor="torch")
    gen = torch.Generator().manual_seed(1000 + rank)
    worst = 0.0
    for _ in range(12):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ddp, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    param_rel = max(models.max_rel_diff(a, b) for a, b in zip(zmodel.parameters(),
                                                                ref.parameters()))
    return {"loss_rel": worst, "param_rel": param_rel,
            "devices": sorted({str(t.device) for t in zopt._update.states}
                              | {str(t.device) for t in zopt._reducer.grads.tensors.values()}),
            "report": zopt.memory_report(), "shard_numel": zopt._flat.shard_numel,
            "peak_bytes": torch.cuda.max_memory_allocated()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_several_ranks_on_one_gpu_shard_on_device(world_size, capsys):
    results = distributed.run(_ranks_on_one_gpu, world_size)
    numels = [r["shard_numel"] for r in results]
    for rank, r in enumerate(results):
        assert r["devices"] == ["cuda:0"], r["devices"]
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, (rank, r)
        rep = r["report"]
        # each rank keeps 1/world of the AdamW states (plus padding)
        assert rep["optimizer_states"] <= rep["ddp_optimizer_states"] / world_size * 1.25 + 4096
    assert len(set(numels)) == 1
    with capsys.disabled():
        print(f"\npeak CUDA memory per rank at {world_size} ranks (MiB): " +
              ", ".join(f"{r['peak_bytes'] / 2**20:.1f}" for r in results))

"""Offload on a GPU: parameters and gradients on the device, the optimizer on the host
(offload_optimizer="cpu": pinned masters and states, copies on a stream of their own) or on
NVMe (offload_optimizer="nvme"), and stage-3 parameter shards in pinned host memory
(offload_params="cpu"), each against the same training with the optimizer on the GPU.

The CPU and CUDA kernel families compute the same operations in the same order (see
docs/cuda.md), so the results agree to rounding: 1e-6 relative for fp32, the bf16 rounding
step (2^-8 relative) for bf16 parameters.
"""

import copy

import pytest
import torch

import models
import zero_py

DEV = torch.device("cuda", 0)
STEPS = 6


def _train(stage, dtype, seed=0, clip=0.5, **kw):
    torch.manual_seed(seed)
    model = models.TiedGPT(n_layer=2).to(DEV).to(dtype)
    extra = {"wrap_policy": 1000} if stage == 3 else {"bucket_bytes": 4096}
    if dtype != torch.float32:
        kw["grad_reduce_dtype"] = torch.float32
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=3e-3,
                                    weight_decay=0.05, **extra, **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        idx, tgt = models.gpt_batch(gen, batch=4)
        model(idx.to(DEV), tgt.to(DEV)).float().backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return {k: v.float().cpu() for k, v in zero_py.full_state_dict(model).items()}, opt


def _rel(a: dict, b: dict) -> float:
    return max(models.max_rel_diff(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_on_gpu_matches_the_gpu_step(single_rank_group, stage, dtype, tmp_path):
    reference, _ = _train(stage, dtype)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    got, opt = _train(stage, dtype, offload_optimizer="cpu")
    assert _rel(got, reference) <= tol
    assert all(p.device == DEV for p in opt._flat.params)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in opt._update.states)
    got, opt = _train(stage, dtype, offload_optimizer="nvme", offload_dir=str(tmp_path))
    assert _rel(got, reference) <= tol
    if stage == 3:
        got, opt = _train(3, dtype, offload_optimizer="cpu", offload_params="cpu")
        assert _rel(got, reference) <= tol
        assert all(t.is_pinned() for t in opt._flat.shards.tensors.values())
        assert opt.memory_report()["host_params"] > 0


def test_parameter_offload_on_gpu_needs_optimizer_offload(single_rank_group):
    with pytest.raises(ValueError, match="needs offload_optimizer='cpu'"):
        zero_py.initialize(copy.deepcopy(models.MLP()).to(DEV), torch.optim.AdamW, stage=3,
                           lr=1e-3, offload_params="cpu")


@pytest.mark.parametrize("clip", [None, 0.5], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_step_on_gpu_matches_the_offloaded_step_to_the_bit(single_rank_group, stage,
                                                                    dtype, clip):
    """overlap_step: buckets updated on the host during backward (kept when unclipped, put
    back and redone when clipped) give the offloaded step's results exactly."""
    reference, _ = _train(stage, dtype, clip=clip, offload_optimizer="cpu")
    got, opt = _train(stage, dtype, clip=clip, offload_optimizer="cpu", overlap_step=1.0)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    assert opt._early.early_last_step > 0
    assert opt._early.kept_last_step == (opt._early.early_last_step if clip is None else 0)

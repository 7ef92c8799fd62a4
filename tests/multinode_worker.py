"""Run by tests/test_multinode.py under two torchrun launches (--nnodes 2, loopback): zero_py
stages 1-3 against DDP + torch.optim on the same data, 4 steps each, sharded over the world and
with hybrid="node" (shard inside a node, replicate across nodes); global rank 0 writes the
largest relative parameter difference of each run, and what torchrun set, to argv[1]."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import zero_py  # noqa: E402


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"world": world, "nodes": int(os.environ["GROUP_WORLD_SIZE"]),
              "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
    for stage, hybrid in [(s, h) for h in (None, "node") for s in (1, 2, 3)]:
        torch.manual_seed(0)
        ref = models.TiedGPT(n_layer=2)
        zmodel = copy.deepcopy(ref)
        ddp = DDP(ref)
        ref_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.05)
        policy = {"wrap_policy": 1000} if stage == 3 else {}
        zmodel, zopt = zero_py.initialize(zmodel, torch.optim.AdamW, stage=stage, lr=3e-3,
                                          weight_decay=0.05, hybrid=hybrid, **policy)
        if hybrid is not None:
            # one shard group per node: 2 ranks each, every gradient averaged over all 4
            assert (zopt.executor.world_size, zopt.executor.data_parallel_size) == (2, 4)
        for t in range(4):
            idx, tgt = models.gpt_batch(torch.Generator().manual_seed(100 + t), batch=4 * world)
            mine = slice(rank * 4, (rank + 1) * 4)
            for model, opt in ((ddp, ref_opt), (zmodel, zopt)):
                model(idx[mine], tgt[mine]).backward()
                opt.step()
                opt.zero_grad()
        full = zero_py.full_state_dict(zmodel)
        if rank == 0:
            want = ddp.module.state_dict()
            key = f"stage{stage}" if hybrid is None else f"hybrid_stage{stage}"
            result[key] = max(models.max_rel_diff(full[k], want[k]) for k in want)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Experiment, not part of the package: stage 3's parameter all-gathers through shared memory
instead of gloo's loopback TCP, to measure what a shared-memory transport would give.

    torchrun --nproc-per-node 4 benchmarks/experiments/shm_all_gather.py          # gloo
    SHM=1 torchrun --nproc-per-node 4 benchmarks/experiments/shm_all_gather.py    # shm

Prints the median step time of DDP, zero_py stage 2 and stage 3 (12-layer TinyGPT, d_model 256,
4 x 64 tokens per rank), taking turns, and the last losses (equal: the values are the same).
The shared-memory all-gather is a ring of K slots of CAP bytes per rank in one /dev/shm file;
a writer copies its chunk into its slot and publishes a sequence number, readers poll it, copy
the chunks out and publish that they read it. Ordering relies on x86-64's store and load order
(torch copies, then an int64 store); a real transport needs C11 acquire/release atomics, a
timeout, and slots that cost no memory (e.g. the shards themselves in shared memory): K x
world_size x CAP bytes is more than the working set it would save on.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

import zero_py
import zero_py.api as A
import zero_py.collectives as C
from zero_py.collectives.work import Work
from zero_py.examples.demo import Block, TinyGPT

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
K, CAP = 16, 4 << 20  # slots, bytes per rank per slot

class Shm:
    n = 0

    def __init__(self, ex):
        Shm.n += 1
        path = f"/dev/shm/zp_proto_{os.environ['MASTER_PORT']}_{Shm.n}"
        nbytes = K * ws * CAP + 2 * K * ws * 8
        if ex.rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        dist.barrier(group=ex.group)
        self.buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=ex.group)
        if ex.rank == 0:
            os.unlink(path)
        self.data = self.buf[:K * ws * CAP].view(K, ws, CAP)
        self.flags = self.buf[K * ws * CAP:].view(torch.int64).view(2, K, ws)
        self.seq = 0
        self.ex = ex

    def all_gather(self, output, input):
        self.seq += 1
        s, k, me = self.seq, self.seq % K, self.ex.rank
        nb = input.numel() * input.element_size()
        assert nb <= CAP
        readf, readyf = self.flags[1, k], self.flags[0, k]
        while int(readf.min()) < s - K:
            time.sleep(0)
        self.data[k, me, :nb].copy_(input.view(-1).view(torch.uint8))
        readyf[me] = s

        def finish():
            chunks = output.view(torch.uint8).view(ws, nb)
            for q in range(ws):
                if q == me:
                    if output.data_ptr() + me * nb != input.data_ptr():
                        chunks[q].copy_(input.view(-1).view(torch.uint8))
                    continue
                while int(readyf[q]) != s:
                    time.sleep(0)
                chunks[q].copy_(self.data[k, q, :nb])
            readf[me] = s
        return Work(None, finish)

if os.environ.get("SHM"):
    orig_channel = C.channel

    def channel(ex):
        ch = orig_channel(ex)
        shm = Shm(ch)
        ch._p2p_all_gather = shm.all_gather
        return ch
    A.channel = channel


def make(stage):
    torch.manual_seed(0)
    m = TinyGPT(65, n_layer=12, n_head=4, d_model=256, block_size=64)
    if stage == 3:
        return zero_py.initialize(m, torch.optim.AdamW, stage=3, wrap_policy={Block}, lr=1e-3)
    if stage == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP
        d = DDP(m)
        return d, torch.optim.AdamW(d.parameters(), lr=1e-3)
    return zero_py.initialize(m, torch.optim.AdamW, stage=stage, lr=1e-3)


g = torch.Generator().manual_seed(rank)
x = torch.randint(0, 65, (4, 64), generator=g)
y = torch.randint(0, 65, (4, 64), generator=g)
runs = {s: make(s) for s in (0, 2, 3)}


def step(m, o):
    _, loss = m(x, y)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.item()


for m, o in runs.values():
    for _ in range(3):
        step(m, o)
res = {s: [] for s in runs}
for _ in range(8):
    for s, (m, o) in runs.items():
        dist.barrier()
        t = time.perf_counter()
        step(m, o)
        step(m, o)
        res[s].append((time.perf_counter() - t) / 2)
losses = [step(m, o) for s, (m, o) in runs.items()]
if rank == 0:
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   "?")
    print(f"CPU: {cpu}; {ws} ranks; all-gathers of stage 3 through "
          f"{'shared memory' if os.environ.get('SHM') else 'gloo'}")
    for s in res:
        name = {0: "DDP", 2: "stage 2", 3: "stage 3"}[s]
        print(f"{name}: {1e3 * statistics.median(res[s]):.1f} ms, "
              f"{statistics.median(res[s]) / statistics.median(res[0]):.3f}x DDP")
    print("losses", losses)
dist.barrier()
dist.destroy_process_group()

"""Train a tiny character-level GPT on the Python standard library with ZeRO.

Run on two CPU processes (gloo):

    torchrun --nproc-per-node 2 -m zero_py.examples.demo [--steps 600] [--stage 2] [--batch-size 32]
                                                         [--json demo.json]

or on one (``python -m zero_py.examples.demo``; it then makes its own one-rank process group).
On several nodes, ``--hybrid node`` shards inside each node and replicates across nodes
(docs/scale-out.md).

The model is not wrapped: every rank builds the same ``TinyGPT``, ``ZeroOptimizer`` broadcasts
rank 0's parameters, reduces gradients to their owners after ``loss.backward()`` and all-gathers
the updated parameters in ``step()``. Each rank draws its own random batches. Rank 0 shows a
progress bar (tqdm), the train and validation loss, a generated sample, and a table of every
rank's memory under zero_py beside what DDP with ``torch.optim.AdamW`` would hold. ``--json``
writes every rank's memory and the time of its forward, backward and optimizer step, as records
``python -m zero_py plot --json`` draws (zero_py/tools/plot.py).

``TinyGPT``, ``load_corpus`` and ``get_batch`` are also used by the tests and benchmarks;
importing this module does no work.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_py
from zero_py.collectives import gather_object


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        # No bias on q, k, v: the key bias has an exactly-zero gradient in exact arithmetic
        # (softmax ignores a constant added to a row of scores), so its gradient is rounding
        # noise, which Adam scales up to lr-sized steps, and two correct implementations
        # (even torch's own fused and for-loop AdamW) drift apart there.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, d_model, n_head, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LayerNorm blocks
    (causal self-attention, GELU MLP 4x), final LayerNorm and an untied lm_head."""

    def __init__(self, vocab_size, n_layer=2, n_head=4, d_model=128, block_size=64, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, n_new, temperature=1.0, generator=None):
        """Append n_new sampled tokens to idx (B, T)."""
        for _ in range(n_new):
            logits, _ = self(idx[:, -self.block_size:])
            probs = F.softmax(logits[:, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def load_corpus(max_bytes=3 * 2**20, val_fraction=0.1):
    """The standard library's top-level .py files, sorted by name, up to max_bytes, as a
    byte-level corpus. Returns (train, val, vocab): int64 token tensors and the bytes object
    whose i-th byte is token i."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    raw = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
    vocab = torch.unique(raw)
    lookup = torch.zeros(256, dtype=torch.long)
    lookup[vocab] = torch.arange(len(vocab))
    tokens = lookup[raw]
    n_val = int(len(tokens) * val_fraction)
    return tokens[:-n_val], tokens[-n_val:], bytes(vocab.tolist())


def get_batch(tokens, batch_size, block_size, generator):
    """Random windows of tokens: inputs (B, T) and next-token targets (B, T)."""
    starts = torch.randint(len(tokens) - block_size, (batch_size, 1), generator=generator)
    windows = tokens[starts + torch.arange(block_size + 1)]
    return windows[:, :-1], windows[:, 1:]


def init_distributed():
    """Join the torchrun process group, or make a one-rank group when not launched by torchrun."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        # an in-memory store: a one-rank group needs no rendezvous (and leaves no file behind)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, tokens, batch_size, block_size, n_batches, generator):
    """Mean loss over n_batches random batches on every rank, averaged across ranks."""
    model.eval()
    total = sum(model(*get_batch(tokens, batch_size, block_size, generator))[1].item()
                for _ in range(n_batches))
    model.train()
    mean = torch.tensor(total / n_batches, dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def learning_rate(step, steps, peak, warmup=30):
    """Linear warm-up to peak over `warmup` steps, then cosine decay to zero at `steps`."""
    return peak * min(1.0, step / warmup) * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / steps))


def memory_table(reports, stage):
    """Markdown table of each rank's memory_report(): zero_py's bytes beside DDP's."""
    mib = 2.0**20
    rows = [f"| rank | params | grads | optimizer states | zero_py stage {stage} total "
            "| (padding) | DDP params | DDP grads | DDP optimizer states | DDP total "
            "| zero_py / DDP |", "|---:" * 11 + "|"]
    for rank, r in enumerate(reports):
        ours = r["params"] + r["grads"] + r["optimizer_states"]
        ddp = r["ddp_params"] + r["ddp_grads"] + r["ddp_optimizer_states"]
        cells = [r["params"], r["grads"], r["optimizer_states"], ours, r["padding"],
                 r["ddp_params"], r["ddp_grads"], r["ddp_optimizer_states"], ddp]
        rows.append(f"| {rank} | " + " | ".join(f"{c / mib:.2f}" for c in cells)
                    + f" | {ours / ddp:.2f} |")
    return "\n".join(rows) + ("\n(MiB; padding: alignment bytes of zero_py's flat buffers, "
                              "counted in params)")


def write_records(path, reports, stage, model, bucket_bytes):
    """Every rank's (memory_report(), step times) as the records of zero_py/tools/plot.py."""
    world = len(reports)
    model_args = {"vocab_size": model.tok_emb.num_embeddings, "n_layer": len(model.blocks),
                  "n_head": model.blocks[0].attn.n_head, "d_model": model.tok_emb.embedding_dim,
                  "block_size": model.block_size}
    records = [{"world": world, "stage": stage, "rank": rank, "times": times,
                "model": model_args, "bucket_bytes": bucket_bytes, "source": "demo",
                "model_states": r["params"] + r["grads"] + r["optimizer_states"],
                "ddp_model_states": r["ddp_params"] + r["ddp_grads"] + r["ddp_optimizer_states"]}
               for rank, (r, times) in enumerate(reports)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--bucket-kib", type=int, default=256,
                        help="gradient bucket size (the library's 25 MiB default exceeds "
                        "this whole model)")
    parser.add_argument("--hybrid", choices=("node",), default=None,
                        help="hybrid sharding: shard inside each node, replicate across nodes "
                        "(under torchrun --nnodes N)")
    parser.add_argument("--json", metavar="PATH",
                        help="write each rank's memory and step-time breakdown here (rank 0), "
                        "for python -m zero_py plot --json PATH")
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank, world = init_distributed()
    block_size = 64
    train, val, vocab = load_corpus()
    torch.manual_seed(args.seed)
    model = TinyGPT(len(vocab), block_size=block_size)
    optimizer = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=args.stage,
                                      bucket_bytes=args.bucket_kib * 1024, lr=args.lr,
                                      weight_decay=0.1, hybrid=args.hybrid)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    log = print if rank == 0 else (lambda *a, **k: None)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"TinyGPT {n_params / 1e6:.2f}M parameters, vocab {len(vocab)} bytes, "
        f"{len(train) / 1e6:.2f}M train / {len(val) / 1e6:.2f}M val tokens")
    log(f"{world} rank(s), ZeRO stage {args.stage}, batch {args.batch_size}x{block_size} per rank, "
        f"{args.bucket_kib} KiB buckets, fused C AdamW: {optimizer.uses_fused_kernel}")
    if args.hybrid:
        ex = optimizer.executor
        log(f"hybrid sharding: {ex.n_replicas} replicas of a {ex.world_size}-rank shard group "
            "(the memory table below is one replica's)")
    val_before = evaluate(model, val, args.batch_size, block_size, 10, generator)

    from tqdm import tqdm  # imported here: the model and helpers above need only torch

    # a rewritten line on a terminal; in a log, a line every tenth of the run
    tty = sys.stdout.isatty()
    bar = tqdm(total=args.steps, disable=rank != 0, file=sys.stdout, unit="step",
               dynamic_ncols=True, mininterval=0.1 if tty else 0,
               miniters=None if tty else max(1, args.steps // 10))
    losses = []
    spent = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        t0 = time.perf_counter()
        _, loss = model(*get_batch(train, args.batch_size, block_size, generator))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.perf_counter()
        if step > 1:  # the first step allocates the optimizer states
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            spent["step"] += t3 - t2
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        bar.update()
    elapsed = time.perf_counter() - start
    bar.close()

    val_after = evaluate(model, val, args.batch_size, block_size, 20, generator)
    tail = losses[-min(20, len(losses)):]
    log(f"train loss (rank 0): {losses[0]:.3f} at step 1 -> {sum(tail) / len(tail):.3f} "
        f"(mean of last {len(tail)} steps); ln(vocab) = {math.log(len(vocab)):.3f}")
    log(f"val loss: {val_before:.3f} -> {val_after:.3f}; "
        f"{args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.2f} steps/s)")

    # torch's *_object collectives need NumPy, which a torch install does not bring
    times = {k: v / max(1, args.steps - 1) for k, v in spent.items()}
    reports = gather_object(optimizer.executor, (optimizer.memory_report(), times), dst=0)
    if rank == 0:
        print(f"\nMemory per rank, zero_py stage {args.stage} vs DDP + torch.optim.AdamW:")
        print(memory_table([r for r, _ in reports], args.stage))
        if args.json:
            write_records(args.json, reports, args.stage, model, args.bucket_kib * 1024)
            print(f"\nwrote the memory and step-time records to {args.json}")
        prompt = torch.tensor([[vocab.index(b"\n")]])
        sample = model.generate(prompt, 300, generator=torch.Generator().manual_seed(args.seed))
        text = bytes(vocab[i] for i in sample[0].tolist()).decode("utf-8", errors="replace")
        print(f"\nSample:\n{text}")
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a Hugging Face causal LM (GPT-2 or Llama, built from a config) under ZeRO, then export
it with save_pretrained.

    torchrun --nproc-per-node 2 examples/train_hf_causal_lm.py --model gpt2 --stage 3 --out out/
    torchrun --nproc-per-node 2 examples/train_hf_causal_lm.py --config path/to/config.json

The model is built from a config, so nothing is downloaded: a tiny GPT-2 (tied embeddings) or
Llama by default, or any causal LM's config.json with --config. It trains on the bytes of the
Python standard library (zero_py.examples.demo.load_corpus), with activation (gradient)
checkpointing on, for any stage:

- stages 1-2: the model is built on every rank, `zero_py.initialize` returns it unchanged and a
  ZeroOptimizer over its parameters (rank 0's values are broadcast);
- stage 3: the model is built on the meta device and materialized one block at a time
  (`init_fn=model._init_weights`), each block of `model._no_split_modules` a unit.

Export: under stage 3 a parameter is only this rank's shard slice between uses, so the weights
are gathered first: `sd = zero_py.full_state_dict(model)` (collective, full values on rank 0
only), then `model.save_pretrained(out, state_dict=sd)` on rank 0. The same call works for
every stage. `--check-export` reloads the export with from_pretrained on rank 0 and compares its
logits with the trained model's.

Generation under stage 3: every forward gathers parameters collectively, so every rank must
run the same number of forwards. When ranks generate different lengths (different prompts,
stopping at EOS at different times), pass `synced_gpus=True` to `model.generate`: a rank that
has finished keeps running dummy forwards until all have (transformers sets it by itself only
for DeepSpeed ZeRO-3 and FSDP). Without it, the rank that generates longer waits for a gather
that its finished peers never join: a hang.

`--compile` wraps the model in torch.compile (inductor) under stages 1-2; under stage 3 it
compiles each block's forward instead (the stage-3 hooks around each block stay eager; see
docs/tools.md for why torch.compile(model) fails under stage 3).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist

import zero_py
from zero_py.examples.demo import get_batch, load_corpus


def tiny_config(kind: str, vocab_size: int, seq_len: int, layers: int, hidden: int):
    """A small GPT-2 (tied input and output embeddings) or Llama config."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 32), vocab_size=vocab_size,
            n_positions=seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    if kind == "llama":
        heads = max(1, hidden // 32)
        return transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq_len,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    raise ValueError(f"--model must be gpt2 or llama, got {kind!r}")


def block_classes(model) -> set:
    """The model's transformer-block classes (its _no_split_modules): stage 3's units."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules; pass a wrap "
                         "policy to zero_py.initialize yourself")
    return found


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every block (non-reentrant), in either transformers API."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build(config, stage: int, seed: int, device: torch.device, **zero_kwargs):
    """(model, optimizer) for `stage` on `device`: stages 1-2 from an ordinary build, stage 3
    from a meta build materialized unit by unit with the model's own initializer."""
    import transformers

    torch.manual_seed(seed)
    if stage == 3:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        kwargs = dict(wrap_policy=block_classes(model), init_fn=model._init_weights,
                      device=device)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config).to(device)
        kwargs = {}
    return zero_py.initialize(model, torch.optim.AdamW, stage=stage, **kwargs, **zero_kwargs)


def export(model, out_dir: str) -> None:
    """save_pretrained of the full weights, for every stage: gathered onto rank 0 (collective)."""
    state_dict = zero_py.full_state_dict(model)
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict=state_dict)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--config", help="a causal LM's config.json (instead of --model)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-checkpointing", action="store_true",
                   help="keep activations instead of recomputing them in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile (inductor)")
    p.add_argument("--generate", type=int, default=32,
                   help="tokens to generate after training (rank r generates N + 8r: the "
                   "lengths differ, hence synced_gpus=True under stage 3)")
    p.add_argument("--out", help="directory for save_pretrained (default: a temporary one)")
    p.add_argument("--check-export", action="store_true",
                   help="reload the export with from_pretrained and compare its logits")
    args = p.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    if "WORLD_SIZE" not in os.environ:  # a plain `python` run: one rank of its own
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0",
                          WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)

    train, val, vocab = load_corpus()
    if args.config:
        config = transformers.AutoConfig.from_pretrained(args.config)
        if config.vocab_size < len(vocab):
            raise SystemExit(f"{args.config}: vocab_size {config.vocab_size} < the {len(vocab)} "
                             "byte tokens of the corpus")
    else:
        config = tiny_config(args.model, len(vocab), args.seq_len, args.layers, args.hidden)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model, optimizer = build(config, args.stage, args.seed, device, lr=args.lr, weight_decay=0.1)
    if not args.no_checkpointing:
        enable_checkpointing(model)
    model.train()
    step_model = model
    if args.compile:
        if args.stage == 3:
            for m in model.modules():
                if type(m) in block_classes(model):
                    m.forward = torch.compile(m.forward)
        else:
            step_model = torch.compile(model)
    n_params = sum(zero_py.full_shape(q).numel() for q in model.parameters())
    log(f"{type(model).__name__}: {n_params / 1e6:.2f}M parameters, {world} rank(s), ZeRO stage "
        f"{args.stage}, activation checkpointing {'off' if args.no_checkpointing else 'on'}"
        f"{', torch.compile' if args.compile else ''}")

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, _ = get_batch(train, args.batch_size, args.seq_len, gen)
        loss = step_model(input_ids=x.to(device), labels=x.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            log(f"step {step:>5}/{args.steps} loss {loss.item():.3f}")
    log(f"{args.steps} steps in {time.perf_counter() - start:.1f} s; ln(vocab) = "
        f"{math.log(len(vocab)):.3f}")

    model.eval()
    if args.generate > 0:
        prompt = val[rank * 17:rank * 17 + 8].unsqueeze(0).to(device)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=args.generate + 8 * rank,
                                 do_sample=False, pad_token_id=0, synced_gpus=world > 1)
        text = bytes(vocab[i] for i in out[0].tolist()).decode("utf-8", errors="replace")
        log(f"sample (rank 0): {text!r}")

    # rank 0 writes the export: a directory made on every rank left an empty one per other rank
    out_dir = args.out or (tempfile.mkdtemp(prefix="zero_py_hf_") if rank == 0 else "")
    probe = val[:args.seq_len].unsqueeze(0).to(device)
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float().cpu()  # collective under stage 3
    export(model, out_dir)
    if rank == 0:
        log(f"saved with save_pretrained to {out_dir}")
        if args.check_export:
            again = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
            with torch.no_grad():
                reloaded = again(input_ids=probe.cpu()).logits.float()
            diff = (reloaded - logits).abs().max().item()
            log(f"reloaded with from_pretrained: max |logit difference| = {diff:.3g}")
            if diff > 1e-4:
                raise SystemExit("the exported weights do not give the trained model's logits")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

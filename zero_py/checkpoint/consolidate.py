"""A checkpoint as one file, in one process without torch.distributed: consolidate() writes the
full model weights (and optionally the full optimizer state) as safetensors, streaming one
tensor at a time; describe() is what `inspect` prints.

The weights file holds every key of the model's state_dict (tied parameters under each of
their names, persistent buffers), so model.load_state_dict(safetensors.torch.load_file(OUT))
takes it. The optimizer file holds torch.optim's state in flat form: tensor
"state.<i>.<key>" is parameter i's state `key` (i counts the parameters of the param groups in
order, as optimizer.state_dict() numbers them), and its metadata holds "param_groups" (JSON,
params as index lists) and "scalars" (JSON: per-parameter non-tensor state, such as "step");
torch_optimizer_state() turns it into the dict optimizer.load_state_dict() takes.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import torch

from zero_py.checkpoint import plain
from zero_py.checkpoint.files import TensorFileWriter
from zero_py.checkpoint.reader import Checkpoint
from zero_py.sharding.memory_order import MemoryOrder


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_SMALL_STAGING = {"staging_bytes": 1 << 20, "n_staging": 2}  # memory stays near one tensor


class _Scratch:
    """One reusable host buffer; view(dtype, numel) is its start as a tensor of that type."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(max(nbytes, 8), dtype=torch.uint8)

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.buf[:numel * dtype.itemsize].view(dtype)


def consolidate(path, out: str, dtype: Optional[torch.dtype] = None,
                optimizer_out: Optional[str] = None, verify: bool = True) -> Dict[str, int]:
    """Writes the checkpoint at `path` as full weights to `out` (in `dtype`, default each
    parameter's own) and, with `optimizer_out`, its optimizer state. Returns the bytes written."""
    ck = Checkpoint.open(path)
    try:
        if verify:
            ck.verify()
        man = ck.manifest
        weights: List[Tuple[str, str, torch.dtype, list]] = []  # (key, param name, dtype, shape)
        for name, entry in man["params"].items():
            weights.append((name, name, dtype or plain.dtype_of(entry["dtype"]), entry["shape"]))
        for alias, name in man.get("aliases", {}).items():
            entry = man["params"][name]
            weights.append((alias, name, dtype or plain.dtype_of(entry["dtype"]), entry["shape"]))
        buffers = [(name, plain.dtype_of(b["dtype"]), b["shape"])
                   for name, b in man["buffers"].items()]
        writer = TensorFileWriter(out, [(k, d, s) for k, _, d, s in weights] + buffers,
                                  {"format": "pt", "zero_py_step": str(man["step"])},
                                  **_SMALL_STAGING)
        # one buffer, the size of the largest tensor, holds each tensor in turn
        scratch = _Scratch(max((_numel(s) * d.itemsize for _, _, d, s in weights), default=0))
        try:
            for _, name, dt, shape in weights:
                entry = man["params"][name]
                exact = dt == plain.dtype_of(entry["dtype"]) or not entry.get("master")
                t = scratch.view(dt, _numel(shape))
                ck.read_into("param" if exact else "master", name, 0, t.numel(), t)
                writer.write(_logical(t, entry))
            for name, _, _ in buffers:
                writer.write(ck.buffer(name))
        except BaseException:
            writer.abort()
            raise
        sizes = {"weights": writer.close()[0]}
        if optimizer_out is not None:
            sizes["optimizer"] = _optimizer_file(ck, optimizer_out)
        return sizes
    finally:
        ck.close()


def _logical(t: torch.Tensor, entry: dict) -> torch.Tensor:
    """A parameter's elements as its pieces hold them (its memory order, the manifest's
    dim_order) as the logical tensor, row-major: what the weights file holds."""
    order = MemoryOrder.from_dim_order(entry["shape"], entry.get("dim_order"))
    return t if order.row_major else order.shaped(t).contiguous().reshape(-1)


def _optimizer_file(ck: Checkpoint, out: str) -> int:
    man = ck.manifest
    groups, order = [], []
    for g in man["optimizer"]["param_groups"]:
        ids = []
        for name in g["params"]:
            ids.append(len(order))
            order.append(name)
        groups.append({**g, "params": ids})
    specs, reads, scalars = [], [], {}
    for i, name in enumerate(order):
        entry = man["params"][name]
        st = entry.get("state") if entry.get("step") else None
        if st is None:
            continue
        numel = _numel(entry["shape"])
        for key in st["keys"]:
            specs.append((f"state.{i}.{key}", torch.float32, entry["shape"]))
            reads.append((f"state/{key}", name, numel, entry))
        sc = dict(st["scalars"])
        sc["step"] = ({"__scalar__": float(entry["step"]), "dtype": st["step_tensor"]}
                      if st.get("step_tensor") else entry["step"])
        scalars[str(i)] = sc
    meta = {"format": "pt", "param_groups": json.dumps(groups), "scalars": json.dumps(scalars),
            "optimizer": man["optimizer"]["class"]}
    writer = TensorFileWriter(out, specs, meta, **_SMALL_STAGING)
    scratch = _Scratch(max((numel * 4 for _, _, numel, _ in reads), default=0))
    try:
        for kind, name, numel, entry in reads:
            t = scratch.view(torch.float32, numel)
            ck.read_into(kind, name, 0, numel, t)
            writer.write(_logical(t, entry))
    except BaseException:
        writer.abort()
        raise
    return writer.close()[0]


def torch_optimizer_state(path: str) -> dict:
    """The state dict torch.optim's load_state_dict() takes, from a file written by
    consolidate(optimizer_out=...)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata()
        state: Dict[int, dict] = {
            int(i): {k: plain.decode(v) for k, v in sc.items()}
            for i, sc in json.loads(meta["scalars"]).items()}
        for key in f.keys():
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = f.get_tensor(key)
    groups = [{k: plain.decode(v) for k, v in g.items()}
              for g in json.loads(meta["param_groups"])]
    return {"state": state, "param_groups": groups}


def describe(path, verify: bool = True) -> str:
    """The manifest as text: a summary and a table of the files (with their checksums checked
    unless verify=False) and of the parameters. A checkpoint whose manifest does not describe
    its files is refused as load_checkpoint refuses it (Checkpoint.open: every problem, by
    file and field); one whose files fail their checksums raises CheckpointError listing
    each such file, after checking them all."""
    from zero_py.checkpoint.reader import CheckpointError

    ck = Checkpoint.open(path)
    try:
        man = ck.manifest
        lines = [f"checkpoint   {ck.path}",
                 f"format       {man['format']} version {man['version']}, saved "
                 f"{man.get('created', '(not recorded)')}",
                 f"step         {man['step']}",
                 f"world size   {man['world_size']}, stage {man['stage']}",
                 f"optimizer    {man['optimizer']['class']} "
                 f"({'fused kernel' if man['optimizer']['fused'] else 'torch.optim'}), "
                 f"{len(man['optimizer']['param_groups'])} param group(s)",
                 f"loss scaler  {'yes' if man['loss_scaler'] else 'no'}", "",
                 f"{'file':<24} {'rank':>4} {'bytes':>14} {'crc32c':>8}  check"]
        failed = []
        for name, info in sorted(man["files"].items()):
            check = "not checked"
            if verify:
                try:
                    ck.verify([name])
                    check = "OK"
                except CheckpointError as exc:
                    failed.append(str(exc))
                    check = "FAILED"
            lines.append(f"{name:<24} {info['rank']:>4} {info['bytes']:>14,} {info['crc32c']:>8}"
                         f"  {check}")
        if failed:
            raise CheckpointError(f"{len(failed)} of {len(man['files'])} file(s) failed their "
                                  "check:\n  " + "\n  ".join(failed))
        lines += ["", f"{'parameter':<40} {'shape':<18} {'dtype':<9} {'train':>5} {'step':>6}"
                  f" {'ranks':>5}"]
        total = 0
        for name, e in man["params"].items():
            total += _numel(e["shape"])
            lines.append(f"{name:<40} {str(tuple(e['shape'])):<18} {e['dtype']:<9} "
                         f"{'yes' if e['trainable'] else 'no':>5} {e.get('step', '-'):>6} "
                         f"{len(e['pieces']):>5}")
        lines.append(f"{len(man['params'])} parameters, {total:,} elements; "
                     f"{len(man.get('aliases', {}))} tied alias(es); "
                     f"{len(man['buffers'])} buffer(s)")
        return "\n".join(lines)
    finally:
        ck.close()

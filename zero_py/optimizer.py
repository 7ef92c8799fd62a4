"""ZeroOptimizer: a torch.optim.Optimizer that shards optimizer states (stage 1) and gradients
(stage 2) across the ranks of a process group.

Reading order: FlatParams (flat.py) lays the parameters out; GradReducer (reducer.py) brings
each rank the averaged gradient of its shard; this class runs the update on the shard (the C
AdamW, or any torch.optim class on views of the shard) and all-gathers the new parameters.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Dict, List, Optional, Type

import torch
import torch.distributed as dist

from zero_py import kernels, state_dict as sd_util
from zero_py.executor import TorchDistExecutor
from zero_py.flat import FlatParams
from zero_py.reducer import GradReducer

DEFAULT_BUCKET_BYTES = 25 * 2**20
DEFAULT_ALIGN_BYTES = 64
_AFFINE_DTYPES = (torch.float32,)


def _fused_adamw_ok(optimizer_class, group: dict) -> bool:
    """Whether the C AdamW computes exactly what `optimizer_class` would for this group."""
    if optimizer_class is not torch.optim.AdamW:
        return False
    flags = ("amsgrad", "maximize", "capturable", "differentiable")
    if any(group.get(f, False) for f in flags):
        return False
    if group.get("decoupled_weight_decay", True) is False:
        return False
    scalars = [group["lr"], group["eps"], group["weight_decay"], *group["betas"]]
    return all(isinstance(v, (int, float)) for v in scalars)


class ZeroOptimizer(torch.optim.Optimizer):
    """Drop-in replacement for a torch.optim optimizer under data parallelism (ZeRO 1-2).

    Use it instead of DDP + torch.optim: build the model on every rank, then
    ``opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=...)`` and train with the
    usual ``loss.backward(); opt.step(); opt.zero_grad()``. Gradients are averaged over the
    ranks as DDP does; rank 0's initial parameters are broadcast at construction.

    Args:
        params: parameters or param-group dicts, as for any torch.optim optimizer.
        optimizer_class: the torch.optim class to run on this rank's shard. AdamW runs in the
            fused C kernel; any other class runs unchanged on views of the shard.
        stage: 1 shards optimizer states; 2 also shards gradients, reduced bucket by bucket
            during backward (param.grad is then None after backward).
        process_group: the data-parallel group (default: the world).
        bucket_bytes: gradient bucket size; a bucket is one reduce-scatter.
        align_bytes: alignment of every parameter and shard in the flat buffers.
        **optimizer_kwargs: hyperparameters for optimizer_class (lr, betas, weight_decay, ...).

    Parameters with requires_grad=False at construction are kept as they are (never updated);
    float32 CPU parameters are supported (mixed precision and CUDA come in later releases).
    """

    def __init__(self, params, optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, stage: int = 2, process_group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 align_bytes: int = DEFAULT_ALIGN_BYTES, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {stage!r} (stage 3 is not available yet)")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}")
        if issubclass(optimizer_class, ZeroOptimizer):
            raise TypeError("optimizer_class must be a plain torch.optim class, not ZeroOptimizer")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if (not isinstance(align_bytes, int) or align_bytes < 4
                or align_bytes & (align_bytes - 1)):
            raise ValueError(f"align_bytes must be a power of two >= 4, got {align_bytes!r}")
        # The optimizer class validates its own keyword arguments and supplies the defaults.
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        self._constructing = True
        super().__init__(params, dict(probe.defaults))
        self._constructing = False
        self.optimizer_class = optimizer_class
        self.stage = stage
        self.executor = TorchDistExecutor(process_group)

        self._all_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        managed, groups_of, self._managed_index = [], [], []
        index = 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad and p.numel() > 0:
                    self._check_param(p, index)
                    managed.append(p)
                    groups_of.append(gi)
                    self._managed_index.append(index)
                index += 1
        if not managed:
            raise ValueError("ZeroOptimizer got no trainable parameter: every parameter has "
                             "requires_grad=False or no elements")
        self._flat = FlatParams(managed, groups_of, self.executor.world_size, self.executor.rank,
                                align_bytes, bucket_bytes)
        self._flat.broadcast(self.executor, src=0)
        self._broadcast_frozen(managed)
        self._reducer = GradReducer(self._flat, self.executor, stage)
        self._step_count = [0] * len(managed)  # per managed parameter, as torch's state["step"]

        self.uses_fused_kernel = all(_fused_adamw_ok(optimizer_class, g)
                                     for g in self.param_groups)
        self._exp_avg: Optional[torch.Tensor] = None  # fused path: flat state over the shard
        self._exp_avg_sq: Optional[torch.Tensor] = None
        self._views: Dict[int, torch.Tensor] = {}
        self._inner: Optional[torch.optim.Optimizer] = None
        if not self.uses_fused_kernel:
            self._build_inner(optimizer_kwargs)

    # -- construction ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_constructing", True):
            raise RuntimeError("ZeroOptimizer cannot add a param group after construction: the "
                               "flat layout is fixed; pass every group to the constructor")
        super().add_param_group(param_group)

    @staticmethod
    def _check_param(p: torch.Tensor, i: int) -> None:
        if p.device.type != "cpu":
            raise ValueError(f"parameter {i} is on {p.device}: this release of zero_py trains "
                             "CPU parameters (the CUDA path comes later); keep the model on CPU")
        if p.dtype not in _AFFINE_DTYPES:
            raise ValueError(f"parameter {i} has dtype {p.dtype}: this release trains float32 "
                             "parameters; cast the model with model.float()")

    def _broadcast_frozen(self, managed: List[torch.Tensor]) -> None:
        """Frozen parameters stay outside the flat buffers but start equal on every rank."""
        ids = {id(p) for p in managed}
        with torch.no_grad():
            for p in self._all_params:
                if id(p) not in ids and p.numel() > 0:
                    buf = p.detach().contiguous().clone()
                    self.executor.broadcast(buf, 0).wait()
                    p.copy_(buf)

    def _build_inner(self, optimizer_kwargs: dict) -> None:
        """The generic path: optimizer_class over 1-D views of this rank's shard, one view per
        parameter slice, so torch.optim keeps per-parameter state and skips absent gradients."""
        groups = [{"params": [], **{k: v for k, v in g.items() if k != "params"}}
                  for g in self.param_groups]
        for s in self._flat.slices:
            piece = self._flat.bucket_piece(s.bucket)
            view = piece[s.piece_lo:s.piece_hi]
            self._views[s.param] = view
            groups[self._flat.bucket_group[s.bucket]]["params"].append(view)
        if self._views:
            self._inner = self.optimizer_class(groups)

    # -- training -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (in param.grad) without reducing them, like DDP's
        no_sync(); the first backward after the block reduces everything accumulated."""
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._reducer.zero_grad(set_to_none)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            used = self._reducer.finish().tolist()
            for i, u in enumerate(used):
                if u:
                    self._step_count[i] += 1
            if any(used):
                if self.uses_fused_kernel:
                    self._fused_step(used)
                else:
                    self._generic_step(used)
            touched = [b for b in range(self._flat.n_buckets)
                       if any(used[i] for i in self._flat.bucket_params[b])]
            self._flat.all_gather(self.executor, touched)
            self._reducer.after_step()
        return loss

    def _runs(self, b: int, used: List[int]):
        """Bucket b's piece as (piece_lo, piece_hi, step) runs for the fused kernel: maximal
        stretches of parameter slices that got a gradient and share a step count. A run spans
        the padding between its slices, which is zero in p, g, m and v and stays zero."""
        run = None
        for s in self._flat.slices_of_bucket[b]:
            if not used[s.param]:
                if run is not None:
                    yield run
                run = None
                continue
            step = self._step_count[s.param]
            if run is not None and run[2] == step:
                run = (run[0], s.piece_hi, step)
            else:
                if run is not None:
                    yield run
                run = (s.piece_lo, s.piece_hi, step)
        if run is not None:
            yield run

    def _fused_step(self, used: List[int]) -> None:
        flat, grad = self._flat, self._reducer.grad_shard
        if self._exp_avg is None:
            self._exp_avg = torch.zeros_like(grad)
            self._exp_avg_sq = torch.zeros_like(grad)
        rows = array("q")
        g_base, m_base, v_base = (grad.data_ptr(), self._exp_avg.data_ptr(),
                                  self._exp_avg_sq.data_ptr())
        for b in range(flat.n_buckets):
            p_base = flat.bucket_piece(b).data_ptr()
            shard_lo = flat.bucket_shard_offset[b]
            for lo, hi, step in self._runs(b, used):
                at = (shard_lo + lo) * 4  # fp32 bytes into the shard-space tensors
                rows.extend((p_base + lo * 4, g_base + at, m_base + at, v_base + at, hi - lo,
                             step, flat.bucket_group[b], 0))
        groups = [kernels.adamw_group_row(g["lr"], g["betas"][0], g["betas"][1], g["eps"],
                                          g["weight_decay"]) for g in self.param_groups]
        kernels.adamw_step_segments(rows, groups, n_threads=torch.get_num_threads())

    def _generic_step(self, used: List[int]) -> None:
        if self._inner is None:
            return
        grad = self._reducer.grad_shard
        for i, view in self._views.items():
            s = self._flat.slice_of_param[i]
            view.grad = grad[s.shard_lo:s.shard_lo + s.numel] if used[i] else None
        for mine, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in mine.items() if k != "params"})
        self._inner.step()

    # -- state dicts ----------------------------------------------------------------------------

    def _slice_state(self, i: int) -> Optional[dict]:
        """Managed parameter i's state on this rank (its slice), or None before its first step."""
        s = self._flat.slice_of_param[i]
        if self.uses_fused_kernel:
            if self._exp_avg is None or self._step_count[i] == 0:
                return None
            r = slice(s.shard_lo, s.shard_lo + s.numel)
            return {"step": torch.tensor(float(self._step_count[i]), dtype=torch.float32),
                    "exp_avg": self._exp_avg[r].clone(), "exp_avg_sq": self._exp_avg_sq[r].clone()}
        state = self._inner.state.get(self._views[i]) if self._inner is not None else None
        if not state:
            return None
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}

    def _groups_for_dict(self) -> List[dict]:
        index = {id(p): k for k, p in enumerate(self._all_params)}
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, in torch's format plus a "zero_py" entry
        saying which slice of each parameter it holds. Every rank saves its own."""
        state, slices = {}, {}
        for s in self._flat.slices:
            index = self._managed_index[s.param]
            slices[index] = (s.param_lo, s.param_hi)
            st = self._slice_state(s.param)
            if st is not None:
                state[index] = st
        meta = {"format": sd_util.FORMAT_VERSION, "stage": self.stage,
                "world_size": self.executor.world_size, "rank": self.executor.rank,
                "optimizer": self.optimizer_class.__name__, "slices": slices}
        return {"state": state, "param_groups": self._groups_for_dict(), "zero_py": meta}

    def consolidate_state_dict(self, to: int = 0) -> Optional[dict]:
        """The full optimizer state dict, in torch.optim's own format (loadable by
        optimizer_class), returned on group rank `to` and None elsewhere. Collective: every rank
        must call it."""
        gathered = self.executor.gather_object(self.state_dict(), to)
        if gathered is None:
            return None
        shapes = {k: p.shape for k, p in enumerate(self._all_params)}
        full = sd_util.merge_shards(gathered, shapes)
        full["state"] = {k: full["state"][k] for k in sorted(full["state"])}
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads either this rank's shard dict (from state_dict() of a run with the same world
        size and layout) or a full torch-format dict (from consolidate_state_dict(), or from a
        plain torch.optim optimizer of the same class), at any world size."""
        sd_util.check_groups(state_dict["param_groups"], self.param_groups)
        shard = sd_util.is_shard_dict(state_dict)
        if shard:
            meta = state_dict["zero_py"]
            mine = {self._managed_index[s.param]: (s.param_lo, s.param_hi)
                    for s in self._flat.slices}
            theirs = {int(k): tuple(v) for k, v in meta["slices"].items()}
            if (meta["world_size"], meta["rank"]) != (self.executor.world_size,
                                                       self.executor.rank) or theirs != mine:
                raise ValueError(
                    f"this shard state dict is rank {meta['rank']} of {meta['world_size']} with "
                    f"another layout than rank {self.executor.rank} of "
                    f"{self.executor.world_size} here; save with consolidate_state_dict() and "
                    "load the full dict to change world size or bucket settings")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        fused = all(_fused_adamw_ok(self.optimizer_class, g) for g in self.param_groups)
        if fused != self.uses_fused_kernel:
            raise ValueError("the loaded hyperparameters (e.g. amsgrad, maximize) need another "
                             "update path than this optimizer was built with; construct "
                             "ZeroOptimizer with the same options as the saved run")
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        self._step_count = [0] * len(self._step_count)
        if self._exp_avg is not None:
            self._exp_avg.zero_()
            self._exp_avg_sq.zero_()
        if self._inner is not None:
            self._inner.state.clear()
        for s in self._flat.slices:
            st = saved_state.get(self._managed_index[s.param])
            if st is None:
                continue
            if not shard:
                st = sd_util.slice_full_state(st, s.param_lo, s.param_hi,
                                              self._flat.params[s.param].numel())
            self._install(s, st)

    def _install(self, s, st: dict) -> None:
        if self.uses_fused_kernel:
            missing = {"step", "exp_avg", "exp_avg_sq"} - set(st)
            if missing:
                raise ValueError(f"state of parameter {self._managed_index[s.param]} lacks "
                                 f"{sorted(missing)}; is it an AdamW state dict?")
            if self._exp_avg is None:
                self._exp_avg = torch.zeros_like(self._reducer.grad_shard)
                self._exp_avg_sq = torch.zeros_like(self._reducer.grad_shard)
            r = slice(s.shard_lo, s.shard_lo + s.numel)
            self._exp_avg[r].copy_(st["exp_avg"].reshape(-1))
            self._exp_avg_sq[r].copy_(st["exp_avg_sq"].reshape(-1))
            self._step_count[s.param] = int(float(st["step"]))
            return
        view = self._views[s.param]
        self._inner.state[view] = {
            k: (v.detach().to(view.device, view.dtype if v.is_floating_point() and v.dim() > 0
                              else v.dtype).clone()
                if isinstance(v, torch.Tensor) else v)
            for k, v in st.items()}
        if "step" in st:
            self._step_count[s.param] = int(float(st["step"]))

    # -- accounting -------------------------------------------------------------------------

    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds for model states, beside what DDP + torch.optim would hold.

        params: flat parameter buffers (padding included) and frozen parameters; grads: the
        gradient shard plus the most bucket buffers live at once (and, in stage 1, the full
        param.grad); optimizer_states: state tensors of this rank's shard. ddp_grads counts
        param.grad and the flat copy DDP's reducer keeps in its buckets by default
        (gradient_as_bucket_view=False)."""
        fp = self._flat
        psi = sum(p.numel() for p in fp.params)
        ids = {id(p) for p in fp.params}
        frozen = sum(p.numel() * p.element_size() for p in self._all_params if id(p) not in ids)
        params = sum(b.numel() * b.element_size() for b in fp.buffers) + frozen
        grads = self._reducer.grad_shard.numel() * 4 + self._reducer.peak_bucket_bytes
        if self.stage == 1:
            grads += psi * 4
        states = self.optimizer_state_bytes()
        # state per element: the fused path keeps it over the whole shard, padding included;
        # torch.optim keeps it per parameter slice
        local = fp.shard_numel if self.uses_fused_kernel else sum(s.numel for s in fp.slices)
        per_elem = states / local if local else 0.0
        return {"params": params, "grads": grads, "optimizer_states": states,
                "padding": fp.padding_numel * 4,
                "ddp_params": psi * 4 + frozen, "ddp_grads": 2 * psi * 4,
                "ddp_optimizer_states": int(round(per_elem * psi))}

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors on this rank (0 before the first step)."""
        if self.uses_fused_kernel:
            if self._exp_avg is None:
                return 0
            return 2 * self._exp_avg.numel() * 4
        if self._inner is None:
            return 0
        return sum(v.numel() * v.element_size() for st in self._inner.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)

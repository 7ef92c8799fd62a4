"""ZeroOptimizer's memory accounting (a mixin of zero_py/optim/optimizer.py): the bytes this
rank holds for model states, by kind and place (device, host, NVMe), beside what DDP +
torch.optim would hold. tools/estimate.py predicts these numbers from sizes alone, and the
tests check both against measurement."""

from __future__ import annotations

from typing import Dict

import torch


class MemoryAccounting:
    """Needs the optimizer's _flat, _all_params, _reducer, _update, _masters, _host, _early,
    executor, stage and uses_fused_kernel."""

    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds for model states, beside what DDP + torch.optim would hold
        with the same precision recipe (fp32 optimizer states and, for bf16/fp16 parameters,
        fp32 masters).

        params: flat parameter buffers (padding included) and frozen parameters; grads: the
        gradient shard plus the most bucket buffers live at once and the executor's
        reduce-scatter receive buffers, the error-feedback residuals of grad_error_feedback
        (and, in stage 1, the full param.grad);
        optimizer_states: state tensors of this rank's shard and its fp32 masters, on the
        device (0 under offload_optimizer="cpu"); host_optimizer_states: the same in host memory
        under offload (fp32 masters of every bucket, fp32 ones included, and overlap_step's
        backup); host_grads: the host copy of the gradient shard and the staging of updated
        bf16/fp16 values (offload).
        Under offload_optimizer="nvme": host_optimizer_states is the ring of host buffers and
        nvme_optimizer_states the offload file (both slots of every record). Stage 3:
        host_params is the parameter shards in host memory (offload_params="cpu") or the ring
        of the parameter file (offload_params="nvme"), and nvme_params that file.
        ddp_grads counts param.grad and the flat copy DDP's reducer keeps in its buckets by
        default (gradient_as_bucket_view=False)."""
        fp = self._flat
        managed = {id(p) for p in fp.params}
        frozen = [p for p in self._all_params if id(p) not in managed]
        report = fp.param_bytes(frozen)
        param_bytes = sum(n * p.element_size() for n, p in zip(fp.param_numel, fp.params))
        psi = sum(fp.param_numel)
        master_psi = sum(n for n, p in zip(fp.param_numel, fp.params) if p.dtype != torch.float32)
        grads = (self._reducer.grads.nbytes() + self._reducer.peak_bucket_bytes
                 + getattr(self.executor, "scratch_peak_bytes", 0)  # receive buffers
                 + self._reducer.residual_bytes)  # grad_error_feedback
        if self.stage == 1:
            grads += param_bytes
        states = self._update.state_bytes()
        host = self._host.nbytes() if self._host is not None else None
        if host is not None and self._early is not None:  # overlap_step's backup
            host = {**host, "host_masters": host["host_masters"] + self._early.nbytes()}
        store = getattr(self._update, "store", None)  # offload_optimizer="nvme"
        if store is not None:
            host = {"host_masters": store.host_bytes(), "host_grads": 0}
        # state per element: the fused path keeps it over the whole shard, padding included;
        # torch.optim keeps it per parameter slice
        local = fp.shard_numel if self.uses_fused_kernel else sum(s.numel for s in fp.slices)
        per_elem = (len(self._update.keys) * 4 if store is not None  # (states are on NVMe)
                    else states / local if local else 0.0)
        return {**report, "grads": grads,
                "optimizer_states": 0 if host else states + self._masters.nbytes(),
                "host_optimizer_states": states + host["host_masters"] if host else 0,
                "host_grads": host["host_grads"] if host else 0,
                "nvme_optimizer_states": store.file_bytes if store is not None else 0,
                "ddp_grads": 2 * param_bytes,
                "ddp_optimizer_states": int(round(per_elem * psi)) + 4 * master_psi}

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors and fp32 masters on this rank (states are
        allocated at the first step)."""
        store = getattr(self._update, "store", None)
        if store is not None:  # both slots of every record of the offload file
            return store.file_bytes // 2
        host = self._host.nbytes()["host_masters"] if self._host is not None else None
        return self._update.state_bytes() + (self._masters.nbytes() if host is None else host)

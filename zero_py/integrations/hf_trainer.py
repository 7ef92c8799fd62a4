"""Hugging Face's Trainer over a zero_py model: `ZeroTrainer` in place of `transformers.Trainer`
(or `ZeroTrainerMixin` first among a Trainer subclass's bases: `class SFT(ZeroTrainerMixin,
trl.SFTTrainer)`), built with `optimizers=(zero_py optimizer, scheduler)`.

A plain Trainer moves the model to `args.device` when it is built (on the CPU that is
"cpu:0", and `tensor.to("cpu:0")` copies a "cpu" tensor), then hands the model and the
optimizer to accelerate, which, at more than one rank, moves the model again and wraps it in
DistributedDataParallel. Over a zero_py model both are wrong: the move gives each parameter
new storage outside zero_py's buffers (the first step refused it: ".data ... was replaced"),
DDP reduces the gradients a second time, and under stage 3 DDP's construction compares the
ranks' shard slices and fails ("params[0] in this process with sizes [0] appears not to
match"). Trainer also saves `optimizer.state_dict()` of rank 0 alone (`optimizer.pt`) and
loads that file on every rank at resume: a zero_py state dict is one rank's shard, so the
other ranks refuse it.

ZeroTrainer leaves the model where zero_py.initialize found it; its accelerator prepares the
model for evaluation only (autocast and torch.compile as configured: no DDP, no move) and the
optimizer without a device placement (no state-dict round trip); `accelerator.no_sync`
(gradient accumulation) is the optimizer's `no_sync()` under stages 1-2 (stage 3 reduces
each micro-batch, as DeepSpeed's ZeRO-3 does under Trainer); its checkpoints keep the
optimizer with `zero_py.save_checkpoint` in `<checkpoint>/zero_py` (every rank its shard,
the scheduler's state in its `extra`), which `train(resume_from_checkpoint=...)` loads, at
any world size. `max_grad_norm` needs nothing: Trainer clips with
torch.nn.utils.clip_grad_norm_ over model.parameters(), which is the optimizer's
clip_grad_norm_ (the norm over every rank's gradients).
"""

from __future__ import annotations

import contextlib
import os

import torch

OPTIMIZER_DIR = "zero_py"  # the optimizer's checkpoint inside Trainer's checkpoint folder


def _zero_optimizer(trainer):
    from zero_py.optim.optimizer import ZeroOptimizer

    opt = getattr(trainer, "optimizer", None)
    inner = getattr(opt, "optimizer", None)  # already wrapped by accelerate
    for o in (opt, inner):
        if isinstance(o, ZeroOptimizer):
            return o
    manager = getattr(getattr(trainer, "model", None), "_zero_py", None)
    if opt is None and manager is not None and manager.optimizer is not None:
        # as optimizers=(that optimizer, None): Trainer builds its scheduler from args over it
        # (rather than a torch.optim one of its own over zero_py's parameters)
        trainer.optimizer = manager.optimizer
        return trainer.optimizer
    raise ValueError(
        "zero_py.integrations.hf_trainer.ZeroTrainer: the Trainer has no zero_py "
        f"optimizer (it has {type(opt).__name__}). Build it first and pass it in: `model, "
        "optimizer = zero_py.initialize(model, torch.optim.AdamW, stage=..., lr=...)`, then "
        "`ZeroTrainer(model=model, ..., optimizers=(optimizer, scheduler))` (a scheduler "
        "over that optimizer, e.g. transformers.get_linear_schedule_with_warmup(optimizer, "
        "...); None: Trainer builds one from its arguments)")


def _check_model(trainer, opt) -> None:
    model = trainer.model
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        raise ValueError(
            "zero_py.integrations.hf_trainer.ZeroTrainer: the Trainer's model is wrapped "
            f"in {type(model).__name__}; give the Trainer the bare model zero_py.initialize "
            "returned (ZeroTrainer stops accelerate from wrapping it)")
    mine = {id(p) for p in model.parameters()}
    theirs = [p for g in opt.param_groups for p in g["params"]]
    if not any(id(p) in mine for p in theirs):
        raise ValueError(
            "zero_py.integrations.hf_trainer.ZeroTrainer: the zero_py optimizer does not "
            "train the Trainer's model (none of its parameters is the model's): pass "
            "Trainer(model=...) the model zero_py.initialize returned with that optimizer")


def _adapt(trainer) -> None:
    """Points `trainer`'s accelerator and its optimizer checkpoints at zero_py (see above)."""
    opt = _zero_optimizer(trainer)
    _check_model(trainer, opt)
    acc = trainer.accelerator
    if getattr(acc, "_zero_py_prepared", None) is opt:
        return
    prepare_model, prepare_optimizer = acc.prepare_model, acc.prepare_optimizer
    model = trainer.model

    def zero_prepare_model(m, device_placement=None, evaluation_mode=False):
        if m is model:  # autocast / compile as configured; no DDP, no .to(device)
            return prepare_model(m, device_placement=False, evaluation_mode=True)
        return prepare_model(m, device_placement=device_placement,
                             evaluation_mode=evaluation_mode)

    def zero_prepare_optimizer(o, device_placement=None):
        if o is opt:  # its state is in zero_py's shards: no state_dict round trip
            device_placement = False
        return prepare_optimizer(o, device_placement=device_placement)

    acc.prepare_model, acc.prepare_optimizer = zero_prepare_model, zero_prepare_optimizer
    if not opt._flat.params_sharded:  # stages 1-2: accumulate without reducing, as DDP
        acc.no_sync = lambda model=None: opt.no_sync()
    else:
        acc.no_sync = lambda model=None: contextlib.nullcontext()

    save_original = trainer._save_optimizer_and_scheduler
    load_original = trainer._load_optimizer_and_scheduler

    def save_optimizer_and_scheduler(output_dir):
        import zero_py

        if trainer.args.save_only_model:
            return save_original(output_dir)
        sched = trainer.lr_scheduler
        zero_py.save_checkpoint(os.path.join(output_dir, OPTIMIZER_DIR), model, opt,
                                extra={"scheduler": sched.state_dict()} if sched else None)

    def load_optimizer_and_scheduler(checkpoint):
        import zero_py

        if checkpoint is None:
            return None
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            if os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
                raise ValueError(
                    f"zero_py: Trainer checkpoint {checkpoint!r} has an optimizer.pt but no "
                    f"{OPTIMIZER_DIR}/ folder: it was saved by a plain Trainer (its "
                    "optimizer.pt holds one rank's shard only, or a torch.optim state). Load "
                    "a torch.optim state with optimizer.load_state_dict(torch.load(...)) "
                    "before train(), or resume from a checkpoint saved by ZeroTrainer")
            return load_original(checkpoint)
        extra = zero_py.load_checkpoint(path, model, opt)
        if trainer.lr_scheduler is not None and extra and "scheduler" in extra:
            trainer.lr_scheduler.load_state_dict(extra["scheduler"])
        return None

    trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
    acc._zero_py_prepared = opt


class ZeroTrainerMixin:
    """Put first among the bases of a transformers.Trainer (sub)class; see the module's doc."""

    def __init__(self, *args, **kwargs):
        # Trainer moves the model before it keeps `optimizers`: a ZeroOptimizer built
        # directly (its model has no _zero_py) must be known by then
        self._zero_py_given = (kwargs.get("optimizers") or (None,))[0]
        super().__init__(*args, **kwargs)
        _adapt(self)

    def _managed(self, model) -> bool:
        from zero_py.optim.optimizer import ZeroOptimizer

        if getattr(model, "_zero_py", None) is not None:
            return True
        opt = self._zero_py_given
        if not isinstance(opt, ZeroOptimizer):
            return False
        theirs = {id(p) for g in opt.param_groups for p in g["params"]}
        return any(id(p) in theirs for p in model.parameters())

    def _move_model_to_device(self, model, device):
        if not self._managed(model):
            return super()._move_model_to_device(model, device)
        device = torch.device(device)
        away = [n for n, p in model.named_parameters() if p.device.type != device.type]
        if away:
            raise ValueError(
                f"zero_py: the Trainer trains on {device}, but parameter {away[0]!r} of its "
                f"zero_py model is on {model.get_parameter(away[0]).device}: move the model to "
                f"{device.type} before zero_py.initialize (zero_py keeps each parameter in "
                "its own buffers, so the Trainer does not move it)")
        # on its device already: torch's .to("cpu:0") would copy it out of zero_py's buffers

    def save_model(self, output_dir=None, _internal_call=False):
        """Under stage 3 every rank gathers the weights (Trainer saves on rank 0 alone, whose
        model.state_dict() would gather by itself only on one host)."""
        opt = _zero_optimizer(self)
        if not opt._flat.params_sharded:
            return super().save_model(output_dir, _internal_call)
        import zero_py

        full = zero_py.full_state_dict(self.model)  # collective; the full dict on rank 0
        save = self._save
        self._save = lambda out=None, state_dict=None: save(
            out, state_dict=full if state_dict is None else state_dict)
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            del self._save


def __getattr__(name):
    if name == "ZeroTrainer":  # built on first use: zero_py imports transformers only here
        import transformers

        global ZeroTrainer
        ZeroTrainer = type("ZeroTrainer", (ZeroTrainerMixin, transformers.Trainer), {
            "__doc__": "transformers.Trainer for a zero_py model; see "
                       "zero_py.integrations.hf_trainer",
            "__module__": __name__})
        return ZeroTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Bad input to ZeroOptimizer gets an exception whose message says what to change."""

import copy

import pytest
import torch
import torch.nn as nn

import zero_py


def test_needs_an_initialized_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        zero_py.ZeroOptimizer(nn.Linear(2, 2).parameters())


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(stage=3), ValueError, "ZeroOptimizer takes stage 1 or 2"),
    (dict(optimizer_class=nn.Linear), TypeError, "torch.optim.Optimizer subclass"),
    (dict(bucket_bytes=0), ValueError, "bucket_bytes"),
    (dict(align_bytes=48), ValueError, "power of two"),
    (dict(lr=-1.0), ValueError, "Invalid learning rate"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
])
def test_bad_arguments(single_rank_group, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters(), **kwargs)


# torch.optim classes whose update reads a whole parameter: run on a rank's 1-D slice of it,
# Adafactor trained silently to other values (its factored second moment and RMS-scaled step)
WHOLE_PARAMETER = [name for name in ("Adafactor", "Muon", "LBFGS", "SparseAdam")
                   if hasattr(torch.optim, name)]


@pytest.mark.parametrize("name", WHOLE_PARAMETER)
def test_optimizers_that_read_whole_parameters_are_refused(single_rank_group, name):
    cls = getattr(torch.optim, name)
    with pytest.raises(ValueError, match=f"cannot run torch.optim.{name}: .*1-D slice"):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters(), cls)
    subclass = type("Mine", (cls,), {})  # a subclass updates as its base does
    with pytest.raises(ValueError, match=f"cannot run torch.optim.{name}"):
        zero_py.initialize(nn.Linear(4, 4), subclass, stage=3)


def test_differentiable_is_refused(single_rank_group):
    """differentiable=True (torch.optim recording the update in the autograd graph) cannot be
    honoured on fp32 shards updated outside autograd; it used to train as without it, silently:
    refused as an argument, in a param group, a group added later and a loaded dict."""
    match = r"differentiable=True \({}\) cannot be honoured.*drop differentiable"
    with pytest.raises(ValueError, match=match.format("the optimizer's options")):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters(), torch.optim.RMSprop,
                              differentiable=True)
    with pytest.raises(ValueError, match=match.format("the optimizer's options")):
        zero_py.initialize(nn.Linear(4, 4), torch.optim.AdamW, stage=3, differentiable=True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=match.format("param group 1")):
        zero_py.ZeroOptimizer([{"params": model[0].parameters()},
                               {"params": model[1].parameters(), "differentiable": True}],
                              torch.optim.SGD, lr=0.1)
    opt = zero_py.ZeroOptimizer(model[0].parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=match.format("param group 1")):
        opt.add_param_group({"params": model[1].parameters(), "differentiable": True})
    saved = opt.state_dict()
    saved["param_groups"][0]["differentiable"] = True
    with pytest.raises(ValueError, match=match.format("param group 0")):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("offload", [None, "cpu", "nvme"])
def test_a_group_value_the_kernel_refuses_names_its_group_and_changes_nothing(
        single_rank_group, offload, tmp_path):
    """torch.optim checks only its constructor's values; the fused kernel refuses some that a
    param group may hold (a negative weight decay). The refusal names the param group (it
    named the kernel's row: 'group 0' for param group 1), and nothing moves: once the value is
    put back, training goes on as torch.optim's does (the step counts had moved: the next
    step's bias correction was one step ahead). A group no step updates (a layer outside the
    forward) is not read, as torch.optim does not read it."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model = copy.deepcopy(ref)

    def groups(m):
        return [{"params": m[0].parameters()}, {"params": m[1].parameters()},
                {"params": m[2].parameters(), "weight_decay": -1.0}]

    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    opt = zero_py.ZeroOptimizer(groups(model), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                offload_optimizer=offload,
                                offload_dir=str(tmp_path) if offload == "nvme" else None)
    x = torch.randn(8, 4)
    for k in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            m[:2](x * (k + 1)).pow(2).mean().backward()
            if o is opt and k == 1:
                # a value the kernel cannot read at all said only "could not convert string
                # to float: 'x'" (or "cannot unpack non-iterable float object")
                for key, bad, said in (("lr", "x", "could not convert string to float"),
                                       ("betas", 0.9, "cannot unpack")):
                    good, o.param_groups[1][key] = o.param_groups[1][key], bad
                    with pytest.raises(ValueError, match=r"^param group 1: a hyperparameter "
                                       r"the fused kernel cannot read \((TypeError|ValueError): "
                                       f"{said}.*betas a pair of numbers"):
                        o.step()
                    o.param_groups[1][key] = good
                o.param_groups[1]["weight_decay"] = -0.1
                with pytest.raises(ValueError, match=r"^param group 1: weight_decay must be "
                                   r"finite and >= 0, got -0.1 \(zero_py's fused adamw"):
                    o.step()
                o.param_groups[1]["weight_decay"] = 0.1
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()


def _sgd_step(opt, model):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_state_switched_on_that_cannot_be_added_is_refused(single_rank_group, tmp_path):
    """torch.optim.Adam cannot take amsgrad after its first step; an SGD momentum switched on
    later is added (tests/test_torch_idioms.py) except where the state's layout is fixed."""
    model = nn.Linear(4, 4)
    opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.Adam)
    _sgd_step(opt, model)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad was switched on after construction"):
        _sgd_step(opt, model)
    for options in (dict(offload_optimizer="nvme", offload_dir=str(tmp_path)),
                    dict(offload_optimizer="cpu", overlap_step=1.0)):
        model = nn.Linear(4, 4)
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, **options)
        _sgd_step(opt, model)
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)  # momentum on
        with pytest.raises(ValueError, match="construct it with momentum != 0"):
            _sgd_step(opt, model)
        del opt


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bad_gradient_names_its_parameter(single_rank_group, stage):
    """A sparse gradient is refused in the gradient hook, naming the parameter (stage 3's
    storage indices mean nothing to the user). initialize refuses an embedding built with
    sparse=True; one switched to it afterwards reaches the hook."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    # initialize passes the names at every stage (named_parameters() to ZeroOptimizer would
    # too, where torch's optimizers take (name, tensor) pairs: not torch 2.4)
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage)
    model[0].sparse = True
    with pytest.raises(RuntimeError, match="parameter '0.weight' has a sparse gradient"):
        model(torch.randint(0, 10, (3,))).sum().backward()
    assert opt.stage == stage  # alive until here: its gradient hooks make the check


def test_bad_parameters(single_rank_group):
    with pytest.raises(ValueError, match="dtype torch.float64"):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).double().parameters())
    for stage in (1, 3):  # initialize knows the names: the message gives them
        with pytest.raises(ValueError, match=r"parameter '1.weight' \(index 0\) has dtype "
                                             "torch.float64"):
            zero_py.initialize(nn.Sequential(nn.Tanh(), nn.Linear(4, 4)).double(), stage=stage)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter.*keep it a plain model"):
        zero_py.ZeroOptimizer(frozen.parameters())
    # a frozen reference model (RLHF/DPO) or teacher given alone: the message says what to do
    for stage in (1, 3):
        with pytest.raises(ValueError, match="no trainable parameter.*keep it a plain model"
                                             + ".*submodule of the trained model" * (stage == 3)):
            zero_py.initialize(frozen, stage=stage)
        assert frozen.weight.shape == (4, 4) and not hasattr(frozen, "_zero_py")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(grad_reduce_dtype=torch.float64), ValueError, "grad_reduce_dtype"),
    (dict(loss_scaler=2.0**16), TypeError, "zero_py.LossScaler"),
    (dict(optimizer_class=torch.optim.RMSprop, stochastic_rounding=True), ValueError,
     "stochastic_rounding needs a fused optimizer"),
])
def test_bad_precision_options(single_rank_group, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_stochastic_rounding_without_bf16_parameters_is_refused(single_rank_group, dtype):
    """It used to be taken and do nothing: an fp16 model trained bitwise as with round to
    nearest even."""
    with pytest.raises(ValueError, match="rounds bf16 parameters.*has none"):
        zero_py.ZeroOptimizer(nn.Linear(4, 4).to(dtype).parameters(), stochastic_rounding=True)


@pytest.mark.parametrize("kwargs,match", [(dict(init_scale=0.0), "init_scale"),
                                          (dict(growth_factor=1.0), "growth_factor"),
                                          (dict(backoff_factor=1.5), "backoff_factor"),
                                          (dict(growth_interval=0), "growth_interval"),
                                          (dict(min_scale=-1.0), "min_scale")])
def test_bad_loss_scaler(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        zero_py.LossScaler(**kwargs)


def test_clip_rejects_bad_norm_type(single_rank_group):
    opt = zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters())
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=-1.0)


def test_state_dict_of_another_layout_is_refused(single_rank_group):
    opt = zero_py.ZeroOptimizer(nn.Linear(4, 4).parameters())
    sd = opt.state_dict()
    sd["zero_py"]["world_size"] = 2
    with pytest.raises(ValueError, match="consolidate_state_dict"):
        opt.load_state_dict(sd)
    other = zero_py.ZeroOptimizer(nn.Linear(4, 5).parameters())
    sd = other.state_dict()
    sd["param_groups"][0]["params"].append(9)
    with pytest.raises(ValueError, match="model differs"):
        opt.load_state_dict(sd)


def test_single_rank_training_matches_torch(single_rank_group):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    b.load_state_dict(a.state_dict())
    za = zero_py.ZeroOptimizer(a.parameters(), lr=1e-2)
    tb = torch.optim.AdamW(b.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(10):
        for model, opt in ((a, za), (b, tb)):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_step_with_closure_returns_the_loss(single_rank_group):
    model = nn.Linear(4, 1)
    opt = zero_py.ZeroOptimizer(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    before = model.weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(before, model.weight)


def test_loss_scaler_skips_overflow_and_saves_its_state(single_rank_group):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = zero_py.ZeroOptimizer(model.parameters(), lr=1e-2,
                                loss_scaler=zero_py.LossScaler(init_scale=2.0**10,
                                                               growth_interval=1))
    x = torch.randn(8, 4)
    opt.scale_loss(model(x).pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()
    assert not opt.last_step_skipped and opt.loss_scale == 2.0**11  # grew after 1 clean step
    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("nan")
    opt.scale_loss(model(bad).pow(2).mean()).backward()
    opt.step()
    opt.zero_grad()
    assert opt.last_step_skipped and opt.skipped_steps == 1 and opt.loss_scale == 2.0**10
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    other = zero_py.ZeroOptimizer(nn.Linear(4, 2).parameters(), lr=1e-2,
                                  loss_scaler=zero_py.LossScaler())
    other.load_state_dict(opt.state_dict())
    assert other.loss_scale == 2.0**10 and other.loss_scaler.growth_interval == 1

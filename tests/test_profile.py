"""zero_py.profile(): a 2-rank run's Chrome trace holds zero_py's labels beside the model's own
operators, for stages 1, 2 and 3; the labelled run's values equal an unlabelled run's; on exit
every wrapped method is the class's again."""

import json
import os

import pytest
import torch
import torch.nn as nn

import distributed
import zero_py
from zero_py.tools.profile import LABELS, profile

STEPS = 2


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(x)))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Block(), Block(), nn.Linear(32, 1))


def _run(model, opt, rank):
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(16, 8, generator=gen)).square().mean()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _body(rank, world_size, trace_dir):
    out = {}
    for key, stage in ((1, 1), (2, 2), (3, 3), ("quantized", 2)):
        kwargs = ({"wrap_policy": {Block}} if stage == 3
                  else {"quantized_grads": "int8"} if key == "quantized" else {})
        plain = _run(*zero_py.initialize(_model(), stage=stage, lr=1e-2, bucket_bytes=4096,
                                         **kwargs), rank)
        model, opt = zero_py.initialize(_model(), stage=stage, lr=1e-2, bucket_bytes=4096,
                                        **kwargs)
        path = os.path.join(trace_dir, f"{key}_rank{{rank}}.json")
        with profile(model, trace=path) as p:
            assert "zero_py.copy_grad" in p.installed
            labelled = _run(model, opt, rank)
        objects = (opt, opt._update, opt._reducer, opt._flat, opt.executor,
                   opt._reducer.executor,  # the quantized wire, when there is one
                   getattr(opt._flat, "executor", None), getattr(opt, "_engine", None))
        left = [name for obj in objects if obj is not None for name in vars(obj)
                if getattr(vars(obj)[name], "_zero_py_label", None)]
        with open(p.trace_path) as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name") for e in events if e.get("ph") == "X"}
        out[key] = {"same": plain == labelled, "labels": sorted(n for n in names
                                                                  if n.startswith("zero_py.")),
                      "compute": any(n.startswith("aten::") for n in names),
                      "left": left, "path": p.trace_path, "installed": p.installed}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed.run(_body, 2, str(tmp_path_factory.mktemp("traces")))


WANT = {
    1: {"zero_py.step", "zero_py.update", "zero_py.publish_params", "zero_py.all_gather",
        "zero_py.reduce_scatter", "zero_py.copy_grad", "zero_py.wait_grads",
        "zero_py.clip_grad_norm", "zero_py.all_reduce"},
    2: {"zero_py.step", "zero_py.update", "zero_py.publish_params", "zero_py.all_gather",
        "zero_py.reduce_scatter", "zero_py.copy_grad", "zero_py.wait_grads",
        "zero_py.wait_reduce_scatter"},
    3: {"zero_py.step", "zero_py.update", "zero_py.reduce_scatter", "zero_py.copy_grad",
        "zero_py.gather_unit", "zero_py.wait_unit", "zero_py.free_unit", "zero_py.all_gather"},
    # qgZ: the quantized reduce-scatter's exchange is an all-to-all
    "quantized": {"zero_py.step", "zero_py.reduce_scatter", "zero_py.all_to_all"},
}


@pytest.mark.parametrize("stage", [1, 2, 3, "quantized"])
def test_trace_shows_labels_beside_compute(results, stage):
    for rank, res in enumerate(results):
        r = res[stage]
        assert r["path"].endswith(f"{stage}_rank{rank}.json")
        missing = WANT[stage] - set(r["labels"])
        assert not missing, f"rank {rank} stage {stage}: no {sorted(missing)} in the trace"
        assert set(r["labels"]) <= set(LABELS)
        assert r["compute"], "the model's own operators are missing from the trace"


@pytest.mark.parametrize("stage", [1, 2, 3, "quantized"])
def test_labels_change_no_value_and_are_removed(results, stage):
    for res in results:
        assert res[stage]["same"], "the labelled run's losses differ from the unlabelled run's"
        assert res[stage]["left"] == [], res[stage]["left"]


def test_profile_needs_a_managed_model():
    with pytest.raises(TypeError, match="zero_py.initialize"):
        with profile(nn.Linear(2, 2)):
            pass
    with pytest.raises(TypeError, match="profile\\(model\\)"):
        with profile():
            pass

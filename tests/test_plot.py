"""`python -m zero_py plot` as `make demo` runs it: the demo under torchrun writes its records
(--json), the plot command draws them beside the estimate in two PNGs. The records it draws are
checked against an independent account (zero_py.estimate_memory, itself checked against
measured RSS in test_estimate.py), and the step times against the demo's own wall time."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None or importlib.util.find_spec("tqdm") is None,
    reason="matplotlib and tqdm are not installed (make deps installs them)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(cmd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def demo_and_plot(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    records = out / "demo.json"
    demo = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "-m", "zero_py.examples.demo", "--steps", "4",
                 "--batch-size", "4", "--json", str(records)])
    # --no-measure: the measuring runs are tested through `bench` (tests/test_cli.py)
    plot = _run([sys.executable, "-m", "zero_py", "plot", "--json", str(records), "--no-measure",
                 "--max-world", "4", "--out", str(out)])
    return out, demo, plot


@pytest.mark.slow  # a 2-rank demo run and the plots: ~45 s (make test-long)
def test_demo_writes_records_and_plot_writes_pngs(demo_and_plot):
    out, demo, plot = demo_and_plot
    assert "4/4" in demo.stdout  # tqdm's bar reached the end
    for name in ("memory.png", "step_time.png"):
        path = out / name
        assert f"wrote {path}" in plot.stdout
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name


@pytest.mark.slow  # a 2-rank demo run and the plots: ~45 s (make test-long)
def test_records_agree_with_the_estimate(demo_and_plot):
    import torch

    from zero_py.examples.demo import Block, TinyGPT
    from zero_py.tools.estimate import estimate_memory
    from zero_py.tools.plot import estimated_curves

    out, demo, _ = demo_and_plot
    steps, elapsed = re.search(r"(\d+) steps in ([\d.]+) s", demo.stdout).groups()
    records = json.loads((out / "demo.json").read_text())
    assert sorted(r["rank"] for r in records) == [0, 1]
    model_args = records[0]["model"]
    curves = estimated_curves(model_args, records[0]["bucket_bytes"], [1, 2])
    with torch.device("meta"):
        model = TinyGPT(**model_args)
    est = estimate_memory(model, 2, 2, bucket_bytes=records[0]["bucket_bytes"],
                          wrap_policy={Block})
    assert curves[2][1] == est.total - est.buffers  # the line drawn is the estimate's
    for r in records:
        assert r["world"] == 2 and r["stage"] == 2
        assert abs(r["model_states"] / curves[2][1] - 1) < 0.10, r
        assert r["ddp_model_states"] > r["model_states"]
        assert all(t > 0 for t in r["times"].values())
        # the timed parts of steps 2.. fit in the wall time the demo measured for all steps
        assert sum(r["times"].values()) * (int(steps) - 1) <= float(elapsed) + 0.05


def test_plot_without_input_says_so(capsys):
    from zero_py.__main__ import main  # `python -m zero_py plot --no-measure`, in this process

    assert main(["plot", "--no-measure"]) == 2
    assert "nothing to plot" in capsys.readouterr().err

"""`python -m zero_py ...`: `--help` runs as users run it, in a subprocess (the
module entry point itself); the other checks call its main() in this process (a subprocess
costs seconds of imports each, ten of them a minute of the suite on a loaded 2-vCPU host).

--help lists every registered command; `estimate` prints the table (and JSON equal to
zero_py.tools.estimate.estimate_memory's answer), counts a Hugging Face config's parameters
like the model built from it, and says what to change for bad input; `env` reports the
versions, the kernels' instruction set and the CUDA/NCCL answer of the library itself.
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import zero_py
from zero_py.__main__ import COMMANDS, build_parser
from zero_py.__main__ import main as zp_main
from zero_py.tools.estimate import estimate_memory, model_from_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "zero_py", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"python -m zero_py {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def run_main(*args):
    """`python -m zero_py ARGS` in this process (its main(), exit status and output), for
    checks of messages alone: a subprocess costs seconds of imports each."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = zp_main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_help_lists_every_command():
    out = run_cli("--help").stdout
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = list(sub.choices)
    assert len(names) >= len(COMMANDS)  # each module registers at least one command
    assert {"estimate", "env"} <= set(names)
    for name in names:
        assert name in out, f"`python -m zero_py --help` does not list {name}"


def test_estimate_table_for_a_parameter_count():
    out = run_main("estimate", "--params", "7e9", "--world", "8", "--stage", "3").stdout
    assert "stage 3" in out and "DDP" in out
    for row in ("params", "grads", "optimizer states", "stage-3 working set", "buffers",
                "total"):
        assert row in out
    assert "--unit-params" in out  # the assumption is said
    side = run_main("estimate", "--params", "7B", "--world", "8").stdout
    assert all(f"stage {s}" in side for s in (1, 2, 3))
    assert "7,000,000,000 parameters" in side
    proc = run_main("estimate", "--params", "seven", "--world", "8")
    assert proc.returncode == 2 and "not a parameter count" in proc.stderr


def test_estimate_json_is_estimate_memory():
    out = run_main("estimate", "--params", "1.3e9", "--world", "4", "--dtype", "bf16",
                   "--unit-params", "5e7", "--json").stdout
    data = json.loads(out)
    for s in (1, 2, 3):
        want = estimate_memory(1.3e9, 4, s, torch.bfloat16, largest_unit=50_000_000).as_dict()
        assert data["stages"][str(s)] == want


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (make deps installs it)")
def test_estimate_from_a_hugging_face_config(tmp_path):
    import transformers

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 200, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # the folder holding config.json, through the CLI's main(); the file itself, directly
    data = json.loads(run_main("estimate", "--config", str(tmp_path), "--world", "2",
                               "--json").stdout)
    real = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in cfg.items() if k != "model_type"}))
    assert data["param_count"] == sum(p.numel() for p in real.parameters())
    assert data["model"].startswith("LlamaForCausalLM")
    built = model_from_hf_config(str(tmp_path / "config.json"))
    assert sum(p.numel() for p in built.parameters()) == data["param_count"]


def test_estimate_errors_say_what_to_change(tmp_path):
    proc = run_main("estimate", "--params", "1e9", "--world", "2", "--stage", "4")
    assert proc.returncode == 2 and "--stage takes 1, 2, 3" in proc.stderr
    proc = run_main("estimate", "--params", "1e9", "--world", "0")
    assert proc.returncode == 2 and "--world must be >= 1" in proc.stderr
    proc = run_main("estimate", "--world", "2")
    assert proc.returncode == 2 and "--params" in proc.stderr and "--config" in proc.stderr
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    proc = run_main("estimate", "--config", str(tmp_path), "--world", "2")
    assert proc.returncode == 2 and "model_type" in proc.stderr


def test_an_unwritable_output_is_said_at_once(tmp_path):
    """A path the user gave that cannot be written is one line and exit status 1, before any
    measuring (plot used to measure for minutes, then end in a traceback)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_main("plot", "--out", str(blocker / "plots"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "python -m zero_py plot:" in proc.stderr and "Traceback" not in proc.stderr
    assert "measuring" not in proc.stdout


def test_env_reports_this_machine():
    from zero_py._native import _C
    from zero_py.collectives import nccl
    from zero_py.kernels import cuda

    data = json.loads(run_main("env", "--json").stdout)
    assert data["torch"] == torch.__version__
    assert data["zero_py"].startswith(zero_py.__version__)
    assert data["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert data["CPU kernels"].startswith(_C.cpu_isa())
    for key in ("safetensors", "transformers", "CPU"):
        assert data[key]
    why = cuda.unavailable_reason()
    assert data["CUDA kernels"] == ("usable" if why is None else f"no: {why}")
    why = nccl.unavailable_reason()
    if why is None:
        assert data["NCCL executor"].startswith("usable")
    else:
        assert data["NCCL executor"] == f"no: {why}"
    table = run_main("env").stdout
    assert "CPU kernels" in table and "NCCL executor" in table


def test_help_lists_plot_and_bench():
    out = run_main("--help").stdout
    for name in ("estimate", "env", "consolidate", "inspect", "plot", "bench"):
        assert name in out, f"`python -m zero_py --help` does not list {name}"
    assert "--nproc" in run_main("bench", "--help").stdout


@pytest.mark.slow  # a torchrun of the step-time benchmark: ~20 s (make test-long)
def test_bench_prints_the_table(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--nproc", "2", "--stages", "2,ddp", "--steps", "1",
                  "--json", str(path)).stdout
    records = json.loads(path.read_text())
    assert sorted((r["stage"], r["rank"]) for r in records if r["stage"] != "ddp") == [
        (2, 0), (2, 1)]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| zero_py") or
            line.startswith("| DDP")}
    assert set(rows) == {"zero_py stage 2", "DDP + torch.optim.AdamW"}
    stage2 = next(r for r in records if r["stage"] == 2 and r["rank"] == 0)
    cells = rows["zero_py stage 2"]
    assert cells[0] == "2"  # ranks
    assert float(cells[4]) == pytest.approx(1e3 * sum(stage2["times"].values()), abs=0.01)
    assert float(cells[6]) == pytest.approx(stage2["model_states"] / 2**20, abs=0.01)
    assert stage2["model_states"] < stage2["ddp_model_states"]  # stage 2 shards grads, states
    assert rows["DDP + torch.optim.AdamW"][5] == "1.00x"
    proc = run_cli("bench", "--stages", "4", check=False)
    assert proc.returncode == 2 and "stages are 1, 2, 3 or ddp" in proc.stderr

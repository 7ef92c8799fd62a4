"""Multi-node launches, on one machine: two `torchrun --nnodes 2 --node-rank {0,1}` processes
meeting on a loopback rendezvous (2 nodes x 2 ranks), as two real nodes would. They run the
parity check of stages 1-3 against DDP, sharded over the world and with hybrid="node"
(tests/multinode_worker.py), and the demo, plain and with --hybrid node."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args, timeout=240):
    """Both launches of one 2 x 2 job; returns their (returncode, output). The outputs go to
    files: a pipe read only once the other launch has ended could fill and stall its writer.
    A launch that fails ends the wait (its peer would wait for it until the timeout), and
    whatever is still running then is killed with its workers (a session of its own)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"node{n}.log"), "w+") for n in (0, 1)]
        procs = [subprocess.Popen(cmd + ["--node-rank", str(n)] + args, stdout=logs[n],
                                  stderr=subprocess.STDOUT, text=True, env=env,
                                  start_new_session=True) for n in (0, 1)]
        deadline = time.monotonic() + timeout
        try:
            while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
                   and all(p.poll() in (None, 0) for p in procs)):
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        outs = []
        for p, log in zip(procs, logs):
            log.seek(0)
            text = log.read()
            log.close()
            if p.returncode == -signal.SIGKILL:
                text += f"\n[killed: still running after {timeout} s, or its peer failed]"
            outs.append((p.returncode, text))
    return outs


def test_two_nodes_match_ddp_for_every_stage(tmp_path):
    out = str(tmp_path / "result.json")
    runs = _two_nodes([os.path.join(HERE, "multinode_worker.py"), out])
    for code, text in runs:
        assert code == 0, text[-3000:]
    with open(out) as f:
        result = json.load(f)
    assert (result["world"], result["nodes"], result["local_world"]) == (4, 2, 2)
    for stage in (1, 2, 3):
        assert result[f"stage{stage}"] < 1e-5, result
        assert result[f"hybrid_stage{stage}"] < 1e-5, result


# make test runs the demo over two nodes with hybrid sharding; sharded over the world, the two
# nodes' parity with DDP stands for it there (make test-long runs both)
@pytest.mark.parametrize("hybrid", [pytest.param([], marks=pytest.mark.slow),
                                    ["--hybrid", "node"]], ids=["sharded", "hybrid"])
def test_demo_runs_on_two_nodes(hybrid):
    runs = _two_nodes(["-m", "zero_py.examples.demo", "--steps", "3", "--batch-size", "4"]
                      + hybrid)
    for code, text in runs:
        assert code == 0, text[-3000:]
    out = runs[0][1] + runs[1][1]
    assert "loss" in out.lower()
    if hybrid:
        assert "2 replicas of a 2-rank shard group" in out, out[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

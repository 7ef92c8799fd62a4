"""Shared fixtures. tests/ is on sys.path (pytest rootdir-relative imports), so test modules
import the helpers `distributed` and `models` directly."""

import os
import tempfile

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group():
    """A gloo process group of one rank inside the pytest process, for fast checks."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()

"""zero_py: ZeRO (Zero Redundancy Optimizer) for PyTorch, with a C core.

    import zero_py
    model, optimizer = zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=3e-4)
    optimizer = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=3e-4)

See README.md for the quick start and docs/architecture.md for how the code is organised.
"""

from zero_py import kernels
from zero_py.api import full_shape, full_state_dict, gathered, initialize
from zero_py.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zero_py.optim.lion import Lion
from zero_py.optim.loss_scaler import LossScaler
from zero_py.optim.optimizer import ZeroOptimizer
from zero_py.tools.estimate import MemoryEstimate, estimate_memory
from zero_py.tools.profile import profile

__version__ = "0.1.0"
__all__ = ["ZeroOptimizer", "initialize", "gathered", "full_state_dict", "full_shape",
           "LossScaler", "Lion", "kernels", "save_checkpoint", "load_checkpoint",
           "CheckpointError", "estimate_memory", "MemoryEstimate", "profile",
           "__version__"]

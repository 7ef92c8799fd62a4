"""Test oracles: slow pure-PyTorch references of every kernel (reference.py). Not imported by
the runtime."""

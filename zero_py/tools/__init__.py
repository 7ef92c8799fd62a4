"""Tools beside training: the memory estimator (estimate.py) and the environment report
(env.py), each also a `python -m zero_py` command."""

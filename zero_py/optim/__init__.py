"""The optimizer: ZeroOptimizer (optimizer.py, with its arguments.py, update_path.py, training.py,
grad_stats.py, accounting.py and persistence.py) over a storage of the sharding layer, the
update of a rank's shard (update.py), optimizer state dicts (state_dict.py), loss scaling and
Lion."""

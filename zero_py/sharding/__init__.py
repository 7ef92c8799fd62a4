"""The sharding layer: who owns which bytes (layout.py, from the C planner), where the values
live (storage.py: flat buffers for stages 1-2, shards for stage 3), how a model is cut into
units (units.py) and the gradient path (reducer.py, with its buckets.py, residuals.py,
announcements.py and finish.py)."""

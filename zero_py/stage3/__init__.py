"""Stage 3: the engine (hooks and prefetch over sharded storage), model state dicts, and
partitioned construction from the meta device. The entry point is zero_py.initialize."""

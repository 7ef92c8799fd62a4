"""Configuration from other frameworks' formats: DeepSpeed's JSON config (deepspeed.py), with
its learning-rate schedules (schedules.py) and loss-scaling policy (loss_scaling.py)."""

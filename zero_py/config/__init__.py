"""Configuration from other frameworks' formats: DeepSpeed's JSON config (deepspeed.py,
ds_plan.py, ds_zero.py), with
its learning-rate schedules (schedules.py) and loss-scaling policy (loss_scaling.py)."""

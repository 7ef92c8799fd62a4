"""Configuration from other frameworks' formats: DeepSpeed's JSON config (deepspeed.py, with
ds_plan.py and ds_zero.py), its learning-rate schedules (schedules.py) and its loss-scaling
policy (loss_scaling.py)."""

"""Adapters between zero_py and other libraries' training loops (imported on demand, so that
zero_py does not import them): `hf_trainer` for Hugging Face's Trainer."""

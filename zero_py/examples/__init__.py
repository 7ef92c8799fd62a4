"""Examples: `python -m zero_py.examples.demo` (make demo) trains a small GPT under ZeRO."""

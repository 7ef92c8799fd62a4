"""Loads the C core (zero_py._C) with an error that says how to build it."""

try:
    from zero_py import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "zero_py's C extension (zero_py._C) is not built or does not load: "
        f"{exc}. Build it with `make build` (or `pip install .`) from the source tree."
    ) from exc

__all__ = ["_C"]

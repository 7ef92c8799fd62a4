"""Direct file I/O through the C engine (csrc/io/engine.h): aligned host buffers, files opened
with O_DIRECT where the file system allows it, reads and writes with several requests in
flight. The base of the NVMe tier of offload (not built yet) and of benchmarks/io_engine.py."""

from zero_py.io.engine import (IO_ALIGN, DirectFile, IoEngine, SequentialWriter, aligned_empty,
                               default_engine)

__all__ = ["IoEngine", "DirectFile", "SequentialWriter", "aligned_empty", "default_engine",
           "IO_ALIGN"]

"""Where parameter values live: the flat buffers of stages 1-2 and the shards of stage 3.

FlatParams (stages 1-2, flat_params.py): every managed parameter's .data is a view into one
flat buffer per dtype; every rank holds every value, and owns one piece per bucket.

ShardedParams (stage 3, sharded_params.py, with GatherMeter and full_shape): a rank keeps only
its pieces (the shards); a unit's full values exist only while it is gathered.

PieceStore (piece_store.py): one piece per bucket packed into one tensor per dtype (gradient
shards, fp32 masters, the stage-3 shards).

Both storages answer publish(executor, buckets) (make updated pieces every rank's parameters),
param_bytes(frozen) (the parameter terms of memory_report) and describe_bucket(b) (what a
failed collective names), so the optimizer never needs to know which stage it serves. This
module is that contract and the one place the rest of the package imports the storages from.
"""

from zero_py.sharding.flat_params import FlatParams
from zero_py.sharding.piece_store import PieceStore
from zero_py.sharding.sharded_params import (NO_BUCKET_LIMIT, GatherMeter, ShardedParams,
                                             full_shape)

__all__ = ["FlatParams", "PieceStore", "ShardedParams", "GatherMeter", "full_shape",
           "NO_BUCKET_LIMIT"]

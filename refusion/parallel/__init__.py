"""Running one model over several processes: the processes themselves (launch.py), and
the tensor-parallel split's names (`model/tensor_parallel.py`) re-exported here."""

from ..model.tensor_parallel import Shard, check_divisible, local_config
from .launch import (
    barrier,
    gather_to_main,
    is_main,
    join_torchrun,
    launched,
    replica_claims,
    spawn,
    tensor_shard,
    work_counter,
)

__all__ = [
    "Shard",
    "barrier",
    "check_divisible",
    "gather_to_main",
    "is_main",
    "join_torchrun",
    "launched",
    "local_config",
    "replica_claims",
    "spawn",
    "tensor_shard",
    "work_counter",
]

"""Running one model over several processes: tensor parallelism (tensor.py) and the
processes themselves (launch.py)."""

from .launch import barrier, is_main, join_torchrun, launched, spawn, tensor_shard, work_counter
from .tensor import Shard, check_divisible, local_config

__all__ = ["Shard", "barrier", "check_divisible", "is_main", "join_torchrun", "launched", "local_config", "spawn", "tensor_shard", "work_counter"]

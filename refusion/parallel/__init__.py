"""Running one model over several processes: tensor parallelism (tensor.py) and the
processes themselves (launch.py)."""

from .launch import is_main, launched, spawn, tensor_shard
from .tensor import Shard, check_divisible, local_config

__all__ = ["Shard", "check_divisible", "is_main", "launched", "local_config", "spawn", "tensor_shard"]

"""Running one model over several processes: tensor parallelism (tensor.py) and the
processes themselves (launch.py)."""

from .launch import launched, spawn, tensor_shard
from .tensor import Shard, check_divisible, local_config

__all__ = ["Shard", "check_divisible", "launched", "local_config", "spawn", "tensor_shard"]

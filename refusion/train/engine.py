"""Which engine `accelerate launch --config_file configs/X.yaml` asked for (DDP, FSDP or
DeepSpeed), and the `Accelerator` that runs it, also on a machine without a GPU.

accelerate 1.x takes its FSDP and DeepSpeed paths only on an accelerator: on the CPU it
quietly runs DDP instead (an FSDP or DeepSpeed config "works", and nothing is sharded).
torch's FSDP2 and DeepSpeed (DS_ACCELERATOR=cpu, gloo) both run on CPU processes, so here
each engine is put on the path it was asked for: FSDP by turning accelerate's CPU process
group into an FSDP one, DeepSpeed by giving accelerate the gloo backend. What cannot run
is refused in one line that names the config and what to use instead.

The launch config reaches the processes as environment variables (ACCELERATE_USE_FSDP,
FSDP_*, ACCELERATE_USE_DEEPSPEED, ...), which is what is read here, before accelerate
builds anything: the checks need neither torch's FSDP nor deepspeed to be importable."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from ..errors import ConfigError

_CONFIGS = {
    "ddp": "configs/ddp.yaml",
    "fsdp": "configs/fsdp.yaml",
    "deepspeed": "configs/deepspeed_zero2.yaml / configs/deepspeed_zero3.yaml",
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def launched_engine() -> str:
    """The engine of the `accelerate launch` config this process runs under ("ddp" when
    launched by torchrun, or not launched at all)."""
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return "ddp"


def check_engine(engine: str, cpu: bool, has_gpu: bool) -> None:
    """Refuse, in one line, an engine this machine cannot run, before accelerate tries and
    fails with a stack trace (or, on the CPU, silently runs another engine)."""
    if engine != "ddp" and cpu and has_gpu:  # the engines would place their shards on the GPU regardless
        raise ConfigError(
            f"--cpu with a {engine} launch config ({_CONFIGS[engine]}) on a machine with a GPU is not "
            f"supported: drop --cpu, or launch with {_CONFIGS['ddp']}"
        )
    if engine == "fsdp" and cpu and os.environ.get("FSDP_VERSION", "1") != "2":
        # accelerate's FSDP1 plugin asks for a GPU's current device (sync_module_states)
        raise ConfigError(
            "FSDP1 (fsdp_version: 1 in the launch config) does not run on the CPU through accelerate: "
            "set fsdp_version: 2, as configs/fsdp.yaml does"
        )
    if engine != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"the launch config ({_CONFIGS['deepspeed']}) uses DeepSpeed, which is not installed: "
            "pip install --no-build-isolation deepspeed, "
            f"or launch with {_CONFIGS['ddp']} or {_CONFIGS['fsdp']}"
        )


def make_accelerator(cpu: bool, has_gpu: bool, **kwargs: Any) -> Any:
    """The Accelerator for this run, on the engine the launch config asked for. `cpu`: the
    run is on the CPU (asked for, or no accelerator exists); `kwargs` go to Accelerator."""
    from accelerate import Accelerator

    engine = launched_engine()
    check_engine(engine, cpu, has_gpu)
    if not cpu or engine == "ddp":
        # cpu=True is what makes accelerate join a torchrun / accelerate-launch process group
        # on the CPU (gloo) instead of ignoring it
        return Accelerator(cpu=cpu, **kwargs)
    if engine == "deepspeed":
        return _deepspeed_on_cpu(**kwargs)
    return _fsdp_on_cpu(Accelerator(cpu=True, **kwargs))


def configure_deepspeed(ds_config: dict[str, Any], cfg: Any, world: int) -> None:
    """We batch and clip ourselves, DeepSpeed checks and clips itself: give it this run's
    step (a global batch it would otherwise take from the launch config and refuse as not
    micro-batch x accumulation x processes) and --max-grad-norm (DeepSpeed clips with its
    own gradient_clipping; 0 = off in both)."""
    ds_config["train_micro_batch_size_per_gpu"] = cfg.batch_size
    ds_config["gradient_accumulation_steps"] = cfg.grad_accum
    ds_config["train_batch_size"] = cfg.batch_size * cfg.grad_accum * world
    ds_config["gradient_clipping"] = cfg.max_grad_norm


def _deepspeed_on_cpu(**kwargs: Any) -> Any:
    """accelerate initialises DeepSpeed's process group only when not told cpu=True, and then
    with its GPU backend: without a GPU that is none, and every process would train alone.
    Naming gloo gives DeepSpeed a CPU process group, and accelerate its ranks."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = [*kwargs.pop("kwargs_handlers", []), InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(cpu=False, kwargs_handlers=handlers, **kwargs)


def _fsdp_on_cpu(acc: Any) -> Any:
    """accelerate reads the FSDP plugin from the launch config but applies it only on an
    accelerator; on the CPU it leaves a plain gloo process group (DDP). torch's FSDP2 runs
    on that group, so the state is marked FSDP with the config's plugin: prepare() then
    shards the model, save_state() writes sharded states and get_state_dict() gathers."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if acc.distributed_type != DistributedType.MULTI_CPU:  # one process: nothing to shard
        return acc
    state = AcceleratorState()
    state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launch config's FSDP_* variables
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc

"""The authors' reference decodings (tests/golden/) and the tiny model they were made with,
shared by the tests that must reproduce them."""

import json
from pathlib import Path

from safetensors.torch import load_file

from refusion.model.transformer import Transformer
from refusion.settings.decode import DecodeConfig
from refusion.settings.model import ModelConfig

GOLDEN = Path(__file__).parent / "golden"
CASES = [json.loads(line) for line in (GOLDEN / "refusion_cases.jsonl").read_text().splitlines()]


def load_tiny() -> Transformer:
    model = Transformer(ModelConfig.from_json(GOLDEN / "tiny-qwen3" / "config.json"))
    model.load_state_dict(load_file(GOLDEN / "tiny-qwen3" / "model.safetensors"), strict=False)
    return model.eval()


def golden_config(c: dict, **changes) -> DecodeConfig:
    """The ReFusion settings a golden case was decoded with (its own EOS), with `changes`."""
    return DecodeConfig(
        method="refusion",
        gen_length=c["gen_length"],
        slot_size=c["slot_size"],
        serial_blocks=c["serial_blocks"],
        slot_threshold=c["slot_threshold"],
        token_threshold=c["token_threshold"],
        stop_token_ids=(c["eos_id"],),
    ).replace(**changes)

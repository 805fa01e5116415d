"""The authors' reference decodings (tests/golden/) and the tiny model they were made with,
shared by the tests that must reproduce them."""

import json
from pathlib import Path

from safetensors.torch import load_file

from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer

GOLDEN = Path(__file__).parent / "golden"
CASES = [json.loads(line) for line in (GOLDEN / "refusion_cases.jsonl").read_text().splitlines()]


def load_tiny() -> Transformer:
    model = Transformer(ModelConfig.from_json(GOLDEN / "tiny-qwen3" / "config.json"))
    model.load_state_dict(load_file(GOLDEN / "tiny-qwen3" / "model.safetensors"), strict=False)
    return model.eval()

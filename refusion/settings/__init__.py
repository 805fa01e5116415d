"""Settings: plain dataclasses, no torch, below every stage. `ModelConfig` (a checkpoint's
architecture facts), `DecodeConfig` (how one request is decoded), `EngineConfig` (what an
engine may use), `Recommended` (a checkpoint's `decode_config.json`), `TrainConfig` and
`ObjectiveConfig`, and the field metadata and checks they share (`fields`).

They sit at the bottom so that every stage may read them: the CLI builds its flags from
them without torch, io reads a checkpoint's recommended settings, and the sizing rule
computes memory from a config alone (docs/architecture.md#settings-at-the-bottom).
"""

"""`refusion bench <what>`: commands that print figures side by side in one run.

One module per benchmark, named as the command (`decode`, `speed`, `suite`, `curve`,
`diagnose`, `train`, `load`, `served`), with `add_arguments(parser)` and `run(args) -> int`; the
larger ones keep their parts beside them (`decode_report`, `flops`; `floors`,
`speed_sections`, `speed_quantized`, `speed_report`; `suite_measure`, `suite_report`).
`results` writes what a command printed to its page in docs/results/ (`--results`).
"""

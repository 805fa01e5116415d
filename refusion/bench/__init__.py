"""`refusion bench <what>`: commands that print figures side by side in one run.

One module per benchmark with `add_arguments(parser)` and `run(args) -> int`.
"""

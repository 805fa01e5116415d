"""The HTTP layer: what every request passes before the OpenAI protocol sees it."""

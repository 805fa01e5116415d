"""The HTTP layer: what every request passes before the OpenAI protocol reads it.

- `observe.py`: the ASGI wrapper around the app: the API key, per-route counts and latency
- `auth.py`: the one check of the API key (the server's and the replica front's)
- `limits.py`: the body's size and JSON, and the request threads that parse and tokenise
- `errors.py`: every error as a response in OpenAI's shape, counted by type
- `disconnect.py`: a client that goes away before its response begins
"""

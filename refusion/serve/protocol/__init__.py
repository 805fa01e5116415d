"""The OpenAI wire format: what a request may say, and what the server answers.

- `requests.py`: a completion request's body checked field by field (`parse_request`),
  its decode settings (`request_config`) and each prompt prepared by the engine's
  admission (`admit`)
- `messages.py`: a chat request's messages, and what of them the chat template is shown
- `structured.py`: `response_format` and vLLM's structured-output extras, as one grammar
- `tools.py`: `tools` and `tool_choice`, and the calls read back out of a reply
- `checks.py`: the field checks both share (DecodeConfig's own, as 400s)
- `errors.py`: `APIError`, OpenAI's error object, and `library_error`, the one mapping
  of the library's and the engine loop's errors to it
- `responses.py`: response, chunk and model bodies
- `streams.py`: a request's outputs as one response body or as server-sent events

Validation is written out by hand (not pydantic) so that every rejection names its field
the way OpenAI does: `{"error": {"message", "type", "param", "code"}}` with a 4xx status.
Fields that OpenAI defines and that would change the answer in a way we cannot honour
(`suffix`, the deprecated `functions`, `echo` with `logprobs`, ...) are refused with the
reason; harmless ones (`user`, `metadata`, ...) are accepted and ignored; anything else is
an unrecognised argument, as at OpenAI.
ReFusion's own knobs ride along as extra body fields (`extra_body` in the openai client).
"""

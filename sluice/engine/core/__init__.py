"""The engine core in its own process, as vLLM V1 runs it.

The API process (FastAPI, tokenization) sends requests to the core process over ZMQ
with msgpack (`messages.py`); the core (`process.py`) runs the scheduler and the model
in a loop and sends each step's outputs back; `client.py` is the API process's half.
The GIL of one no longer serialises the other's Python: HTTP parsing, SSE writing and
tokenization run beside a model step instead of between its ops.
"""

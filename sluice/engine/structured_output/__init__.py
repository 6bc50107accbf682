"""Structured outputs (vLLM's): constrain a request's output to a JSON schema, a regex, a
choice of strings or an EBNF grammar, with xgrammar.

params.py   what a request asks for (frozen, hashable)
manager.py  compiles it once per distinct constraint (LRU cache, thread-safe)
grammar.py  one request's matcher: accept tokens, fill its bitmask, roll back
bitmask.py  a step's masks filled and applied in one batched call each
"""

"""Structured outputs: output held to a JSON Schema, a regex, a choice or a grammar, token by token.

    grammars.py  backend-neutral: the matcher protocol, compilation off the step loop, its cache
    guidance.py  the llguidance backend (the default: no up-front compile, errors on keywords it
                 cannot enforce)
    xgrammar_backend.py  the xgrammar backend (compiles up front; --structured-outputs-backend xgrammar)
    backends.py  picks one by name
    masks.py     the step's token bitmasks, filled on a worker thread while the forward runs

The scheduler holds each request's matcher (it advances it with every token it appends); the
sampler applies the bitmask to the logits before anything else touches them.
"""

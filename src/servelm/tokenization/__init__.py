"""Tokenizers for the processes that talk text: loading one from a checkpoint (loading.py) and
using it off the event loop (prompt_tokenizer.py). Shared by the API server and the router,
which must tokenize identically; imports no torch and nothing of either side."""

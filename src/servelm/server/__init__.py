"""The OpenAI-compatible HTTP API (API process): protocol models, handlers, admission, `servelm serve`."""

"""Batch jobs: the OpenAI Files and Batch APIs (durable, on SQLite and files on disk) and
`servelm run-batch`. A batch's lines run through the server's own routes in the `batch` class,
at a pace that follows the headroom interactive traffic leaves (pacing.py)."""

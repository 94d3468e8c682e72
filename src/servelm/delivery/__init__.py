"""Model delivery: a checkpoint reaches a node (or N nodes) fast, verified, resumable, and
streams into the engine while it arrives.

    manifest.py     the version: files cut into chunks, each with its sha256 (`servelm manifest DIR`)
    source.py       where chunks come from (ChunkSource): a path, HTTP(S), S3, a running replica
    sources.py      open_source(SPEC): local_source.py, http_source.py, s3_source.py by the spec's scheme
    store.py        the local directory being filled: verified writes, resume journal, waiting for bytes
    pull.py         Puller: parallel connections fill a store from a source
    commands.py     `servelm manifest` and `servelm pull`: flags, pull(SPEC, DIR), the summary line
    file_server.py  Range-capable HTTP server: the origin in tests/benchmarks, and each node's peer server
    swarm.py        N nodes: each its share from the origin, the rest from peers (`servelm pull --peers`);
                    swarm_peers.py who holds what and who is gone, swarm_config.py, swarm_cli.py its flags
"""

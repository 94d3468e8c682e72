"""Cache-aware router over servelm replicas (`servelm router`).

    app.py           HTTP front: OpenAI endpoints, /health, /metrics, /admin/replicas
    proxy.py         choose → forward → retry once before the first byte → stream through (or migrate)
    migration.py     a stream that outlives its replica: detect the failure, continue it elsewhere
    relay.py         a migratable stream's client side: strip the ids the router asked for, convert and
                     join a continuation's events (splice.py: the text across the token boundary)
    continuation.py  which streams can migrate; the /v1/completions request that continues one
    sse.py           SSE events out of raw bytes and back
    disagg.py        per request: whole on one replica, or prefill on a prefill worker + decode (and why)
    prefill_calls.py a split request's two bodies; its prefill call in the background
    roles.py         a replica's disaggregation role and transfer address (GET /v1/kv_transfer)
    request_view.py  body → tokens → engine block hashes (what policies route on)
    policies.py      round_robin, least_load, prefix, kv (+ SessionAffinity); the registry
    prefix_index.py  per replica: hashes the router sent there (LRU + TTL)
    kv_index.py      per replica and medium (pool, host, disk): the hashes held, mirrored from KV events
    kv_subscriber.py ZMQ SUB per replica; snapshot resync on any loss
    health.py        periodic /health; failures take a replica out and drop its index
    state.py         Router: replicas + policy + indexes, and every change of a replica's standing
    replicas.py      ReplicaSpec (address, stated role) and Replica (health, load, reported role)
    metrics.py       servelm:router_* Prometheus metrics

The router talks to replicas over HTTP and ZMQ only; where replicas run is the
launcher's business (servelm.cluster).
"""

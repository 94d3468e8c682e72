"""Prefill/decode disaggregation: a producer (prefill worker) serves the KV blocks of the prompts it
computes from its host tier; a consumer (decode worker) pulls them into its pool.

- exports.py: the producer's registry of announced transfers (what a pull may be sent, when);
- protocol.py: the messages on the wire and the reasons a pull fails;
- transport.py: the transfer server (producer) and client (consumer) over ZMQ.
"""

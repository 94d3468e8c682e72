"""The KV transfer between a producer (prefill worker) and its consumers (decode workers).

Chosen on evidence (/work/notes/transport_eval.md): pyzmq, multipart [header, payload] frames, payload zero-copy.
Mooncake's engine does not load without the NVIDIA driver (libcuda.so.1) and rdma-core; NIXL runs on CPU
but its TCP path moved 0.6-0.9 GB/s here against ZMQ's ~2 GB/s, and it needs a control channel (ZMQ) anyway.

- KVTransferServer (transport_server.py): the producer's ROUTER; serves ExportRegistry's blocks to pulls.
- KVTransferClient (transport_client.py): the consumer's pulls, asynchronous, over one I/O thread.
- The messages and failure reasons: protocol.py.
"""

from servelm.disagg.protocol import PullFailure
from servelm.disagg.transport_client import KVTransferClient
from servelm.disagg.transport_server import KVTransferServer

__all__ = ["KVTransferClient", "KVTransferServer", "PullFailure"]

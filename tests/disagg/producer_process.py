"""A producer in its own process, for tests that kill it mid-pull: announces transfer ARGV[1] of
ARGV[2] blocks, saves the first ARGV[3], prints its transfer address, then serves until killed."""

import sys
import time

from disagg_helpers import HostStore, block_hash

from servelm.disagg.exports import ExportRegistry
from servelm.disagg.transport import KVTransferServer


def main() -> None:
    transfer_id, num_announced, num_saved = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = HostStore()
    store.registry = ExportRegistry(store.lookup, wait_s=1.0)
    server = KVTransferServer(store.registry)
    store.registry.announce(transfer_id, [block_hash(transfer_id, index) for index in range(num_announced)])
    store.save(transfer_id, range(num_saved))
    print(server.address, flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()

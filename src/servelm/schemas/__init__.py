"""Wire types shared by processes: one module per boundary, importing only msgspec, the
standard library and each other, so any process (engine core, API server, router) can
speak them without pulling in another's internals."""

"""The engine: requests in, outputs out; in one process, behind an async loop, or as engine cores."""

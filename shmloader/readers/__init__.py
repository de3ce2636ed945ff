"""The processes that fill steps: their pool and supervision, the reader loop, the fork
server, the loader's teardown, and Ray actors as remote readers."""

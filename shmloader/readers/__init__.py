"""The processes that fill steps: their pool (pool) and supervision (supervision), the
reader loop (reader), the fork server (forkserver, forkserver_process), and Ray actors as
remote readers (ray)."""

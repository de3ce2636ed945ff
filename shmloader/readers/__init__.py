"""The processes that fill steps: their pool (pool) and supervision (supervision), the
reader loop (reader), the fork server (forkserver, its process and their channel: forkserver_process,
forkserver_channel), and Ray actors as
remote readers (ray)."""

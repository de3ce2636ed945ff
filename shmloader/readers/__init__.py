"""The processes that fill steps: their pool (pool) and supervision (supervision), the
reader loop (reader) and the one path by which a reader fills and publishes a step (filling),
readers=0's reader in the trainer's own thread and the iterator that drives it (local), the
fork server (forkserver, its process and their channel: forkserver_process,
forkserver_channel), and Ray actors as remote readers (ray)."""

"""One rank of a training run for test_audit.py: a ShmDataLoader over the test's rows with
audit_log, resumed from a checkpoint file if given, that writes its own checkpoint after
`checkpoint_after` steps (with a shuffle window if given) and keeps a note of every batch it delivered (step, rows, padding,
and whether the checkpoint was written before it). With `kill`, it prints "ready" after
`stop_after` steps and waits for the test's SIGKILL; otherwise it delivers `stop_after`
steps (or the rest of the pass: -1) and closes. A rank of "env" takes the rank and the shard
count from torchrun's RANK and WORLD_SIZE."""

from __future__ import annotations

import json
import os
import sys
import time

from child_guard import die_with_parent


def main() -> None:
    die_with_parent()
    from shmloader import ShmDataLoader

    (data, log, notes, rank, shards, batch, resume_from, checkpoint_to, checkpoint_after, stop_after,
     kill, window) = sys.argv[1:]
    if rank == "env":  # Under torchrun: the rank and world size are its.
        rank, shards = os.environ["RANK"], os.environ["WORLD_SIZE"]
    rank, shards, batch = int(rank), int(shards), int(batch)
    checkpoint_after, stop_after = int(checkpoint_after), int(stop_after)
    loader = ShmDataLoader(data, batch_size=batch, shard_index=rank, shard_count=shards, readers=0, seed=11,
                           epochs=2, audit_log=log,
                           shuffle_window=None if window == "-" else int(window))
    if resume_from != "-":
        with open(resume_from) as file:
            loader.load_state_dict(json.load(file))
    checkpointed = False
    with open(notes, "a") as out:
        for delivered, batch_data in enumerate(loader):
            out.write(json.dumps({"step": batch_data.step, "rows": batch_data["data"].tolist(),
                                  "padding": batch_data.padding.tolist(), "after_checkpoint": checkpointed}) + "\n")
            out.flush()
            if delivered + 1 == checkpoint_after:  # Every rank's next step is the checkpoint's.
                checkpointed = True
                if rank == 0:
                    with open(checkpoint_to + ".tmp", "w") as file:
                        json.dump(loader.state_dict(), file)
                    os.rename(checkpoint_to + ".tmp", checkpoint_to)
            if delivered + 1 == stop_after:
                break
    if kill == "kill":
        print("ready", flush=True)
        time.sleep(120)
    loader.close()


if __name__ == "__main__":
    main()

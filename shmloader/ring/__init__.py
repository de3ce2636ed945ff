"""The shared-memory ring and the whole slot protocol, in its three languages.

ring.h defines the protocol's values and structs once (for C, Zig and cffi); transitions
tables every change of a slot's state; the trainer's next() is the C extension _cursor
(_cursor*.c, _cursor.h: see _cursor.c), whose STEP codes step_codes maps to the trainer's
actions. In Python: the constants, layout and names (layout), the segment and semaphores
(segment), where the segment's memory lives (backing), the readers' records (records),
rings left behind (stale, janitor), a slot's arrays (slot_layout), the trainer's batches
(batch) and a filled slot's publication (publishing). The readers' claim is zig/c_api.zig's."""

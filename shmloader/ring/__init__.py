"""The shared-memory ring: its constants, layout and names (layout), its segment and
semaphores (segment), rings left behind (stale), the slot's arrays (slot_layout), the
trainer's batches (batch) and a filled slot's publication (publishing).
The protocol itself is ../ring.h; the trainer's next() is ../_cursor.c."""

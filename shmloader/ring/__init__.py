"""The shared-memory ring: its segment and semaphores (segment), the slot's arrays
(slot_layout), the trainer's batches (batch) and a filled slot's publication (publishing).
The protocol itself is ../ring.h; the trainer's next() is ../_cursor.c."""

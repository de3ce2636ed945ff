"""Filling one step into a slot: the step filler (filler), the readers of rows
(field_readers) and of longer records (record_readers: windows, padded, packed), and the
reader of each kind with a transform's input buffers (inputs)."""

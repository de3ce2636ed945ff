"""Field files on disk: describing them (spec), gathering their rows (rows, blosc, opening),
writing outputs safely (output), ragged fields (ragged), layouts (layout) and the kernel's
read-ahead (readahead)."""

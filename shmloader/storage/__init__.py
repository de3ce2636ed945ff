"""Field files on disk: describing them (spec), gathering their rows (rows, blosc, blosc_python, opening),
ragged fields (ragged), the cost of a file's chunk layout (layout), image headers
(image_headers) and the kernel's read-ahead (readahead). Writing outputs is the
converters' (tools/output.py)."""

"""The command line and what it runs: converters and importers (writing their outputs
safely: output), what a file's layout costs (inspection), the demo, the benchmark and the live view of a ring. Their library
functions are public through shmloader.convert, shmloader.formats, shmloader.imagefolder
and shmloader.demo. Beside them, the tools that compute a batch in this process above the
filler (local_batch: compute_batch and check_determinism, public through shmloader.transforms)."""

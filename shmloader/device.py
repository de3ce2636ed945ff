"""The last hop: the ring page-locked for the GPU, and an iterator that copies each batch to
a device asynchronously, keeping its slot reserved until the copy that reads it is done.

A backend does the device work; TorchCudaBackend is PyTorch's CUDA runtime. Any object
with the same methods works (the tests use one whose copies complete later):

    register(address, nbytes) / unregister(address)   page-lock / unlock host memory
    copy(batch) -> (tensors, event)     issue asynchronous copies of a batch's arrays
    hand_over(tensors, event)           make the consumer's stream wait for the copy
    done(event) -> bool                 whether the copy has completed (never blocks)
    synchronize(event)                  block until the copy has completed
"""

from __future__ import annotations

import collections

from .errors import DeviceError

_CUDA_SUCCESS = 0
# cudaHostRegisterPortable: the pinning holds for every CUDA context, not just the current one.
_CUDA_HOST_REGISTER_PORTABLE = 1


class TorchCudaBackend:
    """PyTorch's CUDA runtime: cudaHostRegister for the ring, a side stream for copies,
    CUDA events to know when a slot may be refilled."""

    def __init__(self, device="cuda") -> None:
        try:
            import torch
        except ImportError:
            raise DeviceError("the GPU path needs PyTorch with CUDA: pip install torch") from None
        if not torch.cuda.is_available():
            raise DeviceError(
                "the GPU path needs CUDA, and torch.cuda.is_available() is False here (a CPU build of PyTorch, "
                "or no GPU); use pin_memory=False and copy batches yourself, or run on a CUDA machine"
            )
        self.torch = torch
        self.device = torch.device(device)
        self.stream = None  # Created on first copy, on the device the copies go to.

    def register(self, address: int, nbytes: int) -> None:
        code = int(self.torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if code != _CUDA_SUCCESS:
            raise DeviceError(f"cudaHostRegister of the ring ({nbytes / 2**20:.1f} MiB) failed with cudaError {code}")

    def unregister(self, address: int) -> None:
        code = int(self.torch.cuda.cudart().cudaHostUnregister(address))
        if code != _CUDA_SUCCESS:
            raise DeviceError(f"cudaHostUnregister of the ring failed with cudaError {code}")

    def copy(self, batch):
        torch = self.torch
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            tensors = {name: torch.from_numpy(array).to(self.device, non_blocking=True) for name, array in batch.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return tensors, event

    def hand_over(self, tensors, event) -> None:
        consumer = self.torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in tensors.values():
            # The caching allocator must not reuse this memory until the consumer's work on
            # it is done, although it was allocated on the copy stream.
            tensor.record_stream(consumer)

    def done(self, event) -> bool:
        return event.query()

    def synchronize(self, event) -> None:
        event.synchronize()


class DeviceIterator:
    """Yields each batch as a dict of device tensors, `prefetch` batches ahead.

    Batch k+1's copies are issued before batch k is handed out, so they overlap step k's
    compute. A batch's slot is kept (its Batch held) until the copy that reads it has
    completed; at most `slots - 2` batches are held this way, and past that the oldest
    copy is waited for. close() (or the loader's close) waits for every copy in flight and
    gives every slot back."""

    def __init__(self, loader, backend, prefetch: int) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= loader.slots - 3:
            raise ValueError(f"prefetch must be an integer in [0, slots - 3] = [0, {loader.slots - 3}], got {prefetch!r}"
                             f" (raise slots to prefetch more)")
        self.loader, self.backend, self.prefetch = loader, backend, prefetch
        self._issued = collections.deque()  # (batch, tensors, event): copies issued, not handed out yet
        self._handed = collections.deque()  # (batch, event): handed out, copy perhaps still running
        self._held_max = loader.slots - 2  # One slot for the loader to fill meanwhile, one in hand.
        self._exhausted = False
        self.closed = False

    def __iter__(self) -> DeviceIterator:
        return self

    def __next__(self) -> dict:
        if self.closed:
            raise RuntimeError("the device iterator is closed")
        self._retire(block=False)
        while len(self._issued) < self.prefetch + 1 and not self._exhausted:
            self._retire(block=len(self._issued) + len(self._handed) >= self._held_max)
            try:
                batch = next(self.loader)
            except StopIteration:  # The end of a finite pass: hand out what was issued first.
                self._exhausted = True
                break
            tensors, event = self.backend.copy(batch)
            self._issued.append((batch, tensors, event))
        if not self._issued:
            raise StopIteration
        batch, tensors, event = self._issued.popleft()
        self.backend.hand_over(tensors, event)
        self._handed.append((batch, event))
        return tensors

    @property
    def held(self) -> int:
        """Batches whose slots this iterator keeps (copies issued or not yet complete)."""
        return len(self._issued) + len(self._handed)

    def _retire(self, block: bool) -> None:
        """Gives back the slots of completed copies, oldest first; with `block`, waits for
        the oldest one if none has completed."""
        while self._handed:
            batch, event = self._handed[0]
            if not self.backend.done(event):
                if not block:
                    return
                self.backend.synchronize(event)
            self._handed.popleft()
            batch.release()
            block = False

    def close(self) -> None:
        """Waits for every copy in flight, then gives their slots back. Idempotent."""
        if self.closed:
            return
        self.closed = True
        while self._issued:
            batch, tensors, event = self._issued.popleft()
            self._handed.append((batch, event))
        while self._handed:
            batch, event = self._handed.popleft()
            try:
                self.backend.synchronize(event)
            finally:
                batch.release()

    def __enter__(self) -> DeviceIterator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PinnedRing:
    """The ring's registration with a backend: registered once, unregistered once, before
    the mapping can go (lifecycle.Resources calls unregister first when it closes)."""

    def __init__(self, backend, address: int, nbytes: int) -> None:
        backend.register(address, nbytes)
        self.backend, self.address = backend, address

    def unregister(self) -> None:
        """Unregisters once; the caller has waited for the copies that read the ring. Never
        raises: at interpreter exit the CUDA runtime may already be gone."""
        backend, self.backend = self.backend, None
        if backend is None:
            return
        try:
            backend.unregister(self.address)
        except Exception:
            pass


def pin_backend(pin_memory):
    """None, PyTorch's CUDA runtime for True (raising DeviceError where there is no CUDA), or
    the backend object given (anything with register/unregister/copy/...: device.py)."""
    if pin_memory is False or pin_memory is None:
        return None
    if pin_memory is True:
        return TorchCudaBackend()
    if not all(hasattr(pin_memory, name) for name in ("register", "unregister", "copy", "done", "synchronize")):
        raise TypeError(f"pin_memory must be True, False or a device backend (see shmloader.device), got {pin_memory!r}")
    return pin_memory


def cpu_tensors(loader):
    """to_device("cpu"): each batch as torch tensors over the slot, without a copy."""
    import torch

    for batch in loader:
        yield {name: torch.from_numpy(array) for name, array in batch.items()}
        del batch

"""Filling one step into a slot: the step filler and the field readers (padding, packing,
windows, transforms' inputs)."""

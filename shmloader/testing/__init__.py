"""Helpers for tests: a loader whose readers are simulated threads."""

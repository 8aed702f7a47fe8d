"""Visibility: progress display (metrics and structured logs come later)."""

from ackflow.observe.progress import ProgressBar

__all__ = ["ProgressBar"]

"""Serving a model: text generation with timings (``generate_text``), and ``falcon-fwa generate``."""
from .generation import Completion, Generation, Timing, generate_text

__all__ = ["generate_text", "Generation", "Completion", "Timing"]

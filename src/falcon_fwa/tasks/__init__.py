"""Synthetic tasks that need no downloaded data (``falcon-fwa addition``)."""

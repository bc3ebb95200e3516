"""Evaluation: perplexity by position bucket, lm-evaluation-harness on saved model folders."""
from .perplexity import bucket_report, default_edges, load_model, position_nll, token_stream, windows

__all__ = ["load_model", "token_stream", "windows", "position_nll", "bucket_report", "default_edges"]

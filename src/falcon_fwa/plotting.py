"""matplotlib where it is installed: the optional dependency behind every plot the package draws."""
from __future__ import annotations


def require(option: str) -> None:
    """``ValueError`` naming ``option`` (the one that asks for a plot) where matplotlib is not installed:
    checked before the work, so that a plot asked for is not found missing at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{option} draws with matplotlib, which is not installed (pip install 'falcon-fwa[plot]')") \
            from None


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'falcon-fwa[plot]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

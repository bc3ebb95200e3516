"""matplotlib where it is installed: the optional dependency behind every plot the package draws."""
from __future__ import annotations


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

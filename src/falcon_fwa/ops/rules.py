"""The six Falcon update rules, described by three switches.

Every rule updates a matrix state ``S`` (``K x V`` per head) from the causal pair
``(x_t, y_t) = (phi(k_{t-1}), v_t)`` (paper, Section 4, "Naming and formula summary")::

    regression  (1, 2, 3):   S_t = gamma_t * S_{t-1} + eta_t/B_t * sum_j x_j (y_j - S_{t-1}^T x_j)^T
    inner-prod  (1A,2A,3A):  S_t = gamma_t * S_{t-1} + eta_t/B_t * sum_j x_j y_j^T

(Eqs. 3.3, 4.4, 4.14 and 4.6, 4.7, 4.19; ``B_t = 1`` for the non-sliding rules; a ``log_gate``
first decays ``S_{t-1}`` by ``exp(g_t)``, see ``falcon_attention``).

The index says how many pairs are averaged (``j`` runs over the current pair for
the rules 1/2 and 1A/2A, over the sliding window ``I_t`` for 3/3A) and whether the
step size is one scalar per token (1, 3, 1A, 3A) or one per value column (2, 2A).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RuleSpec", "RULES", "get_rule"]


@dataclass(frozen=True)
class RuleSpec:
    """One of the six update rules: regression (residual write ``eta (y - S^T x)``) or
    inner-product (``eta y``), one step size per head or per value column, one pair per
    step or a window of ``B`` pairs. ``get_rule(name)`` returns the spec of ``name``."""

    name: str
    regression: bool  # residual (delta) write vs. direct inner-product write
    per_column: bool  # one step size per value column (Falcon-2 / 2A)
    sliding: bool  # mini-batch step over a window of B causal pairs (Falcon-3 / 3A)

    @property
    def paper_name(self) -> str:
        """The paper's name of the rule: ``"Falcon-1"`` ... ``"Falcon-3A"``."""
        return f"Falcon-{self.name}"


RULES = {
    "1": RuleSpec("1", regression=True, per_column=False, sliding=False),
    "2": RuleSpec("2", regression=True, per_column=True, sliding=False),
    "3": RuleSpec("3", regression=True, per_column=False, sliding=True),
    "1A": RuleSpec("1A", regression=False, per_column=False, sliding=False),
    "2A": RuleSpec("2A", regression=False, per_column=True, sliding=False),
    "3A": RuleSpec("3A", regression=False, per_column=False, sliding=True),
}
"""The six rules by name (the paper's Falcon-1 ... Falcon-3A, Section 4)."""


def get_rule(rule: str | RuleSpec) -> RuleSpec:
    """The :class:`RuleSpec` of ``rule``: a name "1", "2", "3", "1A", "2A", "3A" or the paper's
    "Falcon-1" ... "Falcon-3A" (case-insensitive, surrounding spaces ignored), or a ``RuleSpec``
    (returned as it is). Another name is a ``ValueError`` naming ``rule``."""
    if isinstance(rule, RuleSpec):
        return rule
    key = str(rule).strip().upper()
    if key.startswith("FALCON-"):
        key = key[len("FALCON-"):]
    if key not in RULES:
        raise ValueError(f"rule must be one of {sorted(RULES)}, got {rule!r}")
    return RULES[key]

"""The paper's published scaling laws (arXiv 2406.16690, Table 3), for comparison with ours.

Units, as the paper uses them: C in PFLOP-days (its Figure 1 axes: "PFLOP/s-days"; 1 PFLOP-day = 8.64e19
FLOPs), counting training FLOPs by its Table 1 formulas without the embedding term ("we exclude embedding
parameters and other subleading terms"); N non-embedding parameters; D tokens; L training loss in nats/token.
Each law is coef · C^exponent:

    L(C) = 3.7087 C^-0.0798 (LLaMA) ...     N_opt(C) = 1.82e8 C^0.7118 ...     D_opt(C) = 2.56e10 C^0.5102 ...

All twelve laws are printed in the paper's Table 3; each architecture's spec (`ArchSpec.paper_law`, models/)
records its three as printed (coefficients of N_opt and D_opt to three significant figures, as the paper
gives them), and this module gathers them.
"""
from __future__ import annotations

import numpy as np

from models.registry import arch_names, get_arch

PAPER = "arXiv 2406.16690 (Shen et al., Scaling Laws for Linear Complexity Language Models), Table 3"
PAPER_UNIT = ("C in PFLOP-days (1 PFLOP-day = 8.64e19 FLOPs) of training FLOPs without the embedding term "
              "(the paper's Table 1); N non-embedding parameters; D tokens; L in nats/token")
PAPER_INCLUDES_EMBEDDING = False

# arch -> law -> (coef, exponent), C in PFLOP-days
PAPER_TABLE3: dict[str, dict[str, tuple[float, float]]] = {
    a: dict(get_arch(a).paper_law) for a in arch_names() if get_arch(a).paper_law}
LAWS = ("L", "N_opt", "D_opt")
# L(C) = beta · C^alpha per architecture, in the keys the loss fits use (derived from PAPER_TABLE3)
PAPER_LOSS_FIT: dict[str, dict[str, float]] = {a: {"beta": t["L"][0], "alpha": t["L"][1]} for a, t in PAPER_TABLE3.items()}


def paper_law_at(arch: str, law: str, c_pflop_days: float | np.ndarray) -> float | np.ndarray | None:
    """The paper's `law` ('L', 'N_opt' or 'D_opt') of `arch` at C (PFLOP-days; a number or an array), coef ·
    C^exponent; None for an architecture the paper did not study."""
    laws = PAPER_TABLE3.get(arch)
    if laws is None:
        return None
    coef, exponent = laws[law]
    return coef * c_pflop_days ** exponent


def paper_reference(arch: str) -> dict:
    """The paper's three laws for `arch` ({} for an architecture it did not study), with their unit."""
    laws = PAPER_TABLE3.get(arch)
    if laws is None:
        return {}
    out = {law: {"coef": c, "exponent": e} for law, (c, e) in laws.items()}
    # the historical keys of L(C) (L = beta · C^alpha)
    out.update(beta=laws["L"][0], alpha=laws["L"][1], unit=PAPER_UNIT, source=PAPER)
    return out

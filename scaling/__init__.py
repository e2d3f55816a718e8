"""FLOPs-based scaling-law fits: runs -> envelope -> L(C), N_opt(C), D_opt(C); docs/scaling.md."""

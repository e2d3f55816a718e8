"""FLOPs-based scaling-law fits (DESIGN §8): runs -> envelope -> L(C), N_opt(C), D_opt(C); docs/scaling.md."""

"""Thresholds the spec and the fits share (the spec's defaults, the analysis's rules)."""

# Widest η* (or transfer shift) CI that counts as reliable: half-width in octaves (log2 LR).
# The spec's `analysis.eta_ci_log2` defaults to this.
ETA_CI_LOG2 = 0.5

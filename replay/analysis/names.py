"""The coordinate names of the analysis, shared by the metrics, the store layout and the report."""

MATRICES = ("q", "k", "v", "o", "fc", "proj")     # whole matrices of a layer
HEAD_MATRICES = ("q", "k", "v", "o")              # per-head slices
DISTANCES = ("max_abs", "frobenius", "relative", "wasserstein")

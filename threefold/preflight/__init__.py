"""Before the first step: every rank's stack fingerprint compared (stack.py), each node's
kernels (node_probe.py) and the layout's own links (link_probe.py) measured against their
peers, each finding named in one line with its ranks and nodes. Run by `threefold doctor` and
by `threefold train` (train.preflight)."""

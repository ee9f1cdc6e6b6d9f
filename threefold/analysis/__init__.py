"""Reading finished runs back: run directories, per-rank summaries, comparisons with 95% intervals,
bands, prescriptions and plots. What `threefold report` and the tuner read; nothing here runs
inside a training step."""

"""kvflow's benchmarks: each module is one scenario on the shared harness (`bench/harness/`), run from the repo
root as `python -m bench.<scenario>`; what a scenario measures is in its docstring, its results go to
`bench/results/*.json` (the names and fields that outside checks read), finished experiments to `experiments/`."""

"""Test-only machinery, never imported by the package torchtitan/.

What makes the suite's many short trainer runs fast: a warm fork server (warm_launcher.py, whose
`run_warm` is the tests' runner) and a forking stand-in for torchrun (local_ranks.py); a runner that
trains nothing (fake_runner.py), for what the parity tools do with a bad run. The job short runs
start from (tiny_run.py). The generated layout matrix (layout_matrix.py) and its models
(matrix_model.py), on the product's parity harness. Two simulated hosts in network namespaces
(namespaces.py; netns.py, their pytest side). Users train through run_llama_train.sh or
torchtitan.tools.runs instead; scripts in scripts/ that drive this machinery (loss_compare's
matrix suites, restart_trials' two hosts) say so."""

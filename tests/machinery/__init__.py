"""Test-only machinery that makes the suite's many short trainer runs fast: a warm fork server
(warm_launcher.py, whose `run_warm` is the tests' runner) and a forking stand-in for torchrun
(local_ranks.py). Users train through run_llama_train.sh or torchtitan.tools.runs instead."""

"""Test-only machinery that makes the suite's many short trainer runs fast: a warm fork server
(warm_launcher.py, whose `run_warm` is the tests' runner) and a forking stand-in for torchrun
(local_ranks.py); and a runner that trains nothing (fake_runner.py), for what the parity tools do with
a bad run. Users train through run_llama_train.sh or torchtitan.tools.runs instead."""

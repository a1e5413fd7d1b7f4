"""The job the suite's short runs start from: the debug model on short sequences, with real text
and tokenizer, a few seconds per run on a CPU. It is the parity tool's default job (one
declaration, in the product: torchtitan/tools/parity.py); tests add a flavor (tests/helpers.py:
llama3 `tiny`), the layout matrix its own model, scripts/restart_trials.py the flavor it is asked
for."""

from torchtitan.tools.parity import DEBUG_RUN

TINY_RUN = DEBUG_RUN

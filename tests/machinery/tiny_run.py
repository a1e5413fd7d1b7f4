"""The job the suite's short runs start from: the debug model on short sequences, with real text
and tokenizer, a few seconds per run on a CPU. Tests add a flavor (tests/helpers.py: llama3 `tiny`),
the layout matrix its own model, scripts/restart_trials.py the flavor it is asked for."""

TINY_RUN = (
    "--job.config_file", "bundled:train_configs/debug_model.toml",  # found from any working directory
    "--training.seq_len", "64",
    "--training.steps", "10",
    "--training.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
)

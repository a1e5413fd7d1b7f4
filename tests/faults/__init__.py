"""Fault injection for the tests, in one place. Each module is loaded into the trainer's ranks with
`--experimental.custom_import tests.faults.<module>` (most are steered by environment variables,
read at import):

- checkpoint:        SIGKILL rank 0 after a step or inside a save, a preemption during validation,
                     a failing DCP write (ENOSPC, EROFS), a narrower flavor, a model whose loss turns NaN
- free_space:        every disk looks as if it had N bytes free (a full disk without filling one)
- crash_on_rank_one: rank 1 fails at import, as a bug would
- slow_rank_one:     rank 1's optimizer step is slower (a straggler)
- drifted_spec:      a model registered with a builder of an old signature (registration refuses it)
"""

"""Checkpoint save and auto-resume through DCP: an interrupted run continues exactly."""

from tests.helpers import TINY_RUN, losses, run_train


def test_resume_gives_identical_losses_under_fsdp(tmp_path):
    # A constant lr after warm-up keeps the schedule independent of training.steps, so a job told
    # to stop at step 5 trains exactly like the first half of the 10-step job.
    ckpt = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "5", "--training.decay_type", "constant"]
    run_train([*TINY_RUN, *ckpt, "--job.dump_folder", str(tmp_path / "full")], nproc=2)
    full = losses(tmp_path / "full")

    # Same run stopped after step 5 (only the step-5 checkpoint exists), then started again.
    run_train([*TINY_RUN, *ckpt, "--job.dump_folder", str(tmp_path / "split"), "--training.steps", "5"], nproc=2)
    result = run_train([*TINY_RUN, *ckpt, "--job.dump_folder", str(tmp_path / "split")], nproc=2)
    assert "loaded model, optimizer, lr_scheduler, dataloader, train_state" in result.stdout
    split = losses(tmp_path / "split")  # steps 1-5 from the first job, 6-10 from the resumed one
    assert split == full, (split, full)

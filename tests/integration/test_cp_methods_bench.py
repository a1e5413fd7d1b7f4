"""scripts/cp_methods_bench.py: its quick run measures both context-parallel methods with sane
figures, and its block-plan accounting counts what document masking skips."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import cp_methods_bench as bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.budget("torchrun of 2 gloo ranks (3 s of imports each): 5 s on an idle 2-core machine, over 20 s on a loaded one")
def test_quick_run_reports_both_methods_with_sane_figures(tmp_path):
    out = tmp_path / "quick.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "scripts/cp_methods_bench.py", "--quick", "--json", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cp"], r["seq"], r["masked"]) for r in rows] == [(2, 1024, False), (2, 1024, True)]
    args = json.loads(out.read_text())["settings"]
    whole_kv = 2 * args["kv_heads"] * 1024 * args["head_dim"] * 4  # fp32 K and V of the whole sequence
    for row in rows:
        ring, allgather = row["methods"]["ring"], row["methods"]["allgather"]
        for m in (ring, allgather):
            assert len(m["seconds"]) == 2 and all(s > 0 for s in m["seconds"])
        # The ring receives one other rank's K/V share; all-gather holds the whole sequence's K/V.
        assert ring["peak_bytes"] >= whole_kv // 2
        assert allgather["peak_bytes"] >= whole_kv
        if row["masked"]:
            assert 0 < ring["computed"] < 1 and ring["computed"] == pytest.approx(allgather["computed"], abs=0.05)
        else:
            assert ring["computed"] == allgather["computed"] == 1.0
    assert "| 2 | 1,024 | docs |" in result.stdout


def test_plan_work_skips_exactly_what_tile_aligned_documents_mask():
    # Documents of one tile each: every tile is one causal square of its own document, nothing else.
    ids = torch.arange(8).repeat_interleave(128).unsqueeze(0)
    for method in bench.METHODS:
        work = bench.plan_work(method, 2, ids, tile=128)
        assert work["computed"] == pytest.approx(bench.exact_mask_share(ids))
        assert work["calls"] == 4
    # One document over the whole sequence: plain causal work.
    assert bench.plan_work("ring", 2, torch.zeros(1, 1024, dtype=torch.int64), tile=128)["computed"] == pytest.approx(1.0)


def test_synthetic_documents_are_seeded_with_the_mean_asked_for():
    ids = bench.synthetic_documents(1 << 16, 2048)
    assert torch.equal(ids, bench.synthetic_documents(1 << 16, 2048))
    assert ids.shape == (1, 1 << 16) and bool((ids[0, 1:] >= ids[0, :-1]).all())
    mean = ids.shape[1] / (int(ids.max()) + 1)
    assert 1024 < mean < 4096


def test_corpus_skip_without_a_full_window_says_so(monkeypatch):
    monkeypatch.setattr(bench, "corpus_windows", lambda seq: iter(()))
    args = bench.argparse.Namespace(corpus_seq=1 << 20, cps=[2], tile=512)
    with pytest.raises(SystemExit) as e:
        bench.corpus_skip(args)
    assert e.value.code == f"cp_methods_bench: the bundled corpus has fewer than {(1 << 20) + 1} tokens"

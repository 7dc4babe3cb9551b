"""LOOP on a real pretrained model (SmolLM2-135M-Instruct, the packaged copy) with the real-model
recipe, shortened to 2 iterations of 2 groups of 2: rollout, update and the sampler's weights all go round, and the
sampler's log-probs agree with the trainer's in float32."""

from __future__ import annotations

from pathlib import Path

import pytest

from loop_trainer.training.run_log import read_metrics
from support.packaged import needs_packaged_model

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-contacts.yaml")


@pytest.mark.slow
@needs_packaged_model
def test_two_loop_iterations_on_smollm2_update_the_policy_and_keep_the_sampler_in_step(tmp_path):
    from loop_trainer.cli.train import cli

    out = tmp_path / "run"
    assert (
        cli(
            [
                "--config",
                RECIPE,
                "--output_dir",
                str(out),
                "--iterations",
                "2",
                "--tasks_per_iteration",
                "2",
                "--rollouts_per_task",  # 2 groups of 2, one minibatch: the update is most of the test's time
                "2",
                "--minibatch_size",
                "4",
                "--max_turns",
                "3",
                "--max_new_tokens_per_turn",
                "16",
                "--disable_tqdm",
                "true",
                "--save_strategy",
                "no",
                "--memory_stress_test",  # 4 x 768 tokens: 40 s; checked on tiny models elsewhere
                "false",
            ]
        )
        == 0
    )
    records = read_metrics(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert sum(r["optimizer_steps"] for r in records) >= 1, "no update ran: no group had a reward spread"
    for record in records:
        assert record["num_failed"] == 0 and record["num_rollouts"] == 4
        if record["optimizer_steps"]:
            assert record["sampler_logprob_diff_max"] < 1e-3, record
    assert (out / "adapter_model.safetensors").exists()

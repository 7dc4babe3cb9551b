"""A LOOP training process for the crash tests: ``python fault_driver.py MODEL_DIR OUTPUT_DIR
[--kill-in rollouts|round|collected|update|save --kill-at N] [--resume] [--dynamic-sampling-rounds R]
[--max-staleness K] [--context-keep N] [--ratio-level L]``, alone or under ``torch.distributed.run`` (gloo: each
process collects its share).
It SIGKILLs itself at the named moment of iteration N (no clean-up of any kind runs; ``round``: as dynamic
sampling's second collection round starts; ``collected``: once the batch the iteration trains on is complete, before
its update), then the test resumes it. ``--max-staleness 1`` samples on a
generator holding its own copy of the weights (tests/support/apart.py), overlapped with the update; above 1, one
holding a copy per policy version. ``--partial`` turns partial rollouts on, with a cut at half of each batch's
new episodes: the second half of each process's share of a batch straggles (its first step waits until a
checkpoint finishes the episodes in flight), so every batch carries those groups into the next, through a
checkpoint."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from accelerate import PartialState
from transformers import AutoModelForCausalLM

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.envs import VaultEnv
from loop_trainer.models.tiny import load_tokenizer
from loop_trainer.training.distribution import end_distributed_run
from loop_trainer.training.update import PolicyUpdate

TASKS_PER_ITERATION = 4


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def straggle(env: VaultEnv, share: int) -> None:
    """The second half of the episodes each process starts for a batch (``share``: its episodes of one batch)
    straggle: their first step returns only once a checkpoint finishes the episodes in flight. So each batch's cut
    (half of its new episodes) falls at the same place in every run, and the carried groups end the same way."""
    from loop_trainer.rollout.partial import ContinuingCollection

    finishing = threading.Event()
    finish = ContinuingCollection.finish_in_flight

    def finish_in_flight(self):
        finishing.set()
        try:
            finish(self)
        finally:
            finishing.clear()

    ContinuingCollection.finish_in_flight = finish_in_flight
    started, make_episode = iter(range(10**6)), env.episode

    def episode(task):
        made, straggler = make_episode(task), next(started) % share >= share // 2
        step, steps = made.step, []

        def step_after_the_checkpoint(reply):
            steps.append(reply)
            deadline = time.monotonic() + 60
            while straggler and len(steps) == 1 and not finishing.is_set() and time.monotonic() < deadline:
                time.sleep(0.002)
            return step(reply)

        made.step = step_after_the_checkpoint
        return made

    env.episode = episode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("output_dir")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--kill-in", choices=["rollouts", "round", "collected", "update", "save"])
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dynamic-sampling-rounds", type=int, default=0)
    parser.add_argument("--rollouts-per-task", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--context-keep", type=int, help="context_keep_observations: episodes split into segments")
    parser.add_argument("--ratio-level", default="token")
    parser.add_argument("--beta", type=float, default=0.0, help="a KL penalty: full fine-tuning's frozen reference")
    options = parser.parse_args()

    distributed = {}
    if "WORLD_SIZE" in os.environ:  # torchrun/accelerate on CPUs, over gloo, set up before the config (docs/scaling.md)
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            PartialState(backend="gloo")  # accelerate picks DeepSpeed only without cpu=True
        else:
            PartialState(cpu=True, backend="gloo")  # DDP
        distributed = {"accelerator_config": {"use_configured_state": True}}
    env = VaultEnv(num_tasks=16)
    model = AutoModelForCausalLM.from_pretrained(options.model)
    tokenizer = load_tokenizer(options.model)
    args = LOOPConfig(
        output_dir=options.output_dir,
        iterations=options.iterations,
        tasks_per_iteration=TASKS_PER_ITERATION,
        rollouts_per_task=options.rollouts_per_task,
        dynamic_sampling_rounds=options.dynamic_sampling_rounds,
        max_staleness=options.max_staleness,
        **(
            {"partial_rollouts": True, "early_stop_done_fraction": 0.5, "early_stop_task_fraction": 0.0}
            if options.partial
            else {}
        ),
        context_keep_observations=options.context_keep,
        ratio_level=options.ratio_level,
        beta=options.beta,
        minibatch_size=8,
        max_turns=6,
        max_new_tokens_per_turn=4,
        max_trajectory_tokens=512,
        learning_rate=6e-4,
        max_grad_norm=1.0,
        per_device_train_batch_size=8,
        activation_checkpointing=False,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        report_to=[],
        viewer_rollouts_per_iteration=0,
        plot_curves=False,
        **distributed,
    )
    backend = None
    if options.max_staleness:
        from apart import ApartBackend, VersionedApartBackend  # tests/support, on PYTHONPATH

        from loop_trainer.chat import stop_token_ids

        stop = stop_token_ids(model, tokenizer)
        # one request at a time: its log-probs do not depend on what it is batched with (they weight the update)
        apart = VersionedApartBackend if options.max_staleness > 1 else ApartBackend
        backend = apart(model, stop_token_ids=stop, pad_token_id=tokenizer.pad_token_id, max_batch_size=1)
    trainer = LOOPTrainer(model, env, args, processing_class=tokenizer, generation_backend=backend)
    if options.partial:
        straggle(env, TASKS_PER_ITERATION // PartialState().num_processes * options.rollouts_per_task)
    at_kill_iteration = lambda: trainer.state.global_step + 1 == options.kill_at  # noqa: E731

    if options.kill_in == "rollouts":
        make_episode, started = env.episode, []
        per_batch = TASKS_PER_ITERATION * options.rollouts_per_task
        # Overlapped, iteration N's update runs while batch N+1 is collected on another thread: that batch is
        # counted, since global_step (moved by the main thread) may or may not have moved when an episode starts.
        last_batch_before = options.kill_at if options.max_staleness else options.kill_at - 1

        def episode(task):
            started.append(task)
            this_iteration = bool(options.max_staleness) or at_kill_iteration()
            if this_iteration and len(started) > last_batch_before * per_batch + per_batch // 2:  # mid-collection
                die()
            return make_episode(task)

        env.episode = episode
    elif options.kill_in == "round":
        collect = trainer.collect_rollouts

        def collect_rollouts(tasks, collection_round=0, iteration=None):
            if at_kill_iteration() and collection_round == 1:
                die()
            return collect(tasks, collection_round, iteration=iteration)

        trainer.collect_rollouts = collect_rollouts
    elif options.kill_in == "collected":  # the batch to train on is complete and its update has not begun
        if options.max_staleness:  # overlapped: the batch collected during the last update has been waited for
            take = trainer.overlap.take

            def take_then_die(iteration):
                ahead = take(iteration)
                if ahead is not None and at_kill_iteration():
                    die()
                return ahead

            trainer.overlap.take = take_then_die
        else:
            collect_scored = trainer._collect_scored

            def collect_then_die(*a, **k):
                scored = collect_scored(*a, **k)
                if at_kill_iteration():
                    die()
                return scored

            trainer._collect_scored = collect_then_die
    elif options.kill_in == "update":
        step = PolicyUpdate.minibatch_step

        def minibatch_step(*a, **k):
            result = step(*a, **k)  # one optimizer step has changed the weights: then die
            if at_kill_iteration():
                die()
            return result

        PolicyUpdate.minibatch_step = minibatch_step
    elif options.kill_in == "save":
        write_state = trainer._save_rng_state

        def save_rng_state(output_dir):  # the model is written, the checkpoint is not complete
            write_state(output_dir)
            if trainer.state.global_step == options.kill_at:
                die()

        trainer._save_rng_state = save_rng_state

    with trainer:  # as loop-train: the trainer's threads and generator are released, then the process group
        trainer.train(resume_from_checkpoint=True if options.resume else None)
        trainer.save_model(os.path.join(options.output_dir, "final"))
    end_distributed_run()


if __name__ == "__main__":
    main()

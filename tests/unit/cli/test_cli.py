"""loop-train: recipes, overrides, and one actionable line for every user mistake."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loop_trainer import LOOPConfig
from loop_trainer.cli.recipe import RecipeError, parse_recipe
from loop_trainer.cli.train import cli
from loop_trainer.envs import VaultEnv

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_sets_defaults_and_flags_override(tmp_path):
    recipe = write(
        tmp_path,
        """
        model_name_or_path: tiny:vault
        environment: vault
        environment_kwargs: {num_tasks: 8}
        output_dir: out
        learning_rate: 0.001
        iterations: 7
        lora_target_modules: [q_proj, v_proj]
        max_training_tokens: null
        env:
          LOOP_TEST_EXPORTED: "yes"
    """,
    )
    script, args, model = parse_recipe(["--config", recipe, "--iterations", "3"])
    assert (args.learning_rate, args.iterations) == (0.001, 3)
    assert script.environment_kwargs == {"num_tasks": 8}
    assert model.model_name_or_path == "tiny:vault" and model.lora_target_modules == ["q_proj", "v_proj"]
    import os

    assert os.environ["LOOP_TEST_EXPORTED"] == "yes"


@pytest.mark.parametrize(
    ("recipe", "flags", "message"),
    [
        ("lerning_rate: 0.1\n", [], "unknown key 'lerning_rate' in .* \\(did you mean 'learning_rate'\\?\\)"),
        ("learning_rate: fast\n", [], "learning_rate.*invalid float value: 'fast'"),
        ("iterations: 0\n", [], "iterations must be >= 1"),
        (
            "sync_ref_model: true\n",
            [],
            "unknown key 'sync_ref_model' in .*: LOOPConfig has no setting 'sync_ref_model'; LOOP's equivalent is beta",
        ),
        ("beta: -0.1\n", [], "beta must be >= 0"),
        (
            "",
            ["--rollouts_per_tsk", "4"],
            "^unknown option '--rollouts_per_tsk' \\(did you mean '--rollouts_per_task'\\?\\)$",
        ),
        (
            "",
            ["--rollouts_per_tsk=4"],
            "^unknown option '--rollouts_per_tsk' \\(did you mean '--rollouts_per_task'\\?\\)$",
        ),
        ("- a list\n", [], "must contain a YAML mapping"),
        ("environment_kwargs: '{bad json'\n", [], "environment_kwargs is not valid JSON"),
    ],
)
def test_recipe_mistakes_are_one_line(tmp_path, recipe, flags, message):
    path = write(tmp_path, "output_dir: out\n" + recipe if not recipe.startswith("-") else recipe)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(["--config", path, *flags])


def test_the_recipe_as_run_is_plain_yaml_for_settings_objects_and_enums(tmp_path):
    """transformers turns accelerator_config into an AcceleratorConfig and debug into a list of DebugOption: the
    recipe as run (recipe.yaml, the model card) writes them as the mapping and the names a recipe gives."""
    import yaml

    path = write(tmp_path, "output_dir: out\naccelerator_config: {split_batches: true}\ndebug: underflow_overflow\n")
    script, args, _ = parse_recipe(["--config", path])
    assert args.accelerator_config.split_batches is True  # the object itself is transformers' own
    written = yaml.safe_load(yaml.safe_dump(script.effective_recipe, sort_keys=False))
    assert written == script.effective_recipe
    assert written["accelerator_config"]["split_batches"] is True and written["debug"] == ["underflow_overflow"]
    again, _, _ = parse_recipe(["--config", write(tmp_path, yaml.safe_dump(written))])  # it runs again as written
    assert again.effective_recipe == written


def test_config_in_the_equals_form(tmp_path):
    path = write(tmp_path, "output_dir: out\niterations: 7\n")
    script, args, model = parse_recipe([f"--config={path}", "--iterations=3"])
    assert (args.iterations, args.output_dir) == (3, "out")
    assert script.effective_recipe == {"output_dir": "out", "iterations": 3}
    with pytest.raises(RecipeError, match="--config needs a path to a YAML recipe"):
        parse_recipe(["--config="])


def test_missing_recipe_file():
    with pytest.raises(RecipeError, match="recipe file not found: nope.yaml"):
        parse_recipe(["--config", "nope.yaml"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "bad.json .deepspeed_config_file in the accelerate config. is not found"),
        (
            '{"zero_optimization": {"stage": 2,}}',
            "bad.json .deepspeed_config_file in the accelerate config. is not valid JSON: Expecting",
        ),
        ("[2]", "bad.json must hold a JSON object"),
    ],
)
def test_a_deepspeed_config_file_that_does_not_parse_is_named(tmp_path, monkeypatch, content, message):
    # accelerate launch passes a config's deepspeed_config_file on as these variables; JSON's error names no file
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    with pytest.raises(RecipeError, match=message):
        parse_recipe(["--environment", "vault"])


def test_deepspeed_settings_given_inline_are_read_as_deepspeed_reads_them(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", '{"zero_optimization": {"stage": 2}}')
    from loop_trainer.cli.recipe import launch_deepspeed_config

    assert launch_deepspeed_config() == {"zero_optimization": {"stage": 2}}  # not a path: nothing to name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model_name_or_path", "/no/such/model"], "cannot load model_name_or_path '/no/such/model'"),
        (["--model_name_or_path", "tiny:vault", "--environment", "appwrld"], "unknown environment 'appwrld'"),
        (
            ["--model_name_or_path", "tiny:vault", "--environment_kwargs", '{"num_tsks": 3}'],
            "bad arguments for environment 'vault'",
        ),
        ([], "model_name_or_path is not set"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tmp_path, capsys, flags, message):
    code = cli(["--output_dir", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("loop-train: error: ") and "\n" not in err
    assert __import__("re").search(message, err), err


def test_console_script_prints_no_traceback(tmp_path):
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / "loop-train"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "loop_trainer.cli.train"]
    result = subprocess.run(
        [*command, "--config", write(tmp_path, "output_dir: o\nlerning_rate: 1\n")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"loop-train: error: unknown key 'lerning_rate' in {tmp_path / 'recipe.yaml'} (did you mean 'learning_rate'?)"
    )


def test_cli_trains_from_a_recipe_and_ends_the_process_group_it_ran_in(tmp_path, capsys):
    recipe = write(
        tmp_path,
        f"""
        model_name_or_path: tiny:vault
        environment: vault
        output_dir: {tmp_path / "run"}
        iterations: 2
        tasks_per_iteration: 2
        rollouts_per_task: 3
        max_turns: 3
        max_new_tokens_per_turn: 4
        max_trajectory_tokens: 256
        activation_checkpointing: false
        disable_tqdm: true
    """,
    )
    # Its last act: destroy_process_group (and a pause under gloo), so that no gloo worker is still releasing the
    # last collective's tensors as the interpreter shuts down (which aborts a finished run: training/distribution.py).
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert cli(["--config", recipe]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "LOOP: 2 iterations on 'vault'" in out and "metrics.jsonl" in out
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "model.safetensors").exists()


def test_appworld_without_data_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("APPWORLD_ROOT", raising=False)
    assert cli(["--output_dir", str(tmp_path / "o"), "--model_name_or_path", "x", "--environment", "appworld"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loop-train: error: APPWORLD_ROOT is not set: run `make appworld`") and "\n" not in err
    monkeypatch.setenv("APPWORLD_ROOT", str(tmp_path / "nowhere"))
    assert cli(["--output_dir", str(tmp_path / "o"), "--model_name_or_path", "x", "--environment", "appworld"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"loop-train: error: no AppWorld data under {tmp_path / 'nowhere'}") and "\n" not in err


TINY_RUN = [
    "--model_name_or_path",
    "tiny:vault",
    "--iterations",
    "1",
    "--tasks_per_iteration",
    "2",
    "--rollouts_per_task",
    "2",
    "--max_turns",
    "2",
    "--max_new_tokens_per_turn",
    "3",
    "--activation_checkpointing",
    "false",
    "--disable_tqdm",
    "true",
    "--plot_curves",
    "false",
    "--memory_stress_test",  # at the default 32,000 tokens: half a minute
    "false",
]


def test_resuming_a_checkpoint_that_does_not_fit_is_one_line_before_the_model_is_loaded_where_it_can_be(
    tmp_path, capsys, monkeypatch
):
    import loop_trainer.cli.train_run as train_cli
    from loop_trainer.training.checkpoints import read_loop_state
    from loop_trainer.training.resume import jsonable

    assert cli(["--output_dir", str(tmp_path / "full"), *TINY_RUN]) == 0
    checkpoint = tmp_path / "full" / "checkpoint-1"
    assert (checkpoint / "loop_state.json").is_file()
    capsys.readouterr()
    # What loop-train compares before loading is what the trainer recorded, key for key (no false refusal).
    script_args, training_args, _ = parse_recipe(["--output_dir", str(tmp_path / "full"), *TINY_RUN])
    early = train_cli.settings_before_loading(script_args, training_args, training_args.launch())
    recorded = read_loop_state(checkpoint)["settings"]
    assert early.keys() < recorded.keys() and "learning_rate" in early and "optimizer_state_layout" in early
    assert {key: jsonable(value) for key, value in early.items()} == {key: recorded[key] for key in early}
    load, loaded = train_cli.load_model_and_tokenizer, []
    monkeypatch.setattr(train_cli, "load_model_and_tokenizer", lambda *a, **k: loaded.append(True) or load(*a, **k))
    cases = [  # (output_dir, flags, the error, whether the model was loaded first)
        (
            "empty",
            ["--use_peft", "true", "--resume_from_checkpoint", str(checkpoint)],
            f"checkpoint {checkpoint} holds full weights, but this run trains an adapter",
            True,  # the trainer's check, once the adapter exists
        ),
        (
            "empty",
            ["--resume_from_checkpoint", str(tmp_path / "nope")],
            f"resume_from_checkpoint: {tmp_path / 'nope'} is not a directory",
            False,
        ),
        (
            "empty",
            ["--resume_from_checkpoint", "last"],
            f"resume_from_checkpoint: no checkpoint-N directory in {tmp_path / 'empty'}",
            False,
        ),
        (  # a setting the checkpoint records: compared in seconds, not after the model (and a vLLM engine) is built
            "full",
            ["--resume_from_checkpoint", "last", "--learning_rate", "0.002"],
            f"resume_from_checkpoint: settings differ from {checkpoint}'s (learning_rate 5e-05 -> 0.002); an exact "
            "resume needs the checkpoint's settings: drop the changes, or pass --resume_with_changed_settings true "
            "to apply them from iteration 2 on",
            False,
        ),
    ]
    for output_dir, flags, message, loads in cases:
        loaded.clear()
        assert cli(["--output_dir", str(tmp_path / output_dir), *TINY_RUN, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"loop-train: error: {message}", err
        assert bool(loaded) is loads, message
    # (test_output_dir.py's resumes through loop-train go on: nothing compared before loading refuses them)


def test_a_process_group_that_cannot_be_ended_after_a_finished_run_is_one_warning_line(monkeypatch, capsys):
    import loop_trainer.cli.train_run as train_cli

    def fails():
        raise RuntimeError("Connection closed by peer\nmore lines")

    monkeypatch.setattr(train_cli, "end_distributed_run", fails)
    train_cli.end_process_group()  # no exception: the run it ends is saved
    assert capsys.readouterr().err == (
        "loop-train: warning: ending the process group failed (RuntimeError: Connection closed by peer)\n"
    )


def test_loop_eval_refuses_an_adapter_of_another_model(tmp_path, capsys, qwen_tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from loop_trainer.cli.evaluate import cli as eval_cli
    from loop_trainer.envs import VaultEnv
    from loop_trainer.models.tiny import build_tiny_for_environment

    vault_model, _ = build_tiny_for_environment(VaultEnv().vocabulary(), seed=0)
    get_peft_model(vault_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "adapter"
    )
    other = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(qwen_tokenizer),
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
        )
    )
    other.save_pretrained(tmp_path / "other")
    qwen_tokenizer.save_pretrained(tmp_path / "other")
    status = eval_cli(
        [
            "--model_name_or_path",
            str(tmp_path / "other"),
            "--adapter",
            str(tmp_path / "adapter"),
            "--environment",
            "vault",
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading progress bars
    assert status == 2 and "size mismatch" in err
    assert err.startswith(f"loop-eval: error: cannot load adapter '{tmp_path / 'adapter'}' on '{tmp_path / 'other'}'")


@pytest.mark.parametrize("recipe", ["qwen2.5-7b-instruct", "qwen2.5-32b-instruct", "cpu-debug"])
def test_shipped_recipes_plan_to_fit(recipe, capsys):
    assert cli(["--config", f"recipes/appworld/{recipe}.yaml", "--dry-run", "--dry_run_show_config", "true"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FITS") and "[LOOP]" in out and "tasks_per_iteration:" in out
    if recipe != "cpu-debug":
        assert "8 GPUs x 80 GiB" in out and "rollouts_per_task: 6" in out
    if recipe == "qwen2.5-7b-instruct":
        assert "vLLM reservation" in out  # colocated
    if recipe == "qwen2.5-32b-instruct":
        assert "vLLM reservation" not in out and "vLLM server's own GPUs" in out


def test_the_overlapped_32b_recipe_plans_its_server_and_checkpoints(capsys):
    recipe = ["--config", "recipes/appworld/qwen2.5-32b-instruct.yaml", "--max_staleness", "2"]
    assert cli([*recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FITS") and "note: max_staleness 2: iteration j's rollouts" in out
    assert "policy j-2" in out and "the 2 batches in flight" in out and "--max-loras 3" in out
    assert cli([*recipe, "--use_peft", "false", "--dry-run"]) == 2  # full weights: one version on a server
    err = capsys.readouterr().err
    assert "use_peft: true" in err and "max_staleness: 1" in err and "Traceback" not in err
    assert cli([*recipe, "--partial_rollouts", "true", "--dry-run"]) == 0  # the recipe sets the paper's cut
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FITS") and "partial_rollouts: the groups running at each cut" in out


def test_the_7b_recipe_split_over_its_node_plans_to_fit_overlapped(capsys):
    """The 7B recipe's header: 4 GPUs train (ZeRO-3) while a vLLM server on the other 4 samples ahead."""
    split = ["--vllm_mode", "server", "--max_staleness", "2", "--plan_gpus", "4"]
    assert cli(["--config", "recipes/appworld/qwen2.5-7b-instruct.yaml", *split, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("FITS") and "4 GPUs x 80 GiB, ZeRO-3" in out
    assert "vLLM reservation" not in out and "--max-loras 3" in out


@pytest.mark.parametrize(
    ("flags", "knob"),
    [
        (
            [
                "--config",
                "recipes/appworld/qwen2.5-32b-instruct.yaml",
                "--use_peft",
                "false",
                "--plan_gpus",
                "1",
                "--vllm_tensor_parallel_size",
                "1",
            ],
            "fits with these together: plan_gpus: 32 (",  # full fine-tuning of 32B: more GPUs, or nothing
        ),
        (
            [
                "--config",
                "recipes/appworld/qwen2.5-7b-instruct.yaml",
                "--max_training_tokens",
                "131072",
                "--activation_checkpointing",
                "false",
            ],
            "fits with these together: activation_checkpointing: true, ",
        ),
        (
            [
                "--config",
                "recipes/appworld/qwen2.5-32b-instruct.yaml",
                "--vllm_mode",
                "colocate",
                "--vllm_gpu_memory_utilization",
                "0.5",
                "--vllm_enable_sleep_mode",
                "true",
            ],
            "fits with these together: vllm_mode: server (",  # 32B weights do not fit one GPU's engine
        ),
    ],
)
def test_an_oversized_setting_is_refused_with_the_knob_to_turn(flags, knob, capsys):
    assert cli([*flags, "--dry-run"]) == 3
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and knob in out


def test_a_tensor_parallel_colocated_engine_is_refused_with_the_alternative(capsys):
    flags = [
        "--config",
        "recipes/appworld/qwen2.5-32b-instruct.yaml",
        "--vllm_mode",
        "colocate",
        "--vllm_tensor_parallel_size",
        "4",
        "--dry-run",
    ]
    assert cli(flags) == 2
    err = capsys.readouterr().err
    assert "vllm_tensor_parallel_size must be 1 with vllm_mode: colocate" in err and "vllm_mode: server" in err


def test_use_vllm_without_vllm_installed_says_how_to_install_it(tmp_path, capsys):
    try:  # the main test venv has no vLLM by design (tests/vllm_deepspeed/ run with it)
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.fail("this test expects the main venv without vLLM")
    assert cli(["--output_dir", str(tmp_path), "--model_name_or_path", "tiny:vault", "--use_vllm", "true"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "use_vllm: false" in err and "Traceback" not in err


def test_every_key_of_the_shipped_recipes_is_documented():
    import yaml

    documented = Path("docs/recipes.md").read_text()
    for recipe in Path("recipes").rglob("*.yaml"):
        if recipe.parent.name == "accelerate":
            continue
        for key in yaml.safe_load(recipe.read_text()):
            assert f"`{key}`" in documented, (recipe, key)


def test_loop_eval_keeps_a_null_whose_none_is_a_value_and_follows_the_run_for_the_others(tmp_path):
    """A YAML null reaches the parser as a default, not a flag: for the environment's kwargs and the episode settings
    None is a value (no kwargs, no budget), which following the run must not replace; for the split it is unset."""
    from trl import ModelConfig

    from loop_trainer.cli.evaluate import EvalArguments, follow_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(
        "environment: errands\nenvironment_kwargs: {levels: [1]}\neval_split: train\nmax_turns: 9\n"
        "max_completion_tokens: 64\n"
    )
    recipe = write(
        tmp_path,
        f"""
        model_name_or_path: {run}
        output_dir: {tmp_path / "eval"}
        environment_kwargs: null
        max_completion_tokens: null
        split: null
        """,
    )
    eval_args, model_args = parse_recipe(["--config", recipe], (EvalArguments, ModelConfig))
    assert "max_completion_tokens" not in eval_args.effective_recipe  # the recipe as run records no resolved null
    followed, taken = follow_run(eval_args, model_args)
    assert (followed.environment, followed.environment_kwargs, followed.max_completion_tokens) == (
        "errands",
        None,
        None,
    )
    assert (followed.split, followed.max_turns) == ("train", 9)
    assert set(taken) == {"environment", "split", "max_turns"}
    # a flag over a YAML null is the flag's value
    eval_args, model_args = parse_recipe(
        ["--config", recipe, "--max_completion_tokens", "32"], (EvalArguments, ModelConfig)
    )
    assert follow_run(eval_args, model_args)[0].max_completion_tokens == 32


def test_loop_eval_pointed_at_a_run_follows_its_environment_and_episode_limits(tmp_path, capsys, caplog):
    """A run's output_dir holds the recipe.yaml loop-train wrote: loop-eval takes the world, its kwargs and the
    episode limits the policy trained under from it (not its own 40 turns of 1,500 tokens), the split from the
    environment, and a flag overrides any of them."""
    from loop_trainer.cli.evaluate import cli as eval_cli

    recipe = write(
        tmp_path,
        f"""
        model_name_or_path: tiny:vault
        environment: vault
        environment_kwargs: {{num_tasks: 6}}
        output_dir: {tmp_path / "run"}
        iterations: 1
        tasks_per_iteration: 2
        rollouts_per_task: 2
        max_turns: 3
        max_new_tokens_per_turn: 4
        max_trajectory_tokens: 256
        activation_checkpointing: false
        disable_tqdm: true
    """,
    )
    assert cli(["--config", recipe]) == 0
    assert (tmp_path / "run" / "recipe.yaml").is_file() and (tmp_path / "run" / "README.md").is_file()
    with caplog.at_level(logging.INFO, logger="loop_trainer"):
        assert eval_cli(["--model_name_or_path", str(tmp_path / "run"), "--output_dir", str(tmp_path / "eval")]) == 0
    followed = [r.getMessage() for r in caplog.records if "following the run" in r.getMessage()]
    assert len(followed) == 1 and "environment vault" in followed[0] and "max_turns 3" in followed[0]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert metrics["split"] == "test" and len(rows) == len(VaultEnv(num_tasks=6).tasks("test"))
    assert max(row["num_turns"] for row in rows) == 3  # the run's max_turns (a random policy runs to it)
    replies = [m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant"]
    assert max(len(reply.split()) for reply in replies) <= 4  # the run's max_new_tokens_per_turn, in words
    flags = ["--model_name_or_path", str(tmp_path / "run"), "--output_dir", str(tmp_path / "eval2"), "--max_turns", "1"]
    assert eval_cli(flags) == 0
    rows = [json.loads(line) for line in (tmp_path / "eval2" / "results.jsonl").read_text().splitlines()]
    assert max(row["num_turns"] for row in rows) == 1  # the flag, not the run's 3
    capsys.readouterr()
    assert eval_cli([*flags[:4], "--split", "dev"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "vault has no split 'dev'" in err and "set --split to one of them" in err and "eval_split" not in err


def test_loop_eval_follows_a_runs_recipe_key_by_key_and_a_lora_run_as_its_adapter_on_the_base(tmp_path):
    from trl import ModelConfig

    from loop_trainer.cli.evaluate import EvalArguments, follow_run
    from loop_trainer.cli.recipe import RecipeError

    def follow(recipe: str, given: dict, adapter: bool = False, **flags):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        (run / "recipe.yaml").write_text(textwrap.dedent(recipe))
        if adapter:
            (run / "adapter_config.json").write_text("{}")
        eval_args = EvalArguments(output_dir=str(tmp_path / "eval"), **flags)
        eval_args.effective_recipe = {"model_name_or_path": str(run), **given}
        model_args = ModelConfig(model_name_or_path=str(run))
        followed, taken = follow_run(eval_args, model_args)
        return run, followed, model_args, taken

    lora = """
        model_name_or_path: Qwen/Qwen2.5-7B-Instruct
        use_peft: true
        environment: appworld
        eval_split: test_normal
        max_turns: 30
        static_decode: true
    """
    run, followed, model_args, taken = follow(lora, {}, adapter=True)
    assert (followed.adapter, model_args.model_name_or_path) == (str(run), "Qwen/Qwen2.5-7B-Instruct")
    assert (followed.environment, followed.split, followed.max_turns) == ("appworld", "test_normal", 30)
    assert set(taken) == {"environment", "split", "max_turns", "adapter"}  # not how it sampled (static_decode)
    assert followed.static_decode is None
    # the same files left by an overwritten LoRA run, under a full fine-tune's recipe: no adapter
    _, followed, model_args, _ = follow(lora.replace("use_peft: true", "use_peft: false"), {}, adapter=True)
    assert followed.adapter is None and model_args.model_name_or_path.startswith(str(tmp_path))
    # a recipe naming no environment ran on loop-train's default; another environment given here takes none of
    # the run's kwargs or split, only its episode limits; a flag wins over the run
    _, followed, _, _ = follow("max_turns: 5\n", {})
    assert followed.environment == "vault" and followed.max_turns == 5
    errands = "environment: errands\nenvironment_kwargs: {levels: [1]}\neval_split: train\nmax_turns: 9\n"
    _, followed, _, taken = follow(errands, {"environment": "vault", "max_turns": 2}, environment="vault", max_turns=2)
    assert (followed.environment, followed.environment_kwargs, followed.split, followed.max_turns) == (
        "vault",
        None,
        None,
        2,
    )
    assert taken == {}
    # a tiny LoRA run: its base rebuilt with the run's seed and warm-up steps, sampled with loop-eval's own seed
    tiny_lora = "model_name_or_path: tiny-instruct:vault\nuse_peft: true\nseed: 7\ntiny_instruct_steps: 50\n"
    tiny_run, followed, model_args, taken = follow(tiny_lora + "generation_batch_limit: 4\n", {}, adapter=True, seed=3)
    assert (followed.adapter, model_args.model_name_or_path) == (str(tiny_run), "tiny-instruct:vault")
    assert (followed.model_seed, followed.tiny_instruct_steps, followed.seed) == (7, 50, 3)
    assert "generation_batch_limit" not in taken and "model_episode_settings" not in taken  # a warm-up of set steps
    # a warm-up a greedy probe may end: the probe runs under the run's episode settings, the evaluation under its own
    probed = "model_name_or_path: tiny-instruct:vault\nuse_peft: true\ngeneration_batch_limit: 4\nmax_turns: 9\n"
    _, defaults, _, taken = follow(probed, {"max_turns": 5}, adapter=True, max_turns=5)
    assert (defaults.model_seed, defaults.tiny_instruct_steps) == (LOOPConfig.seed, LOOPConfig.tiny_instruct_steps)
    assert (defaults.generation_batch_limit, defaults.max_turns) == (64, 5)  # how loop-eval samples: its own
    probe = defaults.warm_up_probe_settings()
    assert (probe.generation_batch_limit, probe.max_turns) == (4, 9)  # the warm-up's probe: the run's
    assert probe.max_new_tokens_per_turn == LOOPConfig.max_new_tokens_per_turn  # unset in the run: its default
    given = {"env_timeout": 600}  # given: over the run's, the rest still the run's
    _, over, _, _ = follow(probed, {"model_episode_settings": given}, adapter=True, model_episode_settings=given)
    probe = over.warm_up_probe_settings()
    assert (probe.env_timeout, probe.generation_batch_limit, probe.max_turns) == (600, 4, 9)
    *_, taken = follow(probed, {"tiny_instruct_steps": 5}, adapter=True, tiny_instruct_steps=5)
    assert "model_episode_settings" not in taken  # a warm-up of set steps: no probe
    tiny = "model_name_or_path: tiny:vault\nuse_peft: true\n"  # no warm-up at all
    assert "model_episode_settings" not in follow(tiny, {}, adapter=True)[3]
    _, flagged, *_ = follow(tiny_lora, {"model_seed": 1}, adapter=True, model_seed=1)  # a flag wins
    assert (flagged.model_seed, flagged.tiny_instruct_steps) == (1, 50)
    # evaluated under other environment_kwargs, the base is still built from the run's world (its demonstrations)
    worlds = tiny_lora + "environment: vault\nenvironment_kwargs: {num_tasks: 64}\n"
    assert "model_environment_kwargs" not in follow(worlds, {}, adapter=True)[3]  # the run's: no other world
    other = {"num_tasks": 8}
    _, followed, _, taken = follow(worlds, {"environment_kwargs": other}, adapter=True, environment_kwargs=other)
    assert (followed.environment_kwargs, taken["model_environment_kwargs"]) == (other, {"num_tasks": 64})
    same = {"num_tasks": 64}
    flags = {"environment_kwargs": same}
    assert "model_environment_kwargs" not in follow(worlds, flags, adapter=True, **flags)[3]
    given = {"environment_kwargs": other, "model_environment_kwargs": other}  # a flag wins
    _, followed, _, taken = follow(worlds, given, adapter=True, **given)
    assert followed.model_environment_kwargs == other and "model_environment_kwargs" not in taken
    elsewhere = {"environment": "errands", "environment_kwargs": other}  # another environment: not the run's world
    assert "model_environment_kwargs" not in follow(worlds, elsewhere, adapter=True, **elsewhere)[3]
    full = worlds.replace("use_peft: true", "use_peft: false")  # a full fine-tune's weights are all saved
    flags = {"environment_kwargs": other}
    assert "model_environment_kwargs" not in follow(full, flags, adapter=True, **flags)[3]
    named = EvalArguments(output_dir=str(tmp_path / "eval"), adapter=str(tiny_run))  # --adapter names the run
    model_args = ModelConfig()
    assert follow_run(named, model_args)[0].model_seed == 7 and model_args.model_name_or_path == "tiny-instruct:vault"
    with pytest.raises(RecipeError, match="holds a LoRA adapter on 'tiny-instruct:vault', not on 'tiny:vault'"):
        follow_run(named, ModelConfig(model_name_or_path="tiny:vault"))
    # a flag the run's recipe file holds as text, as loop-train's parser read it
    assert follow('context_strip_thinking: "true"\n', {})[1].context_strip_thinking is True
    assert follow('max_turns: "8"\n', {})[1].max_turns == 8  # a number too
    with pytest.raises(RecipeError, match="context_strip_thinking must be true or false, got 'maybe'"):
        follow('context_strip_thinking: "maybe"\n', {})
    with pytest.raises(RecipeError, match="not a run's recipe"):
        follow("- a list\n", {})
    assert follow_run(EvalArguments(output_dir=str(tmp_path / "e")), ModelConfig(model_name_or_path="x"))[1] == {}


def test_loop_eval_follows_a_checkpoint_of_a_run_with_the_settings_it_was_trained_under(tmp_path):
    """``RUN/checkpoint-N`` is evaluated as that checkpoint's adapter, with the run's recipe one level up and the
    settings the checkpoint recorded in place of the recipe's (a resume with changed settings rewrites the recipe),
    a tiny LoRA run's base as the checkpoint recorded building it."""
    from trl import ModelConfig

    from loop_trainer.cli.evaluate import EvalArguments, follow_run
    from loop_trainer.training.checkpoints import write_loop_state

    run = tmp_path / "run"
    checkpoint = run / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    recipe = "model_name_or_path: tiny-instruct:vault\nuse_peft: true\nmax_turns: 30\nenvironment: vault\n"
    (run / "recipe.yaml").write_text(recipe + 'environment_kwargs: {"num_tasks": 8}\n')
    (run / "adapter_config.json").write_text("{}")
    (checkpoint / "adapter_config.json").write_text("{}")

    def follow(directory, **flags):
        eval_args = EvalArguments(output_dir=str(tmp_path / "eval"), **flags)
        eval_args.effective_recipe = {"model_name_or_path": str(directory), **flags}
        model_args = ModelConfig(model_name_or_path=str(directory))
        followed, taken = follow_run(eval_args, model_args)
        return followed, model_args, taken

    assert follow(checkpoint)[2] == {}  # no loop_state.json: not a complete checkpoint, not followed
    base = {"seed": 7, "tiny_instruct_steps": None, "max_turns": 12, "generation_batch_limit": 4}
    recorded = {"max_turns": 12, "environment_kwargs": {"num_tasks": 4}, "seed": 7, "tiny_base": base}
    write_loop_state(checkpoint, {"iteration": 2, "settings": {**recorded, "environment": "vault-v2", "model": "m"}})
    followed, model_args, taken = follow(checkpoint)
    assert (followed.adapter, model_args.model_name_or_path) == (str(checkpoint), "tiny-instruct:vault")
    assert (followed.max_turns, followed.environment_kwargs) == (12, {"num_tasks": 4})  # the checkpoint's
    assert followed.environment == "vault"  # the recipe's spec (a checkpoint records the environment's name)
    assert (followed.model_seed, followed.tiny_instruct_steps) == (7, None)
    probe = followed.warm_up_probe_settings()
    assert (probe.max_turns, probe.generation_batch_limit, followed.generation_batch_limit) == (12, 4, 64)
    assert follow(checkpoint, max_turns=5)[0].max_turns == 5  # a flag still wins
    followed, _, _ = follow(run)  # the run itself: its recipe
    assert (followed.adapter, followed.max_turns, followed.environment_kwargs) == (str(run), 30, {"num_tasks": 8})
    write_loop_state(checkpoint, {"iteration": 2, "settings": {"max_turns": 0}})
    with pytest.raises(RecipeError, match=f"{run / 'recipe.yaml'} and {checkpoint / 'loop_state.json'}: max_turns"):
        follow(checkpoint)
    write_loop_state(checkpoint, {"iteration": 2})  # an older loop_trainer's: no settings, the recipe's
    assert follow(checkpoint)[0].max_turns == 30
    for damaged, says in (("{not json", "not valid JSON"), ("[1, 2]", "not a LOOP checkpoint's state")):
        (checkpoint / "loop_state.json").write_text(damaged)
        with pytest.raises(RecipeError, match=says):
            follow(checkpoint)


def test_loop_eval_takes_the_warm_up_probes_episode_settings_as_a_mapping_of_episode_settings(tmp_path):
    from loop_trainer.cli.evaluate import EvalArguments

    def probe_of(value):
        return EvalArguments(output_dir=str(tmp_path), max_turns=3, model_episode_settings=value)

    assert probe_of('{"max_turns": 8}').warm_up_probe_settings().max_turns == 8  # JSON on the CLI
    assert probe_of(None).warm_up_probe_settings().max_turns == 3  # unset: the evaluation's
    for value, says in (
        ('{"max_turn": 8}', "max_turn is not an episode setting"),
        ({"max_turns": 0}, "model_episode_settings: max_turns must be"),
        ('{"context_strip_thinking": "false"}', "model_episode_settings: context_strip_thinking must be true or false"),
        ("[8]", "must be a mapping"),
        ("{8", "not valid JSON"),
    ):
        with pytest.raises(RecipeError, match=says):
            probe_of(value)


def test_a_tiny_model_is_built_from_the_world_model_environment_kwargs_names(tmp_path, monkeypatch):
    """Its world built apart and closed after; one whose words the evaluated world outgrows is refused."""
    from loop_trainer.cli import evaluate as loop_eval
    from loop_trainer.cli.evaluate import EvalArguments, tiny_model_world
    from loop_trainer.envs.vault import VaultEnv

    built = []

    class Closing(VaultEnv):
        closed = False

        def close(self) -> None:
            self.closed = True

    def make(name, **kwargs):
        built.append(Closing(**kwargs))
        return built[-1]

    monkeypatch.setattr(loop_eval, "make_environment", make)
    evaluated = VaultEnv(num_tasks=3)

    def world_of(**flags):
        with tiny_model_world(evaluated, EvalArguments(output_dir=str(tmp_path), **flags)) as world:
            return world

    assert world_of() is evaluated and world_of(model_environment_kwargs={}) is evaluated and built == []
    same = {"num_tasks": 3}
    assert world_of(environment_kwargs=same, model_environment_kwargs=same) is evaluated and built == []
    world = world_of(environment_kwargs={"num_tasks": 3}, model_environment_kwargs='{"num_tasks": 8}')
    assert world is built[-1] and world.num_tasks == 8 and world.closed
    monkeypatch.setattr(Closing, "vocabulary", staticmethod(lambda: VaultEnv.vocabulary()[:-2]))
    with pytest.raises(RecipeError, match="uses words that a tiny model built from model_environment_kwargs"):
        world_of(model_environment_kwargs={"num_tasks": 8})
    assert built[-1].closed
    with pytest.raises(RecipeError, match="model_environment_kwargs must be a mapping"):
        EvalArguments(output_dir=str(tmp_path), model_environment_kwargs="[1]")


def test_loop_eval_puts_a_tiny_lora_runs_adapter_on_the_base_it_trained(tmp_path, monkeypatch):
    """The base is rebuilt with the run's seed and warm-up (not loop-eval's sampling seed): every weight of the
    evaluated model, base and adapter, is the trained policy's."""
    from loop_trainer.cli import evaluate as loop_eval
    from loop_trainer.cli.train import main as train_main

    out = tmp_path / "run"
    flags = ["--use_peft", "true", "--seed", "7", "--tiny_instruct_steps", "30", "--iterations", "1"]
    flags += ["--tasks_per_iteration", "2", "--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", "1"]
    trainer = train_main(
        *parse_recipe(["--config", str(ROOT / "recipes" / "demo.yaml"), "--output_dir", str(out), *flags])
    )
    assert trainer is not None
    trained = trainer.model.state_dict()
    loaded = []
    load = loop_eval.load_policy
    monkeypatch.setattr(loop_eval, "load_policy", lambda *args: loaded.append(load(*args)) or loaded[-1])
    for evaluated_dir in (out, out / "checkpoint-1"):  # the run, and its checkpoint (the run's recipe one level up)
        argv = ["--model_name_or_path", str(evaluated_dir), "--max_tasks", "2", "--seed", "3"]
        assert loop_eval.cli([*argv, "--output_dir", str(tmp_path / "e" / evaluated_dir.name)]) == 0
        evaluated = loaded[-1][0].state_dict()
        shared = trained.keys() & evaluated.keys()
        assert any("lora_A" in key for key in shared) and any("base_layer" in key for key in shared)
        assert any("embed_tokens" in key for key in shared)
        assert [key for key in sorted(shared) if not torch.equal(trained[key], evaluated[key])] == []
    # evaluated on fewer tasks: the base is still built from the run's world (its demonstrations replay its tasks)
    argv = ["--model_name_or_path", str(out), "--max_tasks", "2", "--environment_kwargs", '{"num_tasks": 8}']
    assert loop_eval.cli([*argv, "--output_dir", str(tmp_path / "e" / "fewer")]) == 0
    evaluated = loaded[-1][0].state_dict()
    assert [key for key in sorted(shared) if not torch.equal(trained[key], evaluated[key])] == []
    rows = (tmp_path / "e" / "fewer" / "results.jsonl").read_text().splitlines()
    assert len(rows) == 2

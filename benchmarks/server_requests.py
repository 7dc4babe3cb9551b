"""Host CPU of a server generator's completion requests: keep-alive ``http.client`` connections (ours now) against
a ``requests`` session (ours before, and the transport of TRL's ``VLLMClient``), side by side in one run.

A vLLM server is one request per sampled turn of every episode, and the training process pays each request's client
side in CPU. That CPU is the interpreter lock's: with ``max_staleness`` the update's kernel launches run on the same
process, beside the collection. On one H200 (docs/benchmarks.md, round four) errands' collection through a server was
85 % of an iteration, and the overlapped update took 3.55 s beside it instead of 0.44 s.

The server here is a stand-in: a lean asyncio server in its own process, pinned to a core of its own, that answers
every completion at once with a fixed reply (``doc people``, a call errands answers without ending the episode: every
episode runs its 32 turns). So what is measured is this process's side alone. Three parts:

1. **One request**, the same prompt of ``--prompt-tokens`` ids posted ``--requests`` times from one thread: the
   process's CPU a request through our backend (keep-alive, and ``keep_alive=False``: a ``requests`` session) and
   through TRL's ``VLLMClient.generate`` (a ``requests`` session with retries), one prompt a request and
   ``--batch`` prompts a request (TRL's turn-synchronous tool loop batches every episode's turn into one request;
   reported per prompt).
2. **One iteration of errands**: ``recipes/errands.yaml``'s shape (16 tasks x 6 rollouts, up to 32 turns, compact
   form, its tiny model's tokenizer) collected by :class:`~loop_trainer.rollout.RolloutEngine` through
   :class:`~loop_trainer.rollout.vllm_server.VLLMServerBackend`, both request paths alternately, ``--repeats`` pairs:
   wall seconds and the process's CPU seconds, per turn. Then the same in the English form with Qwen2.5's tokenizer
   (24 new tokens a turn, episodes of 2-3k tokens), where tokenising the environment's answers costs more.
3. **An update beside the collection**: a stream of tiny torch operations on the main thread (each releases and
   retakes the interpreter lock, as a CUDA kernel launch does) while the iteration is collected on a thread of the
   same process, as ``max_staleness: 1`` runs them, or in a child process (``collection_process: true``; the child
   runs on this process's cores): operations a second alone and beside, and the collection's wall seconds alone and
   beside.

This process runs on ``--cores`` (default: every core but the server's); on two cores the third part shares one core
with the server, which the result records. ``--switch-interval`` sets how soon a thread waiting for the interpreter
lock asks for it (``sys.setswitchinterval``; Python's default 5 ms).

    .vllm-venv/bin/python -m benchmarks.server_requests --out benchmarks/results/server-requests-cpu.json

TRL's client needs vLLM importable (``.vllm-venv``); under ``.venv`` its rows are left out, and the result says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, command_line, cpu_model, software, torch_threads, wait_for_load

# per form: the reply (a look-up errands answers without ending the episode) and the episode limits
REPLY_TEXT = {"compact": "doc people", "english": 'doc("people")'}
LIMITS = {  # recipes/errands.yaml; in English, the GPU battery's long_horizon_english section's
    "compact": (32, 4, 1024),
    "english": (32, 24, 4096),
}
MAX_TURNS, MAX_NEW_TOKENS = 32, 4  # the compact form's, which parts 1 and 3 use
TASKS, ROLLOUTS = 16, 6


# -- the stand-in server (its own process) -------------------------------------------------------------------------
def serve(port: int, reply_ids: list[int]) -> None:
    """Answer vLLM's OpenAI endpoints that the clients call: every completion with ``reply_ids``, one choice a
    prompt (TRL batches prompts), with the log-prob fields both clients read."""

    def choice(prompt: list[int]) -> dict[str, Any]:
        return {
            "token_ids": reply_ids,
            "prompt_token_ids": prompt,
            "logprobs": {
                "token_logprobs": [-0.5] * len(reply_ids),
                "tokens": [f"token_id:{i}" for i in reply_ids],
                "top_logprobs": [None] * len(reply_ids),
            },
        }

    def answer(status: bytes, body: bytes) -> bytes:
        head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(body))
        return head + body

    models = json.dumps({"data": [{"id": "stand-in"}]}).encode()
    info = json.dumps({"vllm_config": {"cache_config": {"enable_prefix_caching": True}}}).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *headers = head.split(b"\r\n")
                length = next((int(h.split(b":")[1]) for h in headers if h.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                if b"/v1/completions" in request_line:
                    prompt = json.loads(body)["prompt"]
                    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
                    writer.write(answer(b"200 OK", json.dumps({"choices": [choice(p) for p in prompts]}).encode()))
                elif b"/v1/models" in request_line:
                    writer.write(answer(b"200 OK", models))
                elif b"/server_info" in request_line:
                    writer.write(answer(b"200 OK", info))
                else:  # /health and the rest
                    writer.write(answer(b"200 OK", b"{}"))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start_server(port: int, reply_ids: list[int], core: int, log: Path) -> subprocess.Popen:
    """The stand-in server on ``core``, once it answers (its output in ``log``)."""
    from benchmarks.overlap import wait_for

    command = [sys.executable, "-m", "benchmarks.server_requests", "--serve", str(port), json.dumps(reply_ids)]
    server = subprocess.Popen(
        ["taskset", "-c", str(core), *command], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        wait_for(f"http://127.0.0.1:{port}", server, log, timeout=30)
    except BaseException:
        server.kill()
        raise
    return server


# -- the measurements ----------------------------------------------------------------------------------------------
def timed(call: Any, count: int) -> dict[str, float]:
    """Microseconds of wall and of this process's CPU per call, over ``count`` calls after one unmeasured."""
    call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        call()
    return {
        "wall_us": round(1e6 * (time.perf_counter() - wall) / count, 1),
        "cpu_us": round(1e6 * (time.process_time() - cpu) / count, 1),
    }


def one_request(url: str, stop_ids: list[int], options: argparse.Namespace, sync_dir: str) -> dict[str, Any]:
    from loop_trainer.rollout.vllm_server import VLLMServerBackend

    prompt = list(range(3, 3 + options.prompt_tokens))
    rows: dict[str, Any] = {}
    for label, keep_alive in (("ours, keep-alive", True), ("ours, requests (before)", False)):
        with VLLMServerBackend(url, stop_token_ids=stop_ids, sync_dir=sync_dir, keep_alive=keep_alive) as backend:
            ours = backend.client
            payload = ours.completion_request(prompt, MAX_NEW_TOKENS, seed=0, temperature=1.0, model=backend.model)
            rows[label] = timed(lambda c=ours, p=payload: c._complete(p), options.requests)
    try:
        from trl.generation.vllm_client import VLLMClient

        client = VLLMClient(base_url=url)
    except ImportError as error:
        rows["trl"] = f"left out: {error}"
        return rows
    rows["TRL VLLMClient.generate, 1 prompt a request"] = timed(
        lambda: client.generate([prompt], max_tokens=MAX_NEW_TOKENS, logprobs=0), options.requests
    )
    batch = timed(
        lambda: client.generate([prompt] * options.batch, max_tokens=MAX_NEW_TOKENS, logprobs=0),
        max(1, options.requests // options.batch),
    )
    rows[f"TRL VLLMClient.generate, {options.batch} prompts a request (per prompt)"] = {
        key: round(value / options.batch, 1) for key, value in batch.items()
    }
    return rows


class Collection:
    """One errands iteration through the server backend, on either request path: the compact form with its tiny
    model's word tokenizer, or the English form with Qwen2.5's (a real BPE tokenizer and 2-3k-token episodes)."""

    def __init__(self, url: str, sync_dir: str, form: str = "compact"):
        from loop_trainer.chat import stop_token_ids
        from loop_trainer.envs import make_environment
        from loop_trainer.models.tiny import build_tiny_for_environment, tiny_layers_of
        from loop_trainer.models.tiny_chat import build_qwen25_tokenizer

        env: Any = make_environment("errands", num_tasks=1024, levels=[1, 2, 3], form=form)
        self.env, self.form = env, form
        if form == "compact":  # errands' vocabulary()
            model, self.tokenizer = build_tiny_for_environment(env.vocabulary(), num_layers=tiny_layers_of(env))
            self.stop_ids = stop_token_ids(model, self.tokenizer)
        else:
            self.tokenizer = build_qwen25_tokenizer()
            self.stop_ids = self.tokenizer.encode("<|im_end|>", add_special_tokens=False)  # one id: a special token
        self.tasks = [self.env.tasks("train")[i] for i in range(TASKS)]
        self.url, self.sync_dir = url, sync_dir

    def open(self) -> None:
        """Connect to the server (once it runs)."""
        from loop_trainer.chat import ChatFormatter
        from loop_trainer.rollout.engine import EngineSetup
        from loop_trainer.rollout.records import EpisodeLimits
        from loop_trainer.rollout.vllm_server import VLLMServerBackend

        url, sync_dir = self.url, self.sync_dir
        self.backends = {
            keep_alive: VLLMServerBackend(url, stop_token_ids=self.stop_ids, sync_dir=sync_dir, keep_alive=keep_alive)
            for keep_alive in (True, False)
        }
        # the engine's defaults: env_timeout 300 s, no context policy, up to 256 episodes at once
        self.setup = EngineSetup(
            self.env, ChatFormatter(self.tokenizer), EpisodeLimits(*LIMITS[self.form]), 300, None, 256
        )
        self.engine = self.setup.build(self.backends[True])

    def reply_ids(self) -> list[int]:
        return [*self.tokenizer.encode(REPLY_TEXT[self.form], add_special_tokens=False), self.stop_ids[0]]

    def run(self, keep_alive: bool, child: Any = None) -> dict[str, float]:
        """One iteration, on this process or by ``child`` (a :class:`CollectionProcess`: then ``cpu_s`` is this
        process's alone, its waiting thread's)."""
        wall, cpu = time.perf_counter(), time.process_time()
        batch = (child or self.engine).collect(self.tasks, ROLLOUTS, seed=0, backend=self.backends[keep_alive])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        turns = sum(max(t.turn_ids) + 1 for t in batch.trajectories)
        if len(batch.trajectories) != TASKS * ROLLOUTS or turns != TASKS * ROLLOUTS * MAX_TURNS:
            raise RuntimeError(f"expected {TASKS * ROLLOUTS} episodes of {MAX_TURNS} turns, got {turns} turns")
        tokens = sum(len(t.token_ids) for t in batch.trajectories) / len(batch.trajectories)
        return {"wall_s": wall, "cpu_s": cpu, "turns": turns, "tokens_per_trajectory": tokens}

    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
        for backend in getattr(self, "backends", {}).values():
            backend.close()


def launches(count: int) -> float:
    """Seconds for ``count`` tiny torch operations in a row (each releases and retakes the interpreter lock)."""
    import torch

    x = y = torch.ones(16)
    started = time.perf_counter()
    for _ in range(count):
        y = y + x
    return time.perf_counter() - started


def launch_rate_while(running: threading.Thread, chunk: int = 500) -> float:
    """Tiny operations a second on this thread, in chunks, until ``running`` ends."""
    done, started = 0, time.perf_counter()
    while running.is_alive():
        launches(chunk)
        done += chunk
    return done / (time.perf_counter() - started)


def iteration(collection: Collection, repeats: int) -> dict[str, Any]:
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    collection.run(True), collection.run(False)  # unmeasured: first connections, caches
    for _ in range(repeats):
        for keep_alive in (False, True):
            runs[keep_alive].append(collection.run(keep_alive))
    rows = {}
    for keep_alive, label in ((True, "ours, keep-alive"), (False, "ours, requests (before)")):
        cpu = statistics.median(r["cpu_s"] for r in runs[keep_alive])
        rows[label] = {
            "wall_s": [round(r["wall_s"], 3) for r in runs[keep_alive]],
            "cpu_s": [round(r["cpu_s"], 3) for r in runs[keep_alive]],
            "median_cpu_ms_per_turn": round(1e3 * cpu / runs[keep_alive][0]["turns"], 3),
        }
    before, after = (statistics.median(r["cpu_s"] for r in runs[k]) for k in (False, True))
    return {
        "form": collection.form,
        "turns": runs[True][0]["turns"],
        "tokens_per_trajectory": round(runs[True][0]["tokens_per_trajectory"], 1),
        "rows": rows,
        "cpu_ratio_before_over_keep_alive": round(before / after, 2),
    }


def beside(collection: Collection, options: argparse.Namespace) -> dict[str, Any]:
    """The update's launch rate alone and while the collection runs on another thread (or in a child process, a
    thread of this one waiting for it: ``collection_process``), and the collection's wall seconds alone and beside
    the update."""
    from loop_trainer.rollout.collection_process import CollectionProcess

    with CollectionProcess(collection.setup) as child:
        collection.run(True, child)  # unmeasured: the child's first connections
        return beside_paths(collection, options, child)


def beside_paths(collection: Collection, options: argparse.Namespace, child: Any) -> dict[str, Any]:
    """:func:`beside`'s measurements, ``child`` collecting the third path."""
    rows: dict[str, Any] = {}
    paths = (
        (True, None, "ours, keep-alive"),
        (False, None, "ours, requests (before)"),
        (True, child, "ours, keep-alive, collection_process"),
    )
    for keep_alive, process, label in paths:
        trials = []
        for _ in range(options.repeats):
            alone_rate = options.launches / launches(options.launches)
            collection_alone = collection.run(keep_alive, process)["wall_s"]
            collected: dict[str, float] = {}
            thread = threading.Thread(
                target=lambda k=keep_alive, p=process, out=collected: out.update(collection.run(k, p))
            )
            thread.start()
            beside_rate = launch_rate_while(thread)
            thread.join()
            trials.append(
                {
                    "launches_per_s_alone": round(alone_rate),
                    "launches_per_s_beside": round(beside_rate),
                    "collection_wall_s_alone": round(collection_alone, 3),
                    "collection_wall_s_beside": round(collected["wall_s"], 3),
                }
            )
        rows[label] = {
            "trials": trials,
            "median_update_slowdown": round(
                statistics.median(t["launches_per_s_alone"] / t["launches_per_s_beside"] for t in trials), 1
            ),
            "median_collection_slowdown": round(
                statistics.median(t["collection_wall_s_beside"] / t["collection_wall_s_alone"] for t in trials), 2
            ),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="part 1: requests per path")
    parser.add_argument("--prompt-tokens", type=int, default=600, help="part 1: the prompt's length")
    parser.add_argument("--batch", type=int, default=TASKS * ROLLOUTS, help="part 1: prompts in TRL's batched request")
    parser.add_argument("--repeats", type=int, default=3, help="parts 2 and 3: runs per path")
    parser.add_argument("--launches", type=int, default=20000, help="part 3: tiny operations timed alone")
    parser.add_argument("--cores", default=None, help="this process's cores (default: all but the server's)")
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval, in seconds (default: Python's)"
    )
    parser.add_argument(
        "--max-load", type=float, default=0.5, help="wait (up to 10 min) for a 1-minute load average below this"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.serve:
        serve(int(options.serve[0]), json.loads(options.serve[1]))
        return 0

    import tempfile

    from loop_trainer.net import free_local_port

    if options.switch_interval is not None:
        sys.setswitchinterval(options.switch_interval)
    load, idle = wait_for_load(options.max_load, max_wait=600, measure_anyway=True)
    torch_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    server_core = cores[-1]
    mine = {int(c) for c in options.cores.split(",")} if options.cores else set(cores[:-1]) or {server_core}
    os.sched_setaffinity(0, mine)
    with tempfile.TemporaryDirectory() as sync_dir:
        result: dict[str, Any] = {
            "command": command_line("benchmarks.server_requests", argv, python=".vllm-venv/bin/python"),
            "machine": {"cpu": cpu_model(), "this_process_cores": sorted(mine), "server_core": server_core},
            "switch_interval_s": sys.getswitchinterval(),
            "load_average_before": load,
            "machine_was_idle": idle,
            "software": software(["torch", "transformers", "trl", "requests"], checkout=True),
        }
        for form in ("compact", "english"):  # a stand-in server each: its reply is the form's
            port = free_local_port()
            collection = Collection(f"http://127.0.0.1:{port}", sync_dir, form)
            server = start_server(port, collection.reply_ids(), server_core, Path(sync_dir) / f"server-{form}.log")
            try:
                collection.open()
                if form == "compact":
                    result["one_request"] = one_request(collection.url, collection.stop_ids, options, sync_dir)
                    result["errands_iteration"] = iteration(collection, options.repeats)
                    result["update_beside_the_collection"] = beside(collection, options)
                else:
                    result["errands_iteration_english"] = iteration(collection, options.repeats)
            finally:
                collection.close()
                server.kill()
    text = json.dumps(result, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

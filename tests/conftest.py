"""Shared fixtures: a tiny prepared corpus and helpers to run the real CLI in a subprocess; the
session's own gptrun cache; and the hook that sorts every test into its tier."""

from __future__ import annotations

import dis
import functools
import importlib.util
import inspect
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from benchmarks.kill_anywhere import kill_sweep

REPO = Path(__file__).resolve().parents[1]
# One OpenBLAS thread in each test process, set before numpy and scipy load and read it (the one_thread
# fixture comes too late for that): scipy>=1.15's L-BFGS-B calls LAPACK at every step, and beside other
# work OpenBLAS's thread handoffs made tests/test_scaling_law.py ten times slower (scipy issue 22438).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
WORDS = (
    "the king queen speaks to a fool and lord of night day sword crown love death "
    "sweet good my thy thee doth hath shall not is was her his"
).split()


def synthetic_documents(n_docs: int = 120, seed: int = 0) -> list[str]:
    """Small English-like documents with enough structure for a tiny model to learn."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(8, 16)):
            speaker = rng.choice(("KING", "QUEEN", "FOOL", "LORD"))
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            lines.append(f"{speaker}: {words.capitalize()}.")
        docs.append("\n".join(lines))
    return docs


def run_cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m experiments ARGS` as a user would, capturing output (`stdin`: piped in)."""
    return subprocess.run(
        [sys.executable, "-m", "experiments", *args],
        cwd=cwd or REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, exactly one line on stderr, no traceback, and the line mentions each needle."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def study_trials(url: str, name: str) -> list[tuple[str, str]]:
    """(Tune trial id, Optuna state) of every trial of study `name`, read with plain SQL from its
    database (sqlite or a server), not through the code under test."""
    import sqlalchemy

    query = sqlalchemy.text(
        "select a.value_json, t.state from trials t join studies s on s.study_id = t.study_id "
        "join trial_user_attributes a on a.trial_id = t.trial_id "
        "where s.study_name = :name and a.key = 'tune_trial_id'"
    )
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as db:
            return [(json.loads(tid), str(state)) for tid, state in db.execute(query, {"name": name})]
    finally:
        engine.dispose()


def study_values(url: str, name: str) -> dict[str, tuple[str, float | None, dict[int, float]]]:
    """Tune trial id -> (Optuna state, value, {step: intermediate value}) of study `name`, read
    with plain SQL like `study_trials`."""
    import sqlalchemy

    trials = sqlalchemy.text(
        "select t.trial_id, a.value_json, t.state, v.value from trials t "
        "join studies s on s.study_id = t.study_id "
        "join trial_user_attributes a on a.trial_id = t.trial_id and a.key = 'tune_trial_id' "
        "left join trial_values v on v.trial_id = t.trial_id where s.study_name = :name"
    )
    steps = sqlalchemy.text("select trial_id, step, intermediate_value from trial_intermediate_values")
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as db:
            curves: dict[int, dict[int, float]] = {}
            for trial_id, step, value in db.execute(steps):
                curves.setdefault(trial_id, {})[step] = value
            return {
                json.loads(tid): (str(state), value, curves.get(trial_id, {}))
                for trial_id, tid, state, value in db.execute(trials, {"name": name})
            }
    finally:
        engine.dispose()


def load_local_module() -> Any:
    """cluster/local.py as a module (it is a script, not a package): its process helpers, and its
    argument checks without the shell wrapper's seconds of `import ray`."""
    spec = importlib.util.spec_from_file_location("gptrun_cluster_local", REPO / "cluster" / "local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (cluster/local.py's choice, one copy of it)."""
    return load_local_module().free_ports(n, set())


def saved_trials(exp_dir: Path) -> dict[str, tuple[str, float]]:
    """Trial id -> (status, step of its last result) as Tune last saved them for a resume, from
    the newest `experiment_state-*.json` (a file still being copied raises JSONDecodeError)."""
    files = sorted(exp_dir.glob("experiment_state-*.json"))
    if not files:
        return {}
    saved = {}
    for trial_json, meta_json in json.loads(files[-1].read_text())["trial_data"]:
        trial, meta = json.loads(trial_json), json.loads(meta_json)
        saved[trial["trial_id"]] = (trial["status"], (meta.get("last_result") or {}).get("step", 0.0))
    return saved


def kill_when(args: list[str], ready: Callable[[], bool], what: str) -> None:
    """Start a sweep driver and SIGKILL it (and the local Ray it started) once `ready()` holds.
    `ready` reads the files the driver writes while the driver is stopped (SIGSTOP), so that
    they cannot change between the check and the kill."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if driver.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the sweep {'ended' if driver.poll() is not None else 'timed out'} before {what}"
                )
            os.kill(driver.pid, signal.SIGSTOP)
            try:
                if ready():
                    break
            except (json.JSONDecodeError, pickle.UnpicklingError, EOFError):  # a file half copied
                pass
            os.kill(driver.pid, signal.SIGCONT)
            time.sleep(0.5)  # poll again
    finally:  # the driver and the local Ray it started, by id, all gone before a resume
        kill_sweep(driver)
        driver.wait(timeout=30)


def resume_checkpoints(states: Iterable[str]) -> dict[str, Any]:
    """{trial id: the checkpoint result (checkpoint and metrics) a resume continues it from} in
    Tune's saved experiment states (the texts of its `experiment_state-*.json`), for the trials
    that have one. A state caught while being replaced is skipped.

    That is the trial's checkpoint manager's latest checkpoint, not its last result: Tune
    registers a reported checkpoint after the result that carries it, and a state saved in
    between holds the new result with the previous checkpoint (resume continues from the latter)."""
    found = {}
    for text in states:
        try:
            trial_data = json.loads(text)["trial_data"]
        except (json.JSONDecodeError, KeyError):
            continue
        for _, runtime in trial_data:
            runtime = json.loads(runtime)
            manager = pickle.loads(bytes.fromhex(runtime["checkpoint_manager"]["value"]))
            if manager.latest_checkpoint_result:
                found[runtime["last_result"]["trial_id"]] = manager.latest_checkpoint_result
    return found


def mid_trial_checkpoints(states: Iterable[str], low: int, high: int) -> dict[str, int]:
    """{trial id: step} of the trials whose `resume_checkpoints` are at a step in [low, high)."""
    steps = {tid: int(result.metrics.get("step", 0)) for tid, result in resume_checkpoints(states).items()}
    return {tid: step for tid, step in steps.items() if low <= step < high}


def committed_step(run_dir: Path) -> int:
    """The step of the latest checkpoint Ray Train has committed for a run (0 if none yet).

    A `checkpoint_*` folder appears when a worker uploads it, before the controller registers it;
    only the controller's snapshot says what a restart or a rerun will resume from."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
        return 0
    latest = snapshot.get("latest_checkpoint_result") or {}
    return int(latest.get("metrics", {}).get("step", 0))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared data folder (vocab 384) from synthetic text, shared by the whole session."""
    from gptcore.prepare import prepare

    root = tmp_path_factory.mktemp("tiny_corpus")
    src = root / "corpus.txt"
    src.write_text("<|endoftext|>".join(synthetic_documents()), encoding="utf-8")
    out = root / "data"
    prepare(inputs=[str(src)], corpus=None, out=str(out), vocab_size=384, val_fraction=0.1, progress=False)
    return out


def tiny_config_text(data_dir: Path, out_dir: Path, **train: object) -> str:
    """An experiment TOML for a ~60k-parameter model on `tiny_data`, in fp32 and eager unless
    `train` says otherwise: `auto` would decide from what this machine measures."""
    train = {"precision": "fp32", "compile": False, **train}
    lines = [
        '[model]\npreset = "tiny"\nvocab_size = 384\nseq_len = 32',
        f'[data]\ndir = "{data_dir}"',
        "[optim]\nlr = 3e-3\nwarmup = 2\nweight_decay = 0.1",
        "[train]\nbatch_size = 4\nmax_steps = 12\neval_interval = 4\neval_tokens = 2048\n"
        f'log_interval = 4\ndevice = "cpu"\nout = "{out_dir}"',
    ]
    lines[-1] += "".join(f"\n{k} = {toml_value(v)}" for k, v in train.items())
    return "\n\n".join(lines) + "\n"


def toml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')


SWEEP = """
[sweep]
num_samples = {n}
seed = 3
reduction_factor = 3
grace_tokens = {grace}
{extra}

[sweep.space]
lr = {{ loguniform = [1e-5, 0.3] }}
weight_decay = {{ loguniform = [1e-3, 0.3], include_zero = true }}
warmup = {{ uniform = [0.0, 0.3] }}
"""


def write_sweep_config(
    tiny_data: Path, folder: Path, n: int, max_steps: int, sweep_keys: str = "", tail: str = ""
) -> Path:
    """`sweep_keys` go into [sweep]; `tail` (more tables) goes at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "sweep.toml"
    grace = 4 * 32 * max_steps // 4  # a quarter of the trial, in tokens
    text = (
        tiny_config_text(tiny_data, folder / "run", max_steps=max_steps)
        .replace("max_steps = 12\n", "")
        .replace("warmup = 2\n", "warmup = 0.1\n")
    )
    config.write_text(text + SWEEP.format(n=n, grace=grace, extra=sweep_keys) + tail)
    return config


@pytest.fixture(scope="session")
def finished_sweep(
    tiny_data: Path, tmp_path_factory: pytest.TempPathFactory, shared_ray: dict[str, str]
) -> Path:
    """A real 6-trial sweep (Optuna + ASHA on the shared Ray), run once through the CLI, then its 2
    best configs re-run with 2 new seeds each (`confirm_top`), all logged to MLflow (sqlite).
    Its output is kept in `sweep.log` beside the experiment folder."""
    folder = tmp_path_factory.mktemp("sweep")
    # One trial at a time: ASHA's decisions, and so the statuses, are the same on every run.
    config = write_sweep_config(
        tiny_data,
        folder,
        n=6,
        max_steps=24,
        sweep_keys="confirm_top = 2\nconfirm_seeds = 2\nmax_concurrent = 1",
        tail=f'\n[tracking]\nmlflow_uri = "sqlite:///{folder}/mlflow.db"\n',
    )
    storage = str(folder / "sweeps")
    args = ["sweep", str(config), "--name", "finished", "--storage", storage]
    proc = run_cli(*args, env=shared_ray, timeout=900)
    (folder / "sweep.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "best trial" in proc.stdout and "best.toml" in proc.stdout
    return folder / "sweeps" / "finished"


def chat_conversation(rng: random.Random) -> list[dict[str, str]]:
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    messages = [{"role": "user", "content": f"KING: {words(rng.randint(2, 5))}"}]
    messages.append({"role": "assistant", "content": f"QUEEN: {words(rng.randint(2, 6))}"})
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Answer as the queen."})
    return messages


def write_chat_jsonl(path: Path, n: int = 200, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"conversations": chat_conversation(rng)}) + "\n" for _ in range(n)))
    return path


@pytest.fixture(scope="session")
def chat_data(tiny_data, tmp_path_factory) -> Path:
    """An SFT data folder (`prepare --sft`) of 200 synthetic conversations, with tiny_data's tokenizer."""
    from gptcore.chat_data import prepare_sft

    root = tmp_path_factory.mktemp("chat")
    source = write_chat_jsonl(root / "chat.jsonl")
    out = root / "data"
    prepare_sft([source], None, tokenizer=tiny_data / "tokenizer.json", out=out, progress=False)
    return out


@pytest.fixture(scope="session")
def pretrained(tiny_data, tmp_path_factory) -> Path:
    """A checkpoint of the tiny model after a few pretraining steps (the base for SFT tests)."""
    from gptcore.checkpoint import save_checkpoint
    from gptcore.config import load_config
    from gptcore.train import Trainer

    root = tmp_path_factory.mktemp("pretrained")
    config = root / "exp.toml"
    config.write_text(tiny_config_text(tiny_data, root / "run"))
    trainer = Trainer(load_config(config, ["train.precision=fp32", "train.max_steps=8"]), log=None)
    trainer.fit()
    return save_checkpoint(root / "base.pt", trainer.state_dict())


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A gptrun cache of the session's own ($GPTRUN_CACHE_DIR: corpora, measured CPU peaks and
    bf16 speedups, compile costs, torch's compile cache), so that no test reads or writes the
    user's, and what one machine or an earlier run measured cannot change what a test does. Set
    in the environment, so the CLI's subprocesses, the Ray they start and its workers inherit it."""
    cache = tmp_path_factory.mktemp("gptrun-cache")
    saved = {name: os.environ.get(name) for name in ("GPTRUN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["GPTRUN_CACHE_DIR"] = str(cache)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # gptrun puts it in the cache above
    try:
        yield cache
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


LOCAL_SH = REPO / "cluster" / "local.sh"
NO_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def local_sh(*args: str, state: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """`cluster/local.sh ARGS --dir STATE`, without this process's Ray client settings."""
    env = {k: v for k, v in os.environ.items() if k not in NO_AUTH}
    # Node loss noticed in ~3 s instead of ~15-30 s (GCS health checks every 1 s, 3 misses).
    env.update(
        GPTRUN_PYTHON=sys.executable,
        RAY_health_check_period_ms="1000",
        RAY_health_check_failure_threshold="3",
        RAY_health_check_initial_delay_ms="1000",
    )
    return subprocess.run(
        [str(LOCAL_SH), *args, "--dir", str(state)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One Ray for the `ray` tier: a head node of `cluster/local.sh` (token auth, started once in
    about 6 s; `down` stops exactly what it started), and the environment that points a client at
    it. A CLI command that starts a Ray of its own pays about 8 s more than one that connects
    (19.7 s against 11.9 s for a 2-trial sweep here), and most of the tier's tests run one. One CPU
    more than the machine has, as a local sweep of DDP trials adds for their Tune processes. The
    `system` tier (kill tests, clusters) keeps a Ray of each test's own: what it checks is that
    Ray's life."""
    state = tmp_path_factory.mktemp("shared-ray") / "state"
    cpus = str((os.cpu_count() or 1) + 1)
    up = local_sh("up", "--nodes", "0", "--head-cpus", cpus, state=state)
    assert up.returncode == 0, up.stdout + up.stderr
    address = json.loads((state / "state.json").read_text())["address"]
    try:
        yield {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(state / "token")}
    finally:
        down = local_sh("down", state=state)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(autouse=True)
def ray_tier_on_the_shared_ray(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test of the `ray` tier runs its CLI commands on `shared_ray` (they inherit the
    environment); a fixture that runs a sweep for several tests asks for `shared_ray` itself."""
    if request.node.get_closest_marker("ray") is not None:
        for name, value in request.getfixturevalue("shared_ray").items():
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread per process, in this one and (OMP_NUM_THREADS) in the CLI's subprocesses,
    as gptrun's Ray trials and workers already have with one CPU each. The tests' models are tiny:
    a second thread saves little, and on a busy machine its waits at every op cost far more (the
    optimizer test took 13-45 s with two threads beside other work, 1 s with one). It also keeps
    float sums in one order on every machine."""
    import torch

    threads, saved = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


# Tiers, cheapest first. A test's tier is the most expensive thing it uses, read from its code, the
# code of its fixtures and of the helpers of this folder that these call, and its marks: nobody
# keeps a list of tests, a new test lands in its tier by itself.
TIERS = ("fast", "train", "ray", "system")
# The names whose use puts a test in a tier.
USES = {
    "Trainer": "train",  # gptcore's training loop, in this process
    "train_local": "train",
    "spawn": "train",  # torch.multiprocessing.spawn: DDP ranks on CPU
    "coord_check": "train",  # µP's coordinate check trains 96 small models
    "price_series": "train",  # `gptrun scale --plan` trains a few steps per width
    "train_on_ray": "ray",
    "ray_session": "ray",  # a Ray of the command's own (gptrun's `ray.init`)
    "SIGKILL": "system",  # kill-and-resume tests
    "kill_sweep": "system",  # the same, through benchmarks/kill_anywhere.py
    "benchmarks.kill_anywhere": "system",  # its harness (imported: the module's name is loaded)
    "LocalCluster": "system",  # cluster/local.sh's multi-node clusters
    "postgres_server": "system",
    "slurm_cluster": "system",
    "ThreadedMotoServer": "system",  # S3
}
# `gptrun` subcommands run in a subprocess (`run_cli(COMMAND, ...)` or `python -m experiments
# COMMAND ...`): `train` without `--local` runs on Ray; `doctor` compiles a function.
COMMANDS = {
    "sweep": "ray",
    "resume": "ray",
    "confirm": "ray",
    "scale": "ray",
    "train": "train",
    "sample": "train",
    "doctor": "train",
}
# The instructions that load a global, an attribute, a module or a name imported from one.
NAME_OPS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "IMPORT_NAME", "IMPORT_FROM"}
MARKS = {"slow": "system"}  # a mark set by hand that says at least this much
# pytest-timeout's bound by tier, for a test that sets none (pyproject's 900 s is the default).
TIMEOUTS = {"fast": 300, "train": 600, "ray": 1200, "system": 1800}


def in_tests(func: Any) -> bool:
    """Whether `func` is a function of this folder (not pytest's or a library's)."""
    code = getattr(func, "__code__", None)
    return code is not None and Path(code.co_filename).parent == REPO / "tests"


@functools.cache
def own_uses(code: types.CodeType) -> tuple[tuple[str, str], ...]:
    """What `code` and its nested functions load, in order, as ("name", name) and ("const",
    string) pairs (disassembled once per code object: most tests share helpers and fixtures)."""
    found: list[tuple[str, str]] = []
    for instruction in dis.get_instructions(code):
        value = instruction.argval
        if instruction.opname == "LOAD_CONST":
            strings = value if isinstance(value, tuple) else (value,)
            found += [("const", v) for v in strings if isinstance(v, str)]
        elif isinstance(value, str) and instruction.opname in NAME_OPS:
            found.append(("name", value))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += own_uses(const)
    return tuple(found)


def code_uses(code: types.CodeType, namespace: dict[str, Any], seen: set[int]) -> list[tuple[str, str]]:
    """`own_uses(code)`, then what the functions of this folder that it names in `namespace` (its
    module's globals) load, followed transitively."""
    found = list(own_uses(code))
    for kind, name in own_uses(code):
        helper = namespace.get(name) if kind == "name" else None
        helper = inspect.unwrap(helper) if callable(helper) else None
        if in_tests(helper) and id(helper.__code__) not in seen:
            seen.add(id(helper.__code__))
            found += code_uses(helper.__code__, helper.__globals__, seen)
    return found


def tier_of(functions: Iterable[Any], marks: Iterable[str] = ()) -> str:
    """The tier of a test made of `functions` (the test and its fixtures) and carrying `marks`."""
    seen: set[int] = set()
    uses = [use for f in functions if in_tests(f) for use in code_uses(f.__code__, f.__globals__, seen)]
    found = {"fast"} | {USES[name] for kind, name in uses if kind == "name" and name in USES}
    for before, (kind, value) in pairwise(uses):
        if before == ("name", "ray") and value == "init":  # a Ray of the test's own
            found.add("ray")
        if (
            before in (("name", "run_cli"), ("const", "experiments"))
            and kind == "const"
            and value in COMMANDS
        ):
            local = ("const", "--local") in uses
            found.add("ray" if value == "train" and not local else COMMANDS[value])
    found |= {MARKS[mark] for mark in marks if mark in MARKS}
    return max(found, key=TIERS.index)


def item_tier(item: pytest.Function) -> str:
    fixtures = [
        definition.func
        for name in item.fixturenames
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ())
    ]
    tier = tier_of([item.function, *fixtures], [mark.name for mark in item.iter_markers()])
    if "shared_ray" in item.fixturenames:  # a fixture on the shared Ray (a sweep run for many tests)
        tier = max(tier, "ray", key=TIERS.index)
    return tier


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier (`pytest -m fast`, ...; the marks are described in
    pyproject.toml)."""
    for item in items:
        if isinstance(item, pytest.Function):
            tier = item_tier(item)
            item.add_marker(tier)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUTS[tier]))

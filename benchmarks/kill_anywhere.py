"""Kill a sweep's driver at chosen or random moments, resume it after each kill, and count what
went wrong: trials lost, trials repeated, and trials on which the study and the report disagree.

Each kill is a SIGKILL of the driver and of the local Ray it started (its process group), at a
moment read from what the driver prints (right after a trial starts, ends, or is stopped by
ASHA; at the summary), when a new checkpoint folder appears on storage, or (`--kills N`) after a
random number of seconds. After each kill the harness notes what the study says has ended, and
each unfinished trial's newest checkpoint on storage; then `gptrun resume` runs (and may itself be
the next one killed). After a last resume that runs to the end it checks:

- lost: the study holds exactly `num_samples` trials of the sweep, each ended (none RUNNING, none
  FAIL for not having run), and the report lists each of them;
- repeated: no configuration asked twice; no ended trial's status or value changed by a resume;
  each interrupted trial continued from its newest checkpoint (its first report after the
  resume says `resumed_from` that step; under a new Tune trial where Tune never saved it); no
  (trial, step) twice in the curves; no end announced twice (events.jsonl and the console lines);
- disagreeing: a trial whose Optuna state and value differ from the report's status and loss.

    gptrun prepare --corpus shakespeare --out data/shakespeare
    python benchmarks/kill_anywhere.py --kills 30 [--storage sweeps-kill | s3://BUCKET/prefix]
    python benchmarks/kill_anywhere.py --cost 2    # what snapshotting every second costs

tests/test_sweep.py and tests/test_object_store.py run the same harness at chosen moments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# An end, as the driver announces it (experiments.events.TrialEvents.describe).
END_LINE = re.compile(r"^trial (\w+) (completed|ended after|cut by|failed|diverged|refused)")
QUICKSTART = [
    "sweep.num_samples=8",
    "train.max_steps=60",
    "train.eval_interval=10",
    "train.checkpoint_interval=10",
    "train.eval_tokens=4096",
]


@dataclass(frozen=True)
class Moment:
    """When to kill a driver: right after the `nth` line matching `line` (a regex), or once a new
    checkpoint folder is on storage (`checkpoint`), or once Tune's saved state holds `saved`
    trials that have reported, or `after_s` seconds after it started."""

    name: str
    line: str = ""
    nth: int = 1
    checkpoint: bool = False
    saved: int = 0
    after_s: float = 0.0


CHOSEN = (
    Moment("right after a trial starts", line=r"^trial \w+ started", nth=3),
    Moment("during a resume, as it restarts a trial", line=r"^trial \w+ started"),
    Moment("right after a trial ends", line=END_LINE.pattern),
    Moment("right after ASHA stops one", line=r"stopped early by ASHA"),
    Moment("during a checkpoint's upload", checkpoint=True),
    Moment("at the very end", line=r"^(best trial|no trial finished)"),
)


@dataclass
class Snapshot:
    """What the study and the storage held when a driver was killed."""

    moment: str
    ended: dict[int, tuple[str, float | None]]  # Optuna number -> (status, value)
    unfinished: dict[int, tuple[str, int, int]]  # number -> (tune id, newest checkpoint step, rows)


@dataclass
class Verdict:
    lost: list[str] = field(default_factory=list)
    repeated: list[str] = field(default_factory=list)
    disagreeing: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.repeated or self.disagreeing)

    def counts(self) -> str:
        return f"lost {len(self.lost)}, repeated {len(self.repeated)}, disagreeing {len(self.disagreeing)}"


class Sweep:
    """One sweep under test: its config, where it lives, and the drivers run on it."""

    def __init__(self, config: Path, storage: str, name: str, overrides: list[str], env: dict[str, str]):
        self.config, self.storage, self.name, self.overrides = config, storage.rstrip("/"), name, overrides
        self.env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        self.outputs: list[str] = []  # every driver's stdout + stderr
        self.snapshots: list[Snapshot] = []
        self.started = False

    @property
    def location(self) -> str:
        return f"{self.storage}/{self.name}"

    def command(self) -> list[str]:
        base = [sys.executable, "-m", "experiments"]
        if self.started:
            return [*base, "resume", self.location]
        args = [*base, "sweep", str(self.config), "--name", self.name, "--storage", self.storage, "--restart"]
        for item in self.overrides:
            args += ["--set", item]
        return args

    def run(self, moment: Moment | None, timeout: float = 900) -> bool:
        """Run the next driver (the sweep, then resumes) until `moment`, and kill it there; to
        the end if `moment` is None. Whether the moment came (or the driver ended well)."""
        driver = subprocess.Popen(
            self.command(),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.started = True
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(driver.stdout, lines), daemon=True).start()
        seen, matches, start = [], 0, time.monotonic()
        checkpoints = self.checkpoints() if moment and moment.checkpoint else set()
        hit = False
        try:
            while True:
                if time.monotonic() - start > timeout:
                    kill_sweep(driver)  # a hung driver too, with the Ray it started
                    raise TimeoutError(f"driver ran past {timeout} s: {''.join(seen[-20:])}")
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    line = ""
                if line is None:  # the driver ended
                    break
                seen.append(line)
                if moment is None:
                    continue
                if moment.line and line and re.search(moment.line, line):
                    matches += 1
                    hit = matches >= moment.nth
                elif moment.after_s:
                    hit = time.monotonic() - start >= moment.after_s
                elif moment.checkpoint:
                    hit = bool(self.checkpoints() - checkpoints)
                elif moment.saved:
                    hit = self.saved_reporting() >= moment.saved
                if hit:
                    kill_sweep(driver)
                    break
        finally:
            if driver.poll() is None and moment is not None:
                kill_sweep(driver)
            driver.wait(timeout=120)
            with contextlib.suppress(queue.Empty):  # what it printed before it died
                while (line := lines.get(timeout=5)) is not None:
                    seen.append(line)
            self.outputs.append("".join(seen))
        if moment is None:
            return driver.returncode == 0
        if hit:
            self.snapshots.append(self.snapshot(moment.name))
        return hit

    # -- what the storage and the study hold -----------------------------------------------------

    def fs(self) -> tuple[Any, str]:
        from pyarrow.fs import LocalFileSystem

        from experiments import remote

        if remote.is_uri(self.location):
            return remote.filesystem(self.location)
        return LocalFileSystem(), str(Path(self.location).resolve())

    def trial_folders(self) -> list[str]:
        from pyarrow.fs import FileSelector, FileType

        fs, root = self.fs()
        infos = fs.get_file_info(FileSelector(root, allow_not_found=True))
        return [i.path for i in infos if i.type == FileType.Directory and i.base_name.startswith("trial_")]

    def checkpoints(self) -> set[str]:
        """Every checkpoint file of every trial on storage."""
        from pyarrow.fs import FileSelector

        fs, _ = self.fs()
        return {
            info.path
            for folder in self.trial_folders()
            for info in fs.get_file_info(FileSelector(folder, recursive=True, allow_not_found=True))
            if info.base_name == "checkpoint.pt"
        }

    def saved_reporting(self) -> int:
        """How many trials Tune's saved state holds with a report (0 while that file is being
        written, or not there yet)."""
        from experiments.tune_state import read_tune_trials
        from gptcore.errors import UserError

        try:
            return sum(bool(t.last_result) for t in read_tune_trials(self.location))
        except (UserError, OSError):  # FileNotFoundError included
            return 0

    def rows(self) -> dict[str, list[dict[str, Any]]]:
        """Tune trial id -> every report in its result.json (a line cut short is left out)."""
        fs, _ = self.fs()
        out: dict[str, list[dict[str, Any]]] = {}
        for folder in self.trial_folders():
            with contextlib.suppress(FileNotFoundError, OSError):
                with fs.open_input_stream(f"{folder}/result.json") as f:
                    text = f.read().decode()
                out[folder.rsplit("trial_", 1)[1]] = [
                    json.loads(line) for line in text.splitlines() if _is_json(line)
                ]
        return out

    def newest_step(self, tune_id: str) -> int:
        """The step of the newest checkpoint of a trial on storage (0: none)."""
        from gptcore.checkpoint import load_checkpoint

        fs, _ = self.fs()
        mine = sorted(p for p in self.checkpoints() if f"/trial_{tune_id}/" in p)
        if not mine:
            return 0
        with tempfile.TemporaryDirectory() as tmp, fs.open_input_stream(mine[-1]) as f:
            (Path(tmp) / "checkpoint.pt").write_bytes(f.read())
            return int(load_checkpoint(Path(tmp) / "checkpoint.pt")["step"])

    def exp_dir(self) -> Path:
        from experiments import remote

        if remote.is_uri(self.location):
            return remote.working_copy(self.location)
        return Path(self.location).resolve()

    def study(self) -> Any:
        import optuna

        from experiments.experiment import load_base, study_url
        from experiments.study_db import rdb_storage

        cfg, _ = load_base(self.exp_dir())
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return optuna.load_study(study_name=self.name, storage=rdb_storage(study_url(cfg, self.exp_dir())))

    def snapshot(self, moment: str) -> Snapshot:
        from experiments.record import own_trials, record_of

        ended, unfinished = {}, {}
        rows = self.rows()
        try:
            trials = own_trials(self.study())
        except (KeyError, FileNotFoundError):  # killed before the study was made
            trials = []
        for trial in trials:
            record = record_of(trial)
            if record.ended:
                ended[record.number] = (record.status, trial.value)
            elif record.tune_id:
                rows_now = len(rows.get(record.tune_id, []))
                unfinished[record.number] = (record.tune_id, self.newest_step(record.tune_id), rows_now)
        return Snapshot(moment, ended, unfinished)

    # -- the invariants --------------------------------------------------------------------------

    def verdict(self, num_samples: int) -> Verdict:
        from experiments.outcome import RANKED, study_verdict
        from experiments.record import own_trials, record_of
        from experiments.results import load_curves, load_trials

        v = Verdict()
        trials = own_trials(self.study())
        records = {t.number: (t, record_of(t)) for t in trials}
        report = {t["trial_id"]: t for t in load_trials(self.exp_dir())}
        if len(trials) != num_samples:
            v.lost.append(f"the study holds {len(trials)} trials, not {num_samples}")
        for number, (_, record) in records.items():
            if not record.ended:
                v.lost.append(f"trial #{number} ({record.tune_id}) still RUNNING in the study")
            elif record.status == "error" and "not run" in record.final.get("reason", ""):
                v.lost.append(f"trial #{number} was never run")
            elif record.tune_id not in report:
                v.lost.append(f"trial #{number} ({record.tune_id}) missing from the report")
        params = [json.dumps(t.params, sort_keys=True) for t in trials]
        v.repeated += [
            f"configuration asked {params.count(p)} times: {p}" for p in set(params) if params.count(p) > 1
        ]
        for snap in self.snapshots:
            for number, before in snap.ended.items():
                trial, record = records.get(number, (None, None))
                now = (record.status, trial.value) if record else None
                if now != before and not (now and _same(now, before)):
                    v.repeated.append(
                        f"trial #{number} ended {before} before a kill {snap.moment}, now {now}"
                    )
        rows = self.rows()
        for k, snap in enumerate(self.snapshots):
            for number, (tune_id, step, n_rows) in snap.unfinished.items():
                record = records[number][1] if number in records else None
                if record is None:
                    continue  # counted as lost above
                if record.tune_id != tune_id:  # Tune never saved it: run again under a new Tune trial
                    chain = [*record.continues, record.tune_id]
                    after = chain[chain.index(tune_id) + 1] if tune_id in chain else record.tune_id
                    # Its rows up to the next kill that saw it under `after` (a run killed before
                    # it wrote a row says nothing; that kill's snapshot checks the run after it).
                    until = next(
                        (
                            s.unfinished[number][2]
                            for s in self.snapshots[k + 1 :]
                            if s.unfinished.get(number, ("",))[0] == after
                        ),
                        None,
                    )
                    later = [r for r in rows.get(after, [])[:until] if "resumed_from" in r]
                    if later and int(later[0]["resumed_from"]) != step:
                        v.repeated.append(
                            f"trial #{number} (killed {snap.moment}) ran again as {after} from step "
                            f"{int(later[0]['resumed_from'])}, its newest checkpoint was at {step}"
                        )
                    continue
                # The rows of the next run only: up to the trial's row count at the next kill
                # (a run killed before it wrote a row says nothing; the run after it is checked
                # against that kill's snapshot).
                until = next(
                    (s.unfinished[number][2] for s in self.snapshots[k + 1 :] if number in s.unfinished),
                    None,
                )
                later = [r for r in rows.get(tune_id, [])[n_rows:until] if "resumed_from" in r]
                if later and int(later[0]["resumed_from"]) != step:
                    v.repeated.append(
                        f"trial {tune_id} (killed {snap.moment}) resumed from step "
                        f"{int(later[0]['resumed_from'])}, its newest checkpoint was at {step}"
                    )
        curve_keys = [(c["trial_id"], c["step"]) for c in load_curves(self.exp_dir())]
        if len(curve_keys) != len(set(curve_keys)):
            v.repeated.append("a (trial, step) appears twice in the curves")
        from experiments.experiment import read_events

        ends = [e["trial_id"] for e in read_events(self.exp_dir()) if e["event"] in ("end", "error")]
        v.repeated += [
            f"trial {t} ended {ends.count(t)} times in events.jsonl" for t in set(ends) if ends.count(t) > 1
        ]
        said = [
            m.group(1) for out in self.outputs for line in out.splitlines() if (m := END_LINE.match(line))
        ]
        v.repeated += [
            f"trial {t}'s end announced {said.count(t)} times" for t in set(said) if said.count(t) > 1
        ]
        for _, record in records.values():
            t = report.get(record.tune_id)
            if t is None or not record.ended:
                continue
            trial = records[record.number][0]
            state, _ = study_verdict(t["status"], {"val_loss": 0.0})
            valued = t["status"] in RANKED  # diverged and refused: the penalty, not a loss to show
            if trial.state.name != state or (valued and not _close(trial.value, t["val_loss"])):
                v.disagreeing.append(
                    f"trial {record.tune_id}: study {trial.state.name} {trial.value}, "
                    f"report {t['status']} {t['val_loss']}"
                )
        return v


def _same(now: tuple[str, float | None], before: tuple[str, float | None]) -> bool:
    """The same end; a value of None before is an end whose Optuna state was not told yet."""
    return now[0] == before[0] and (before[1] is None or _close(now[1], before[1]))


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _pump(stream: Any, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def kill_sweep(driver: subprocess.Popen) -> None:
    """SIGKILL the driver and every process of the local Ray it started (its descendants, and
    whatever else is in its session: Ray's workers sit in process groups of their own), and wait
    until they are gone, so that what storage holds afterwards is what a resume will find."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = _descendants(driver.pid) | {p for p in _pids() if _stat(p)[1] == driver.pid}
        left = {p for p in left if _stat(p)[0] not in ("Z", "")}  # zombies hold nothing open
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    raise TimeoutError(f"processes of the killed sweep {driver.pid} are still alive")


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stat(pid: int) -> tuple[str, int, int]:
    """(state, session id, parent pid) of a process; ('', 0, 0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return "", 0, 0
    return fields[0], int(fields[3]), int(fields[1])


def _descendants(root: int) -> set[int]:
    parents = {pid: _stat(pid)[2] for pid in _pids()}
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier += children
    return found


def kill_and_resume(sweep: Sweep, moments: list[Moment]) -> list[str]:
    """Run `sweep`, killing a driver at each moment and resuming after it, then a last resume to
    the end. The moments that never came (the sweep ended first)."""
    missed = []
    for i, moment in enumerate(moments, 1):
        hit = sweep.run(moment)
        print(f"kill {i}/{len(moments)} {moment.name}: {'killed' if hit else 'not reached'}", flush=True)
        if not hit:
            missed.append(moment.name)
    if not sweep.run(None):
        raise RuntimeError(f"the last resume failed:\n{sweep.outputs[-1][-4000:]}")
    return missed


def snapshot_cost(config: Path, storage: str, overrides: list[str], rounds: int) -> None:
    """The demo sweep's wall-clock with Tune snapshotting every second (what gptrun sets) and at
    Tune's default period, alternated, same machine and run: what a second's worth of lost work
    on a kill costs when nothing is killed."""
    times: dict[str, list[float]] = {"1": [], "auto": []}
    for r in range(rounds):
        for period in times:
            sweep = Sweep(config, storage, f"cost-{period}", overrides, {"TUNE_GLOBAL_CHECKPOINT_S": period})
            start = time.monotonic()
            if not sweep.run(None):
                raise RuntimeError(sweep.outputs[-1][-3000:])
            times[period].append(time.monotonic() - start)
            print(f"round {r + 1}: TUNE_GLOBAL_CHECKPOINT_S={period}: {times[period][-1]:.1f} s", flush=True)
    every, default = (statistics.median(times[p]) for p in ("1", "auto"))
    print(
        f"median wall-clock: every 1 s {every:.1f} s, Tune's default {default:.1f} s: {every / default:.3f}x"
    )


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: where it is
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/configs/quickstart.toml")
    parser.add_argument("--storage", default="sweeps-kill", help="a folder or s3://BUCKET/prefix")
    parser.add_argument("--kills", type=int, default=0, help="random moments (0: the chosen ones)")
    parser.add_argument("--span", type=float, default=120.0, help="random kills fall in 5..SPAN s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument(
        "--cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="no kills: time the sweep "
        "with Tune snapshotting every second against its default period, ROUNDS times each",
    )
    args = parser.parse_args()
    overrides = QUICKSTART + args.overrides
    storage = args.storage if "://" in args.storage else str(Path(args.storage).resolve())
    if args.cost:
        snapshot_cost(Path(args.config).resolve(), storage, overrides, args.cost)
        return
    rng = random.Random(args.seed)
    moments = (
        [Moment(f"at {s:.1f} s", after_s=s) for s in (rng.uniform(5, args.span) for _ in range(args.kills))]
        if args.kills
        else list(CHOSEN)
    )
    sweep = Sweep(Path(args.config).resolve(), storage, "kill-anywhere", overrides, {})
    start = time.monotonic()
    missed = kill_and_resume(sweep, moments)
    num_samples = int(
        next(o for o in reversed(overrides) if o.startswith("sweep.num_samples=")).split("=")[1]
    )
    verdict = sweep.verdict(num_samples)
    print(
        f"{len(moments) - len(missed)} kills ({len(missed)} moments not reached), each followed by a resume"
    )
    print(f"{verdict.counts()}; {time.monotonic() - start:.0f} s in all")
    for problem in verdict.lost + verdict.repeated + verdict.disagreeing:
        print(f"  {problem}")
    sys.exit(0 if verdict.clean else 1)


if __name__ == "__main__":
    main()

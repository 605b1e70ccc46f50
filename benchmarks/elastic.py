"""How long does an elastic group take to train again after a host's loss or a host's arrival (issue 31)?

Elastic re-formation time: from a host's loss, or a host's arrival, to the group training again (issue 31).

    python -m benchmarks elastic [--repeats 5] [--seed 0] [--epochs 4] [--save-every 20] [--out FILE]
        [--scenarios loss,admission,node0,pair] [--keep DIR]

Runs the MNIST-1D MLP (``-m examples.mnist1d.train``, ``configs/mnist1d_mlp.yaml``, ``--epochs`` epochs of 4000
examples in global batches of 120, which 2 and 3 processes divide; a learning rate of 1e-3, a checkpoint every
``--save-every`` steps, a train record every 5) under launchers ``jddp launch --nnodes 2:3 --coordinator
127.0.0.1:PORT -n 1 --devices-per-process 1`` on loopback, one process of one device each: the first is started
alone and hosts the rendezvous (node 0, process 0: it writes the goodput ledgers); the others start once its port
+ 1 answers.

* ``loss``: three launchers; once the run is past a step drawn from ``--seed`` (printed, so a run can be replayed),
  one of the two launchers other than node 0 (drawn too) is SIGKILLed, its processes with it. Measured: from the
  kill to the first step of the next round (two nodes), and its parts: the loss noticed (node 0's launcher says so),
  the old round stopped (the launcher's ``JDDP_PREVIOUS_END``), the new round formed and started (its
  ``JDDP_ATTEMPT_START``), the processes' start (imports, ``initialize``, the model), the restore, and the first
  step (compilation). The run then finishes on two.
* ``node0``: three launchers; once the run is past a drawn step, node 0's launcher (the rendezvous and the
  coordination service) is SIGKILLed: the first coordinator candidate hosts round 1, the other joins it
  (``jddp.cli.launch.candidates``). Measured as ``loss``, the loss noticed by the successor ("node 0's rendezvous is
  gone"); the successor's process 0 continues the run's goodput ledger (node 0's ``JDDP_RUN_START``).
* ``pair``: two launchers of ``--nnodes 1:2``; once the run is past a drawn step and node 0's standby process for
  the round it would run alone is ready (compiled, waiting before its restore: ``jddp.cli.launch.elastic``'s
  ``round_ahead``), the other launcher is SIGKILLed. Measured as ``loss``; ``woken_from_standby`` says that round 1
  ran on the woken standby process.
* ``admission``: two launchers; once the run is past a drawn step, the third is started. Measured: from its
  launcher's start to the first step of the round that includes it, and the time the running group lost: from its
  last step of the old round to its first of the new one; the parts: the arrival noticed (node 0's launcher says
  so), the old round's steps up to the step every process agreed on, the preemption save and the processes' exit,
  then as above.

The times come from the goodput ledgers (``jddp.goodput``) and the launchers' output, read as it is written; each
sample also has the goodput records' time lost to the re-formation: the old attempt's ``recomputed_s``,
``lost_s`` and ``downtime_s`` and the new one's ``startup_s``, ``restore_s`` and ``compile_s`` (the JSON holds both
records' parts).

One unbroken run of three launchers comes first: the reference, which also fills a compilation cache
(``JDDP_COMPILATION_CACHE``) that every run then uses; the scenarios alternate, ``admission`` first, whose first
round (two processes) compiles what the ``loss`` scenario's second round runs, so every measured round finds its
programs in the cache (with ``--scenarios loss`` alone, the first run's second round compiles them). Each run is
checked: the launchers that were not killed exit 0, the membership history is the expected one, and the train losses
(``metrics.jsonl``, the last record of each step) equal the reference's to ``rtol=2e-5`` (the global batches do not
depend on the number of processes: the run that lost or gained a host is the run that did not); the largest relative
difference is printed. The learning rate is a third of the example's: at its 3e-3, this training turns float
round-off into differences past the tolerance, with no membership change (an unbroken run of three launchers against
one process of three devices: 3e-7 in the train record of step 35, 2.4e-4 in that of step 75); at 1e-3 the same two
runs differ by 4e-8 at most over the 132 steps (both measured on 26 Nov 2026, 2 CPU cores, load average 10). A run
that fails a check is named and left out of the figures, and the script then exits 1. Prints each scenario's median,
min and max of the total and of each part, and the load average before and after; writes every sample to ``--out``
(JSON) when given (the committed ``benchmarks/results/elastic.json`` is a record: it is never written unasked).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness
from jddp import goodput, net

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/mnist1d_mlp.yaml"  # the launchers run in ROOT
OUT = ROOT / "benchmarks" / "results" / "elastic.json"
TRAIN_EXAMPLES, GLOBAL_BATCH = 4000, 120  # 80% of the example's 5000; 120 = 2 * 60 = 3 * 40 per step
RTOL = 2e-5
RUN_TIMEOUT_S = 900.0
LOST = "is lost:"  # node 0's launcher's lines (jddp.cli.launch.elastic)
WAITING = "waiting to join: ending round"
HOSTS = "hosts the rendezvous"
NODE0_GONE = "node 0's rendezvous is gone"  # the other launchers' line (jddp.cli.launch.member)
SUCCEEDS = "this launcher is node 0 from round 1 on"  # the successor's (jddp.cli.launch.elastic)
LOSSES = ("loss", "node0", "pair")  # the scenarios that SIGKILL a launcher
PAIR = "pair"  # two launchers of --nnodes 1:2: node 0's next processes stand by for the round it runs alone
STANDBY_READY = "standby process(es) of the next attempt ready"  # node 0's line (jddp.cli.launch.spares)
WOKEN = "woken from standby"
HISTORY = {
    "reference": "membership history: round 0: 3 node(s), 3 process(es) (the first round)\n",
    "loss": "round 0: 3 node(s), 3 process(es) (the first round); round 1: 2 node(s), 2 process(es) (a node lost)\n",
    "admission": "round 0: 2 node(s), 2 process(es) (the first round); "
    "round 1: 3 node(s), 3 process(es) (admitting a node)\n",
    "node0": "membership history: round 1: 2 node(s), 2 process(es) (node 0 lost)\n",  # the successor's rounds
    PAIR: "round 0: 2 node(s), 2 process(es) (the first round); round 1: 1 node(s), 1 process(es) (a node lost)\n",
}


class Launcher:
    """One ``jddp launch --nnodes 2:3`` (or ``nnodes``) of the example; its output lines kept with the time each was
    read."""

    def __init__(self, name: str, port: int, env: dict[str, str], overrides: list[str], nnodes: str = "2:3") -> None:
        self.name = name
        argv = [
            sys.executable, "-m", "jddp.launch", "--nnodes", nnodes, "--coordinator", f"127.0.0.1:{port}", "-n", "1",
            "--devices-per-process", "1", "--join-wait", "3", "-m", "examples.mnist1d.train", *overrides,
        ]  # fmt: skip
        self.started = time.time()
        self.popen = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append((time.time(), line))

    def said(self, text: str) -> float | None:
        """When the first line holding ``text`` was read (None: not yet)."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def tail(self, n: int = 25) -> str:
        return "".join(line for _, line in self.lines[-n:])


def train_losses(metrics: Path) -> dict[int, float]:
    """The train loss of each step in ``metrics.jsonl``: a step logged again (after a restore) by its last record."""
    losses = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            losses[int(record["step"])] = float(record["loss"])
    return losses


def max_rel_diff(mine: dict[int, float], reference: dict[int, float]) -> float:
    """The largest ``|mine - reference| / |reference|`` over the reference's steps (inf when the steps differ)."""
    if sorted(mine) != sorted(reference):
        return float("inf")
    return max((abs(mine[s] - r) / abs(r) for s, r in reference.items()), default=0.0)


def goodput_records(metrics: Path) -> dict[int, dict]:
    """The ``goodput`` records of ``metrics.jsonl`` by attempt."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {int(r["attempt"]): r for r in records if r.get("split") == "goodput"}


def one_run(
    scenario: str, cache_dir: str, step: int, victim: int, settings: list[str], keep: Path | None = None
) -> dict | None:
    """One run of ``scenario`` (``reference``, ``loss`` or ``admission``), its event after ``step``; launcher
    ``victim`` (1 or 2, in start order) is the one killed; its files in ``keep`` when given. Returns the sample
    (None: the run failed a check, said)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) if keep is None else keep
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JDDP_COMPILATION_CACHE": cache_dir}
        env.pop("XLA_FLAGS", None)
        overrides = [*settings, f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt"]
        port = net.free_port()
        nnodes = "1:2" if scenario == PAIR else "2:3"
        launchers = [Launcher("a", port, env, overrides, nnodes)]
        event_at = None
        try:
            deadline = time.monotonic() + 120
            while not net.answers("127.0.0.1", port + 1) and launchers[0].popen.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            for name in "b" if scenario in ("admission", PAIR) else "bc":
                launchers.append(Launcher(name, port, env, overrides, nnodes))
            if scenario != "reference":
                event_at = await_step_then(scenario, launchers, run_dir, step, victim, port, env, overrides)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for launcher in launchers:
                try:
                    launcher.popen.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for launcher in launchers:
                if launcher.popen.poll() is None:
                    launcher.popen.kill()
                    launcher.popen.wait(30)
                launcher.reader.join(10)
                if keep is not None:
                    (keep / f"launcher-{launcher.name}.txt").write_text("".join(line for _, line in launcher.lines))
        return check_and_measure(scenario, launchers, run_dir, event_at, victim)


def await_step_then(
    scenario: str,
    launchers: list[Launcher],
    run_dir: Path,
    step: int,
    victim: int,
    port: int,
    env: dict[str, str],
    overrides: list[str],
) -> float | None:
    """Waits until round 0 is past ``step``; then kills launcher ``victim`` (``loss``) or starts the third
    (``admission``). Returns the time it did (None: the run ended first)."""
    processes = 3 if scenario in ("loss", "node0") else 2
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while launchers[0].popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        ledgers = sorted((run_dir / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
        if len(ledgers) != 1:
            if len(ledgers) > 1:
                return None  # round 0 ended before the step: a failure, named by the checks
            continue
        try:
            ledger = goodput.read(ledgers[0])
        except ValueError:  # being written
            continue
        if scenario == PAIR and launchers[0].said(STANDBY_READY) is None:
            continue  # the question: a loss once node 0's standby process is ready
        if ledger["last_step"] >= step and ledger["processes"] == processes:
            if scenario in LOSSES:
                launchers[victim].popen.send_signal(signal.SIGKILL)
                return time.time()
            launchers.append(Launcher("c", port, env, overrides))
            return launchers[-1].started
    return None


def check_and_measure(
    scenario: str, launchers: list[Launcher], run_dir: Path, event_at: float | None, victim: int
) -> dict | None:
    """The run's checks (exit codes, the rounds, the ledgers) and its times; None, said, when a check fails."""
    a = first = launchers[0]
    if scenario == "node0":  # node 0 from round 1 on: the first candidate, which succeeded the killed one
        a = next((launcher for launcher in launchers[1:] if launcher.said(SUCCEEDS) is not None), launchers[1])
    codes = [launcher.popen.returncode for launcher in launchers]
    expected = [0] * len(launchers)
    if scenario in LOSSES:
        expected[victim] = -signal.SIGKILL
    history = next((line for _, line in a.lines if "membership history:" in line), "")
    ledgers = sorted((run_dir / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
    wrong = (
        f"exit codes {codes}, expected {expected}"
        if codes != expected
        else "the first launcher did not host the rendezvous"
        if first.said(HOSTS) is None
        else "no launcher succeeded node 0"
        if scenario == "node0" and a.said(SUCCEEDS) is None
        else f"membership {history.strip()!r}"
        if not history.endswith(HISTORY[scenario])
        else f"{len(ledgers)} goodput ledger(s)"
        if len(ledgers) != (1 if scenario == "reference" else 2) or (scenario != "reference" and event_at is None)
        else None
    )
    if wrong is not None:
        said = "\n".join(f"  --- launcher {launcher.name}:\n{launcher.tail()}" for launcher in launchers)
        print(f"  {scenario}: the run failed a check: {wrong}\n{said}", flush=True)
        return None
    metrics = run_dir / "log" / "metrics.jsonl"
    losses = train_losses(metrics)
    if scenario == "reference":
        only = goodput.read(ledgers[0])
        return {"losses": losses, "first_step_s": only["first_step_end"] - only["attempt_start"]}
    assert event_at is not None
    old, new = goodput.read(ledgers[0]), goodput.read(ledgers[1])
    if new["first_step_end"] < event_at:  # no step left for round 1 (``pair``: the standby was ready too late)
        print(f"  {scenario}: the event came after the run's last step (step {old['last_step']}): raise --epochs")
        return None
    records = goodput_records(metrics)
    lost = sum(records[0][k] for k in ("recomputed_s", "lost_s", "downtime_s")) if 0 in records else 0.0
    lost += sum(records[1][k] for k in ("startup_s", "restore_s", "compile_s"))
    noticed = a.said({"loss": LOST, PAIR: LOST, "node0": NODE0_GONE}.get(scenario, WAITING))
    if noticed is None:
        print(f"  {scenario}: node 0's launcher never said it noticed:\n{a.tail()}", flush=True)
        return None
    tail = {
        "reform_s": new["attempt_start"] - new["previous_end"],
        "startup_s": new["fit_start"] - new["attempt_start"],
        "restore_s": new["restore_s"],
        "first_step_s": new["first_step_end"] - new["fit_start"] - new["restore_s"],
    }
    if scenario in LOSSES:
        sample = {
            "kill_to_first_step_s": new["first_step_end"] - event_at,
            "noticed_s": noticed - event_at,
            "stop_s": new["previous_end"] - noticed,
            **tail,
        }
    else:
        sample = {
            "join_to_first_step_s": new["first_step_end"] - event_at,
            "group_lost_s": new["first_step_end"] - old["last_update"],
            "noticed_s": noticed - event_at,
            "to_agreed_step_s": old["last_update"] - noticed,
            "save_and_stop_s": new["previous_end"] - old["last_update"],
            **tail,
        }
    return {
        **sample,
        "goodput_lost_s": lost,
        "redone_steps": old["last_step"] - new["first_step"],
        "event_after_step": old["last_step"],
        "restored_step": new["first_step"],
        "restored_from": goodput.RESTORED_FROM[int(new["restored_from"])],
        "woken_from_standby": a.said(WOKEN) is not None,
        "losses": losses,
        "goodput": {
            which: {k: records[i][k] for k in (*goodput.PARTS, "round", "nodes", "processes")}
            for i, which in enumerate(("old", "new"))
            if i in records
        },
    }


def shown(key: str, value: object) -> str:
    """A sample's value as printed."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.2e}" if key == "max_rel_diff" else f"{value:.2f}"


def summary(results: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """Prints each scenario's median, min and max of every time; returns them."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for scenario, rows in results.items():
        if not rows:
            continue
        keys = [k for k, v in rows[0].items() if k.endswith("_s") and isinstance(v, float)]
        out[scenario] = {}
        print(f"{scenario} ({len(rows)} run(s)), seconds:")
        print(f"  {'':<24}{'median':>8}{'min':>8}{'max':>8}")
        for k in keys:
            values = [r[k] for r in rows]
            out[scenario][k] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            print(f"  {k:<24}" + "".join(f"{out[scenario][k][s]:>8.2f}" for s in ("median", "min", "max")))
    return out


# --quick: a small size; 3 epochs (99 steps) so that node 0's standby process of ``pair`` is ready before the end
QUICK: dict[str, Any] = {"repeats": 1, "epochs": 3, "save_every": 5, "scenarios": "loss"}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each scenario, interleaved")
    parser.add_argument("--seed", type=int, default=0, help="draws the step of each event and the killed launcher")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument(
        "--scenarios", default="loss,admission,node0,pair", help="comma-separated: loss, admission, node0, pair"
    )
    parser.add_argument("--keep", help="keep each run's files (logs, checkpoints, launchers' output) in this folder")
    parser.add_argument("--out", default=None, help=f"the JSON of every sample (e.g. {OUT.relative_to(ROOT)})")
    return parser


def bench(args: argparse.Namespace) -> Any:
    steps = args.epochs * (TRAIN_EXAMPLES // GLOBAL_BATCH)
    for name, value in (("repeats", args.repeats), ("epochs", args.epochs), ("save-every", args.save_every)):
        if value < 1:
            get_args_parser().error(f"--{name} must be at least 1, got --{name}={value}")
    first, last = args.save_every + 1, steps // 2  # past the first checkpoint, half the run left
    if first > last:
        get_args_parser().error(
            f"--save-every={args.save_every} leaves no step past the first checkpoint in the first half of the "
            f"{steps} steps of --epochs={args.epochs}: raise --epochs or lower --save-every"
        )
    settings = [
        f"config={CONFIG}", f"epochs={args.epochs}", f"global_batch_size={GLOBAL_BATCH}", "learning_rate=1e-3",
        "log_every=5", f"save_every={args.save_every}", "progress=false",
    ]  # fmt: skip
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    if not scenarios or any(s not in HISTORY or s == "reference" for s in scenarios):
        get_args_parser().error(
            f"--scenarios must name loss, admission, node0 and/or {PAIR}, comma-separated; got "
            f"--scenarios={args.scenarios}"
        )
    keep = None if args.keep is None else Path(args.keep)
    if keep is not None and keep.exists() and any(keep.iterdir()):
        get_args_parser().error(f"--keep={args.keep} is not empty: name a new or empty folder")
    rng = random.Random(args.seed)
    load_before = os.getloadavg()
    print(
        f"elastic benchmark: seed {args.seed}, {args.repeats} run(s) per scenario, {steps} steps, events drawn in "
        f"steps {first} to {last}; load before {' '.join(f'{x:.2f}' for x in load_before)}",
        flush=True,
    )
    results: dict[str, list[dict]] = {scenario: [] for scenario in scenarios}
    failed = 0
    with tempfile.TemporaryDirectory() as cache_dir:
        folder = lambda name: None if keep is None else keep / name
        reference = one_run("reference", cache_dir, 0, 0, settings, folder("reference"))
        if reference is None:
            sys.exit("the unbroken reference run failed: nothing to compare with")
        losses = reference.pop("losses")
        print(f"  reference: 3 launchers, unbroken: start to first step {reference['first_step_s']:.2f} s", flush=True)
        for i in range(args.repeats):
            draws = {"loss": (rng.randint(first, last), rng.randint(1, 2)), "admission": (rng.randint(first, last), 0)}
            draws["node0"] = (rng.randint(first, last), 0)  # drawn after the others: their draws stay as they were
            draws[PAIR] = (rng.randint(first, last), 1)
            for scenario in sorted(scenarios, reverse=i % 2 == 1):  # admission first, then alternately
                step, victim = draws[scenario]
                r = one_run(scenario, cache_dir, step, victim, settings, folder(f"{scenario}-{i}"))
                if r is None:
                    failed += 1
                    continue
                r["max_rel_diff"] = max_rel_diff(r.pop("losses"), losses)
                r.update(drawn_step=step, **({"killed_launcher": "abc"[victim]} if scenario in LOSSES else {}))
                event = f"kill launcher {'abc'[victim]}" if scenario in LOSSES else "start the third launcher"
                print(
                    f"  {scenario}: {event} at step {step} or after: "
                    + ", ".join(f"{k} {shown(k, v)}" for k, v in r.items() if k != "goodput"),
                    flush=True,
                )
                if not r["max_rel_diff"] <= RTOL:
                    print(
                        f"  {scenario}: the train losses differ from the reference's: largest relative difference "
                        f"{r['max_rel_diff']:.2e}, beyond rtol={RTOL}",
                        flush=True,
                    )
                    failed += 1
                    continue
                results[scenario].append(r)
    load_after = os.getloadavg()
    figures = summary(results)
    diffs = [r["max_rel_diff"] for rows in results.values() for r in rows]
    if diffs:
        print(f"train losses against the unbroken run's: largest relative difference {max(diffs):.2e} (rtol {RTOL})")
    print(f"load before {' '.join(f'{x:.2f}' for x in load_before)}, after {' '.join(f'{x:.2f}' for x in load_after)}")
    out = {
        "measured": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "keep")},  # no path of this machine
        "settings": settings,
        "load_before": load_before,
        "load_after": load_after,
        "reference": reference,
        "samples": results,
        "summary": figures,
        "failed_runs": failed,
    }
    if args.out is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    if failed:
        sys.exit(f"{failed} run(s) failed a check (named above)")
    return out


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()

"""Runs the semantic mutants of tests/semantic_mutants.py: each one's tests, in a fresh pytest process, with it applied.

    python tools/semantic_mutants.py                  # every mutant
    python tools/semantic_mutants.py NAME [NAME ...]  # these
    python tools/semantic_mutants.py --list           # names, guarantees, tests
    python tools/semantic_mutants.py --markdown       # the table for the docs, after the run

A mutant is killed when at least one of its tests fails (or the process crashes or hangs past --timeout); it
survives when they all pass. The mutant is applied by the plugin ``-p tests.semantic_mutants`` from
``$JDDP_SEMANTIC_MUTANT`` at ``pytest_configure``, before any program is traced. Exits 1 if a mutant survived
or its tests could not run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import semantic_mutants as registry  # noqa: E402


def run(mutant: registry.Mutant, timeout: float) -> tuple[str, str, float]:
    """``(verdict, detail, seconds)``: verdict killed, survived, skipped or error."""
    if mutant.needs and importlib.util.find_spec(mutant.needs) is None:
        return "skipped", f"needs {mutant.needs}", 0.0
    command = [
        sys.executable, "-m", "pytest", "-p", "tests.semantic_mutants", "-o", "addopts=", "-p", "no:cacheprovider",
        "-x", "-q", "-rfEs", *mutant.tests,
    ]  # fmt: skip
    env = {**os.environ, registry.ENV: mutant.name}
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed", f"timeout after {timeout:.0f} s (a hang)", time.monotonic() - start
    seconds = time.monotonic() - start
    out = done.stdout + done.stderr
    if "semantic mutant applied: " + mutant.name not in out:
        return "error", "the plugin did not report the mutant applied:\n" + out[-3000:], seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
    if done.returncode == 0:
        if re.search(r"\b\d+ passed", out) is None:
            return "error", "no test ran (all skipped?):\n" + out[-1500:], seconds
        return "survived", "all its tests passed", seconds
    if done.returncode == 1 and failed:
        return "killed", failed[0], seconds
    if done.returncode in (2, 3, 4, 5):
        return "error", f"pytest exit {done.returncode}:\n" + out[-3000:], seconds
    return "killed", f"crash (exit {done.returncode})", seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant before it counts as a hang")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    args = parser.parse_args(argv)
    mutants = [registry.by_name(n) for n in args.names] if args.names else list(registry.MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name}\n  breaks ({m.doc}): {m.quote}\n  bug: {m.bug}\n  tests: {', '.join(m.tests)}")
        return 0
    results = []
    total = time.monotonic()
    for m in mutants:
        verdict, detail, seconds = run(m, args.timeout)
        results.append((m, verdict, detail))
        first = detail.splitlines()[0] if detail else ""
        print(f"{verdict.upper():9} {m.name:40} {seconds:6.1f} s  {first}", flush=True)
        if verdict == "error":
            print(detail, flush=True)
    verdicts = [verdict for _, verdict, _ in results]
    counts = {v: verdicts.count(v) for v in ("killed", "survived", "skipped", "error")}
    print(f"\n{len(results)} mutants: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
          + f" ({time.monotonic() - total:.0f} s)")  # fmt: skip
    if args.markdown:
        print("\n| mutant | breaks | verdict | killing test |\n|---|---|---|---|")
        for m, verdict, detail in results:
            print(f'| `{m.name}`: {m.bug} | {m.doc}: "{m.quote}" | {verdict} | `{detail.splitlines()[0]}` |')
    return 1 if counts["survived"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Prints what the generated boundary tests cover: public callables, their parameters and generated calls
(tests/test_api_boundary.py), ``jddp`` command options and ``JDDP_*`` variables (tests/test_env_boundary.py), and
the acceptance tables, so that the figures quoted in notes and docs come from the tests themselves.

    python tools/boundary_counts.py             # counts and the acceptance table (markdown)
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from jddp import envvars
    from tests import test_api_boundary as api
    from tests import test_env_boundary as env

    os.chdir(tempfile.mkdtemp(prefix="jddp-boundary-"))  # a relative path taken by mistake lands here
    ctx = api.Ctx(Path.cwd())
    kinds: Counter[str] = Counter()
    params = 0
    for name in api.CALLED:
        params += len(api.parameters(api.CALLABLES[name]))
        kinds.update(kind for _, kind, _ in api.cases_of(ctx, name))
    options = env.options()
    print(f"public callables: {len(api.CALLABLES)} ({len(api.CALLED)} called, {len(api.NOT_CALLED)} types not called)")
    print(f"parameters: {params}; generated calls: {sum(kinds.values())} (+ hypothesis draws)")
    print(f"still pending: {len(api.PENDING)}; killing the process: {len(api.KILLS_THE_PROCESS)}")
    print(f"jddp command options: {len(options)} ({len(env.CHECKED)} numeric, boolean or choice, checked)")
    print(f"JDDP_* variables: {len(envvars.VARIABLES)}")
    print("\ngenerated calls by kind of wrong value:")
    for kind, n in kinds.most_common():
        print(f"  {kind:24} {n}")
    print("\n| callable | parameter | value | why it is accepted |\n|---|---|---|---|")
    for (name, param, kind), why in api.ACCEPTED.items():
        print(f"| {name} | {param} | {kind} | {why} |")


if __name__ == "__main__":
    main()

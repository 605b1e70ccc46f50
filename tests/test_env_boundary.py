"""Every ``JDDP_*`` variable and every numeric or boolean option of the ``jddp`` commands refuses a wrong value with
a message naming it, or takes it with its documented meaning (``jddp.envvars``).

The cases are generated: the variables from the source and ``envvars.VARIABLES``, the options by walking every
argparse parser that a module of ``jddp`` builds. A variable or an option added later is covered without a line
here. No JAX process is started.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jddp import envvars, net
from jddp.runtime import cluster_env
from tests import multiprocess

PACKAGE = multiprocess.ROOT / "jddp"
NAME = re.compile(r"\bJDDP_[A-Z0-9_]+")
# The family of wrong values every variable and option gets, whatever its type.
WRONG = ("False", "false", "no", "off", "0", "", "nan", "NaN", "inf", "-inf", "-1", "-0.5", "abc", "1e400", "5.0")
WRONG += (" ", "\t", " 7 ", "0x10", "1_0", "yes please", "truee", "2 3", "-", "+", ".", "1e-400")
READS = ("get", "pop", "getenv")  # os.environ.get / .pop (its value used) / os.getenv
# Reads of a JDDP_* variable not yet through envvars (none: jddp/engine/transport.py reads JDDP_TRANSPORT as
# envvars.get(ENV_TRANSPORT)).
NOT_YET_ROUTED: set[tuple[str, str]] = set()


# ----------------------------------------------------------------- (a) every variable of the source is declared


def names_in(paths) -> set[str]:
    """Every ``JDDP_*`` name in ``paths``; one ending in ``_`` is a prefix in prose (``JDDP_STALL_*``)."""
    return {m.group() for path in paths for m in NAME.finditer(Path(path).read_text())}


def undeclared(names: set[str]) -> list[str]:
    missing = [n for n in names if not n.endswith("_") and n not in envvars.VARIABLES]
    prefixes = [n for n in names if n.endswith("_") and not any(v.startswith(n) for v in envvars.VARIABLES)]
    return sorted(missing + prefixes)


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_jddp_variable_in_the_source_is_declared():
    names = names_in(sources())
    assert len(names) >= 20, names  # the scan sees the source
    assert not undeclared(names), (
        f"JDDP_* names read or set in jddp/ but not declared in jddp.envvars: {undeclared(names)}"
    )


def test_the_scan_sees_a_new_variable(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('import os\nos.environ.get("JDDP_SOMETHING_NEW")\n# and JDDP_NOTHING_*\n')
    assert undeclared(names_in([probe])) == ["JDDP_NOTHING_", "JDDP_SOMETHING_NEW"]


def unrouted_reads(path: Path) -> list[str]:
    """The ``JDDP_*`` variables ``path`` reads from ``os.environ`` itself instead of through ``envvars``: calls of
    ``environ.get``/``getenv``, ``environ.pop`` whose value is used, ``environ[...]`` and ``in environ``, with the
    name spelled there or in a module-level constant."""
    tree = ast.parse(path.read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }

    def name_of(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else constants.get(getattr(node, "id", ""))
        return value if isinstance(value, str) and value.startswith("JDDP_") else None

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or getattr(node, "id", "") == "environ"

    discarded = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            environ_call = func.attr in ("get", "pop") and is_environ(func.value)
            if (environ_call or func.attr == "getenv") and not (func.attr == "pop" and id(node) in discarded):
                found.append(name_of(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            found.append(name_of(node.slice))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.append(name_of(node.left))
    return sorted(n for n in found if n is not None)


def test_every_read_of_a_jddp_variable_goes_through_envvars():
    reads = {
        (str(path.relative_to(multiprocess.ROOT)), name)
        for path in sources()
        if path.name != "envvars.py"
        for name in unrouted_reads(path)
    }
    assert reads - NOT_YET_ROUTED == set(), "read from os.environ without jddp.envvars (its types and checks)"
    assert NOT_YET_ROUTED <= reads, f"routed now: drop {NOT_YET_ROUTED - reads} from NOT_YET_ROUTED"


def test_the_read_check_sees_a_read_that_bypasses_envvars(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        'import os\nENV = "JDDP_A"\nos.environ.get(ENV)\nx = os.environ["JDDP_B"]\nos.getenv("JDDP_C")\n'
        'y = "JDDP_D" in os.environ\nz = os.environ.pop("JDDP_E", None)\nos.environ.pop("JDDP_F", None)\n'
        'os.environ["JDDP_G"] = "1"\nos.environ.get("HOME")\n'
    )
    assert unrouted_reads(probe) == ["JDDP_A", "JDDP_B", "JDDP_C", "JDDP_D", "JDDP_E"]


# ----------------------------------------------------------------- (b) each variable: wrong values, by its type


def documented(variable: envvars.Variable, text: str, value) -> None:
    """Asserts that ``value``, which ``parse`` returned for ``text``, is what the declaration documents."""
    word = text.strip()
    if not word:
        assert value == variable.default, (variable.name, text, value)
        return
    lowered = word.lower()
    if variable.kind == "bool":
        assert value is (lowered in envvars.TRUE) and lowered in envvars.TRUE + envvars.FALSE, (text, value)
    elif variable.kind == "int":
        assert type(value) is int and value >= variable.minimum and value == int(word), (text, value)
    elif variable.kind == "float":
        assert type(value) is float and math.isfinite(value) and value > 0 and value == float(word), (text, value)
    elif variable.kind == "choice":
        assert value in variable.choices and value == lowered, (text, value)
    elif variable.kind == "address":
        assert value == word and net.split_address(value), (text, value)
    elif variable.kind == "cache":
        expected = True if lowered in envvars.TRUE else False if lowered in envvars.FALSE else word
        assert value == expected and type(value) is type(expected), (text, value)
    elif variable.kind == "path":
        assert value == word and lowered not in envvars.TRUE + envvars.FALSE, (text, value)
    elif variable.kind == "json":
        assert isinstance(value, dict) and value == json.loads(word), (text, value)
    elif variable.kind == "ids":
        assert value == tuple(part.strip() for part in word.split(",")) and all(value), (text, value)
    else:
        raise AssertionError(f"{variable.name}: a kind {variable.kind!r} this test does not know; describe it here")


def check_variable(name: str, text: str) -> None:
    variable = envvars.VARIABLES[name]
    try:
        value = envvars.parse(name, text)
    except ValueError as error:
        message = str(error)
        assert message.startswith(f"${name}={text!r} must be "), message  # the variable and what arrived
        assert f"e.g. {name}=" in message, message  # how to fix it
        assert envvars.parse(name, variable.example()) is not None or variable.default is None  # the fix is valid
        return
    documented(variable, text, value)


@pytest.mark.parametrize("name", sorted(envvars.VARIABLES))
def test_each_variable_refuses_wrong_values_naming_itself_or_takes_them_as_documented(name):
    variable = envvars.VARIABLES[name]
    assert variable.doc and variable.kind, variable
    for text in WRONG:
        check_variable(name, text)
    check_variable(name, variable.example())
    documented(variable, variable.example(), envvars.parse(name, variable.example()))  # its example is valid
    if variable.kind in ("int", "float"):  # meaningless numbers are refused, never taken
        for text in ("nan", "inf", "1e400", "-1", "abc", "5.0" if variable.kind == "int" else "0"):
            with pytest.raises(ValueError, match=re.escape(f"${name}=")):
                envvars.parse(name, text)
    if variable.kind == "bool":
        for text in ("False", "no", "0", "OFF", " false "):
            assert envvars.parse(name, text) is False, text
        for text in ("True", "yes", "1", "On"):
            assert envvars.parse(name, text) is True, text
        with pytest.raises(ValueError, match=r"1/0, true/false, yes/no or on/off"):
            envvars.parse(name, "abc")


texts = st.one_of(
    st.sampled_from(WRONG),
    st.text(max_size=12),
    st.from_regex(r"\A\s?[-+]?(\d{0,4}|nan|inf)(\.\d{0,3})?(e[-+]?\d{1,4})?\s?\Z"),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(envvars.VARIABLES)), text=texts)
def test_any_text_is_refused_naming_the_variable_or_taken_as_documented(name, text):
    check_variable(name, text)


def test_the_defaults_are_those_of_the_readers():
    from jddp.cli import launch
    from jddp.runtime import distributed, progress

    assert envvars.get("JDDP_PEER_TIMEOUT", {}) == distributed.DEFAULT_PEER_TIMEOUT_S == launch.DEFAULT_PEER_TIMEOUT_S
    assert envvars.get("JDDP_INIT_TIMEOUT", {}) == distributed.DEFAULT_INIT_TIMEOUT_S
    s = progress.Settings()
    stall = [envvars.get(f"JDDP_STALL{x}", {}) for x in ("", "_FACTOR", "_FLOOR", "_CEILING", "")]
    assert stall[:4] == [s.enabled, s.factor, s.floor_s, s.ceiling_s]


@pytest.mark.parametrize(("text", "enabled"), [("False", False), ("no", False), ("OFF", False), ("yes", True)])
def test_jddp_stall_false_turns_the_detector_off(monkeypatch, text, enabled):
    """``JDDP_STALL=False`` left the detector on: any string but four spellings was taken as true."""
    from jddp.runtime import progress

    monkeypatch.setenv("JDDP_STALL", text)
    assert progress.Settings.from_env().enabled is enabled
    monkeypatch.setenv("JDDP_STALL", "nope")
    with pytest.raises(ValueError, match=r"\$JDDP_STALL='nope' must be a boolean"):
        progress.Settings.from_env()


@pytest.mark.parametrize("name", ["JDDP_PEER_TIMEOUT", "JDDP_INIT_TIMEOUT"])
@pytest.mark.parametrize("text", ["inf", "nan", "1e400", "0", "-3"])
def test_initialize_refuses_a_timeout_that_is_not_a_finite_positive_number(monkeypatch, name, text):
    """``JDDP_PEER_TIMEOUT=inf`` passed the check (inf > 0) and crashed every process later."""
    from jddp.runtime import join_settings

    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(f"${name}={text!r} must be")):
        join_settings.Settings.resolve(None, None, None, None, None, None, None)
    with pytest.raises(ValueError, match=r"must be a positive, finite number of seconds, got peer_timeout_s=inf"):
        join_settings.Settings.resolve(None, None, None, None, 10.0, math.inf, None)


# ----------------------------------------------------------------- (c) every option of every jddp command


def parser_builders() -> list[tuple[str, str]]:
    """``(module, function)`` of every function in ``jddp`` that builds an ``argparse.ArgumentParser``."""
    found = []
    for path in sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                builds = any(
                    isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "ArgumentParser"
                    for n in ast.walk(node)
                )
                if builds:
                    module = ".".join(path.relative_to(multiprocess.ROOT).with_suffix("").parts)
                    found.append((module, node.name))
    return found


def all_parsers() -> list[argparse.ArgumentParser]:
    """Every parser the builders return, and their subcommands' parsers."""
    out = []
    builders = [(m, f) for m, f in parser_builders() if f == "get_args_parser"]  # others: the test below fails
    todo = [getattr(importlib.import_module(module), function)() for module, function in builders]
    while todo:
        parser = todo.pop()
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return out


def options() -> list[tuple[argparse.ArgumentParser, argparse.Action]]:
    return [
        (parser, action)
        for parser in all_parsers()
        for action in parser._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
    ]


def option_id(case) -> str:
    parser, action = case
    return f"{parser.prog}:{max(action.option_strings, key=len)}"


def test_every_command_builds_its_parser_in_get_args_parser_and_all_are_found():
    builders = parser_builders()
    assert all(function == "get_args_parser" for _, function in builders), builders
    progs = {p.prog for p in all_parsers()}
    for prog in ("jddp", "jddp info", "jddp launch", "jddp bench", "jddp goodput", "python -m jddp.benchmark.worker"):
        assert prog in progs, progs


def test_no_option_takes_a_bare_int_or_float():
    """``type=int`` or ``float`` takes ``-1``, ``nan`` and ``inf``: every number goes through envvars' converters."""
    bare = [option_id(case) for case in options() if case[1].type in (int, float)]
    assert not bare, f"options with a bare int/float type (use envvars.count or envvars.seconds): {bare}"


def required_argv(parser: argparse.ArgumentParser, skip: argparse.Action) -> list[str]:
    """Valid values for the parser's required arguments but ``skip``: options first, then positionals."""
    argv, positionals = [], []
    for action in parser._actions:
        if action is skip or isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        kind = getattr(action.type, "kind", None)
        value = "1" if kind else action.choices[0] if action.choices else "x"
        if action.option_strings and action.required:
            argv.append(f"{action.option_strings[-1]}={value}")
        elif not action.option_strings and action.nargs not in (argparse.REMAINDER, "?", "*"):
            positionals.append(value)
    return argv + positionals


def feed(parser: argparse.ArgumentParser, action: argparse.Action, text: str):
    """Parses ``--option=text`` with the other required arguments valid: ``("exit", code, stderr)`` or
    ``("value", parsed value)``."""
    option = max(action.option_strings, key=len)
    argv = [f"{option}={text}", *required_argv(parser, action)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as stop:
            return ("exit", stop.code, err.getvalue())
    return ("value", getattr(args, action.dest))


def check_option(parser: argparse.ArgumentParser, action: argparse.Action, text: str) -> None:
    result = feed(parser, action, text)
    shown = (option_id((parser, action)), text, result)
    if result[0] == "exit":
        _, code, err = result
        assert code == 2 and "Traceback" not in err, shown
        assert re.search(rf"argument {re.escape('/'.join(action.option_strings))}: ", err), shown  # names it
        return
    value = result[1]
    kind, minimum = kind_of(action), getattr(action.type, "minimum", 0)
    if kind == "int":
        assert type(value) is int and value >= minimum and value == int(text.strip()), shown
    elif kind == "ints":
        assert all(type(v) is int and v >= minimum for v in value), shown
    elif kind == "nprocs":  # jddp launch -n: a count or a placement mode
        assert value in ("auto", "device", "host") or (type(value) is int and value >= minimum), shown
    elif kind == "range":  # N or MIN:MAX nodes
        low, high = value
        assert type(low) is type(high) is int and minimum <= low <= high, shown
    elif kind == "float":
        assert type(value) is float and math.isfinite(value) and value > 0, shown
    elif action.choices:
        assert value in action.choices, shown
    else:  # a string option: any text is a path or an address, checked where it is used
        assert action.type is None and action.nargs is None and value == text, shown


def checked(action: argparse.Action) -> bool:
    """A number, a choice, or a flag with a long spelling (``--flag=False`` must be refused; a short flag such as
    ``-m`` takes no ``=value`` form)."""
    flag = action.nargs == 0 and any(o.startswith("--") for o in action.option_strings)
    return bool(kind_of(action) or action.choices or flag)


def kind_of(action: argparse.Action) -> str | None:
    """The number an option takes: its converter's kind; a bare ``int``/``float`` (refused by the test above) is
    checked all the same, so that what it lets through shows."""
    return getattr(action.type, "kind", None) or {int: "int", float: "float"}.get(action.type)  # type: ignore[arg-type]


CHECKED = [case for case in options() if checked(case[1])]


@pytest.mark.parametrize("case", CHECKED, ids=option_id)
def test_each_numeric_boolean_or_choice_option_refuses_wrong_values_naming_itself(case):
    parser, action = case
    for text in WRONG:
        check_option(parser, action, text)
    if kind_of(action) in ("int", "ints", "float", "range", "nprocs"):  # never taken: nan, inf and the like
        for text in ("nan", "inf", "1e400", "-1", "abc", "False"):
            assert feed(parser, action, text)[:2] == ("exit", 2), (option_id(case), text)


def test_the_options_checked_include_every_numeric_one_and_the_flags():
    ids = {option_id(case) for case in CHECKED}
    assert "jddp launch:--peer-timeout" in ids and "jddp launch:--no-malloc-tuning" in ids, ids
    numeric = [case for case in options() if kind_of(case[1])]
    assert len(numeric) >= 20, [option_id(case) for case in numeric]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CHECKED), text=texts)
def test_any_text_for_any_option_is_refused_naming_it_or_taken_in_range(case, text):
    check_option(*case, text)


def test_launch_peer_timeout_inf_is_refused_before_anything_starts(capsys):
    """``jddp launch --peer-timeout inf`` passed (inf > 0) and every process crashed on it."""
    from jddp.cli import launch

    with pytest.raises(SystemExit) as stop:
        launch.main(["--peer-timeout", "inf", "-m", "train"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --peer-timeout: must be positive and finite: a number of seconds, got 'inf'" in err, err


# ----------------------------------------------- (d) the environment checked whole (jddp.runtime.cluster_env)


def typos(name: str) -> set[str]:
    """Misspellings of ``name`` after its ``JDDP_`` prefix: a letter dropped, two neighbours swapped, one doubled."""
    head, tail = name[:5], name[5:]
    out = set()
    for i in range(len(tail)):
        out.add(head + tail[:i] + tail[i + 1 :])
        out.add(head + tail[:i] + tail[i] + tail[i:])
        if i + 1 < len(tail):
            out.add(head + tail[:i] + tail[i + 1] + tail[i] + tail[i + 2 :])
    return {t for t in out if t not in envvars.VARIABLES and t != head}


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def test_every_misspelled_variable_is_named_with_the_closest_declared_one():
    exact = total = 0
    for name in envvars.VARIABLES:
        for typo in sorted(typos(name)):
            ((unknown, close),) = cluster_env.unknown_variables({typo: "1", name: "1", "PATH": "/bin"})
            assert unknown == typo and close in envvars.VARIABLES, (typo, close)
            # difflib's choice: never a name further from the typo than the one it came from
            assert similarity(typo, close) >= similarity(typo, name) - 1e-12, (typo, close, name)
            (said,) = cluster_env.environment_warnings({typo: "1"}, alone=True)
            assert f"${typo} is not a jddp variable" in said and f"did you mean {close}?" in said
            exact += close == name
            total += 1
    assert total > 500 and exact / total > 0.9, (exact, total)
    assert cluster_env.unknown_variables(dict.fromkeys(envvars.VARIABLES, "1")) == []
    assert cluster_env.unknown_variables({"JDDP_TEST_SEED": "1", "JDDP_SEMANTIC_MUTANT": "m", "XJDDP_A": ""}) == []


def subsets(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    return [c for k in range(len(names) + 1) for c in itertools.combinations(names, k)]


def test_every_partial_scheduler_environment_is_named_with_what_is_missing():
    assert len(cluster_env.SCHEDULERS) >= 5
    for scheduler in cluster_env.SCHEDULERS:
        for present in subsets(scheduler.needs):
            environ = {v: str(i) for i, v in enumerate(present)}
            missing = [v for v in scheduler.needs if v not in present]
            found = [(s.name, p, m) for s, p, m in cluster_env.partial_schedulers(environ)]
            said = cluster_env.environment_warnings(environ, alone=True)
            if not present or (not missing and scheduler.joins):
                assert found == [] and said == [], (scheduler.name, present)
                continue
            assert found == [(scheduler.name, list(present), missing)]
            (line,) = said
            assert f"{scheduler.name}'s variables are set" in line and "process 0 of 1" in line
            assert all(f"{v}=" in line for v in present) and all(v in line.split("missing")[-1] for v in missing)
            assert cluster_env.environment_warnings(environ, alone=False) == []  # a group was found: nothing
            if scheduler.detected and missing:
                with pytest.raises(ValueError, match=rf"{re.escape(scheduler.name)}'s variables are partly set"):
                    cluster_env.refuse_partial(environ)


def test_the_schedulers_jax_detects_are_found_by_jax_with_the_whole_set(monkeypatch):
    """The table agrees with JAX's cluster detection (jax/_src/clusters): with the whole set JAX finds the cluster;
    with part of it, either JAX does not (jddp runs alone, and warns) or jddp refuses it (``refuse_partial``)."""
    from jddp.runtime import jax_internals

    every = {v for s in cluster_env.SCHEDULERS for v in s.needs}
    for name in list(os.environ):
        if name in every or name.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_")):
            monkeypatch.delenv(name)
    assert not jax_internals.cluster_detected()
    detected = [s for s in cluster_env.SCHEDULERS if s.detected]
    assert {s.name for s in detected} == {"SLURM", "Open MPI"}
    for scheduler in detected:
        for present in subsets(scheduler.needs):
            with monkeypatch.context() as m:
                for v in present:
                    m.setenv(v, "1")
                jax_found = jax_internals.cluster_detected()
                whole = len(present) == len(scheduler.needs)
                if whole:
                    assert jax_found, scheduler.name
                elif jax_found:  # JAX would go on and fail on a missing variable: jddp refuses first
                    with pytest.raises(ValueError, match="partly set"):
                        cluster_env.refuse_partial(os.environ)


@pytest.mark.parametrize("rank", cluster_env.RANK_VARIABLES)
def test_only_process_0_of_the_first_attempt_warns(rank, monkeypatch):
    assert cluster_env.reports({}) and cluster_env.reports({rank: "0"}) and not cluster_env.reports({rank: "3"})
    assert not cluster_env.reports({rank: "0", "JDDP_RESTART_COUNT": "1"})
    monkeypatch.setattr(cluster_env, "_warned", False)
    with pytest.warns(RuntimeWarning, match="JDDP_PEER_TIMOUT is not a jddp variable"):
        cluster_env.warn_environment(alone=False, environ={rank: "0", "JDDP_PEER_TIMOUT": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cluster_env.warn_environment(alone=False, environ={rank: "0", "JDDP_PEER_TIMOUT": "1"})  # once per process
        monkeypatch.setattr(cluster_env, "_warned", False)
        cluster_env.warn_environment(alone=False, environ={rank: "1", "JDDP_PEER_TIMOUT": "1"})  # not process 0


@pytest.mark.multiprocess
def test_initialize_names_a_typo_and_a_partial_slurm_environment_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORD"))}
    env.update(SLURM_JOB_ID="42", SLURM_NTASKS="4", JDDP_PEER_TIMOUT="5", JAX_PLATFORMS="cpu")
    code = "import jddp\nassert jddp.initialize() is None\nassert jddp.initialize() is None\nprint('alone')\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "alone" in done.stdout, done.stderr
    assert done.stderr.count("$JDDP_PEER_TIMOUT is not a jddp variable") == 1, done.stderr
    assert "did you mean JDDP_PEER_TIMEOUT?" in done.stderr
    assert done.stderr.count("SLURM's variables are set") == 1, done.stderr
    assert "missing SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID" in done.stderr

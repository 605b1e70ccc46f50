"""The registry of semantic mutants (tests/semantic_mutants.py), checked cheaply: it does not run the mutants
(``tools/semantic_mutants.py`` does, each in a fresh pytest process).

* every mutant names tests that exist, and its patch still applies to the source, once, and reverts;
* every quoted guarantee is still in its doc, every core invariant and every guarantee listed in the docs
  has a mutant (a guarantee added to the docs without one fails here);
* the plugin with no mutant set changes nothing.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from tests import semantic_mutants as registry

ROOT = registry.ROOT


@functools.cache
def _functions(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef))


def _targets():
    out = []
    for mutant in registry.MUTANTS:
        for patch in mutant.patches:
            _, owner, attr = registry._resolve(patch.target)
            out.append((owner, attr))
    return out


def _snapshot():
    return [(owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr))
            for owner, attr in _targets()]  # fmt: skip


def test_names_are_unique_and_every_mutant_names_tests_that_exist():
    names = [m.name for m in registry.MUTANTS]
    assert len(names) == len(set(names))
    for mutant in registry.MUTANTS:
        assert mutant.tests, mutant.name
        for node in mutant.tests:
            path, _, function = node.partition("::")
            assert (ROOT / path).is_file(), f"{mutant.name}: no file {path}"
            assert function.split("[")[0] in _functions(path), f"{mutant.name}: no test {node}"


@pytest.mark.parametrize("mutant", registry.MUTANTS, ids=lambda m: m.name)
def test_each_patch_applies_to_the_current_source_and_reverts(mutant):
    before = _snapshot()
    undo = registry.apply(mutant)
    try:
        changed = [(o, a) for (o, a, x) in before if (o.__dict__[a] if isinstance(o, type) else getattr(o, a)) is not x]
        assert changed, f"{mutant.name} changed nothing"
    finally:
        undo()
    assert all((o.__dict__[a] if isinstance(o, type) else getattr(o, a)) is x for o, a, x in before)


def test_every_quote_is_in_its_doc():
    for mutant in registry.MUTANTS:
        assert registry.normalised(mutant.quote) in registry.doc_text(mutant.doc), (
            f"{mutant.name}: its guarantee is no longer in {mutant.doc}; quote the current sentence"
        )


def test_every_core_invariant_has_a_mutant():
    assert len(registry.CORE) == 7
    for doc, sentence in registry.CORE:
        assert registry.normalised(sentence) in registry.doc_text(doc), f"not in {doc}: {sentence}"
        quoted = [m.name for m in registry.MUTANTS if m.doc == doc and m.quote == sentence]
        assert quoted, f"no semantic mutant breaks the invariant {sentence!r} ({doc})"


def test_every_documented_guarantee_has_a_mutant():
    guarantees = registry.doc_guarantees()
    assert len(guarantees) >= 25  # the lists were found: glossary 6, options 7, sampler 5, Checkpointer 12
    missing = [
        f"{doc}: {text[:100]}"
        for doc, text in guarantees
        if not any(m.doc == doc and registry.normalised(m.quote) in text for m in registry.MUTANTS)
    ]
    assert not missing, "guarantees without a semantic mutant (add one to tests/semantic_mutants.py):\n" + "\n".join(
        missing
    )


def test_the_plugin_without_a_mutant_changes_nothing(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    before = _snapshot()

    class Config:
        pass

    config = Config()
    registry.pytest_configure(config)
    assert not hasattr(config, "_semantic_mutant") and registry.pytest_report_header(config) is None
    assert all((o.__dict__[a] if isinstance(o, type) else getattr(o, a)) is x for o, a, x in before)


def test_an_unknown_mutant_name_is_an_error(monkeypatch):
    monkeypatch.setenv(registry.ENV, "no_such_mutant")
    with pytest.raises(KeyError, match="no_such_mutant"):
        registry.apply_from_env()


@pytest.mark.multiprocess  # starts a process of its own
def test_the_runner_kills_a_mutant_in_a_fresh_pytest():
    """End to end on the cheapest mutant (NumPy only): the plugin applies it, its test fails, the runner says so."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "semantic_mutants.py"), "sampler_slices_overlap"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "KILLED" in done.stdout and "test_slices_disjoint_and_epoch_covers_each_example_once" in done.stdout

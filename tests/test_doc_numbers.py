"""Every figure of the user docs says where it comes from.

A figure is a number with a unit (s, ms, µs, min, %, 1.5x, MB, MiB, GB/s, steps/s, ulp ...) in README.md or a page of
docs/ outside docs/dev/ (the developers' log). It passes when the passage it stands in (its sentence; for a table
or a code block, the whole of it with the paragraph that leads into it) has a source marker:

* a link to BENCHMARKS.md or a benchmark script (``benchmarks/...``, ``python -m benchmarks...``), or a test that
  asserts it (``tests/test_*.py``);
* what it was measured on and when: a machine (``2-core``, ``VM``, ``CPU``, ``GPU``, ``laptop``, ``host``) and a
  date (``25 Nov 2026``, ``2026-11-25``).

Definitions are not measurements: a number whose clause says it is a default (``30 s by default``, ``(default
60 s)``, a table column headed "Default"), and the promises and limits of ``DEFINITIONS`` below, listed by page and
text with the reason. Separately, "this machine", "my machine" and "here" as a place of measurement are refused
everywhere, and a claim that two things agree "to the bit" or "to round-off" must say by how much (a tolerance, ulp,
"bitwise" with its test, or its measurement).

The engine guide's agreement and memory figures for ZeRO-1 are measured again by the last tests here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "dev" not in p.parts)]

# A number, then a unit: words after a space (a thin or plain one), %, x and ulp also attached ("1.5x", "50%").
_NUMBER = r"(?<![\w.\-/^])\d+(?:,\d{3})*(?:\.\d+)?(?:e-?\d+)?"
_WORD_UNITS = r"µs|us|ms|s|min|minutes|seconds|hours|MB|GB|KB|MiB|GiB|KiB|GB/s|MB/s|steps/s|examples/s|ulp"
FIGURE = re.compile(rf"(?P<n>{_NUMBER})(?:[ \u202f\u00a0](?P<w>{_WORD_UNITS})|(?P<a>%|x(?!\d)))(?![\w/])")

BENCHMARK_SOURCE = re.compile(r"BENCHMARKS\.md|benchmarks/\w+|python -m benchmarks|tests/test_\w+\.py|\]\(https?://")
MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
DATE = re.compile(rf"\b\d{{1,2}} (?:{MONTHS})\w* 20\d\d\b|\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\d+-core|\d+ cores|\bVM\b|\bCPU\b|\bGPU\b|laptop|\bhost\b")
DEFAULT = re.compile(r"\bdefault", re.I)
NOWHERE = re.compile(r"\b(?:this|my) (?:[\w-]+ )?(?:machine|computer|laptop|box)\b|\bmeasured here\b", re.I)
EQUALITY = re.compile(r"\b(?:agree|same|equal|alike)\w*\b[^.;]*\b(?:to the bit|round-off)", re.I)
TOLERANCE = re.compile(r"\d(?:\.\d+)?e-\d+|\bulp\b|bitwise|tests/test_\w+\.py", re.I)

# Promises and limits, not measurements: (page, the words around the figure, why it is a definition). A figure
# inside those words on that page passes; each entry must still occur.
DEFINITIONS: tuple[tuple[str, str, str], ...] = (
    ("docs/guides/benchmarks.md", "an efficiency over 100%", "a bound no measurement can pass, not a measurement"),
    ("docs/guides/benchmarks.md", "wider than 25% of", "jddp bench's spread threshold, a constant (benchmark.noise)"),
    ("docs/guides/fit.md", "`step 120/1000 (12%), 35.2 steps/s, loss=0.4321`", "the bar's line format, an example"),
    ("docs/guides/fit.md", "most every 10 s", "the bar's rate limit off a terminal, a constant of jddp.fit_bar"),
    ("docs/concepts.md", "at most 1 s apart", "the watchdog round's cap, a constant"),
    ("docs/concepts.md", "at least 60 s and at most 30 min", "the stall bound's floor and ceiling, settings"),
    ("docs/glossary.md", "leaves up to 1 MiB", "the fused all-reduce's threshold, a constant of jddp/engine/fused.py"),
    ("docs/guides/launch.md", "up to 16 MiB", "the host collectives' size limit, a constant"),
    ("docs/guides/launch.md", "at most 0.25 s for a copy", "the flush's wait for kept copies, a constant"),
    ("docs/guides/launch.md", "`timeout_s`, 300 s", "the host collectives' default time limit"),
    ("docs/guides/launch.md", "peer timeout plus 15 s", "a bound the launcher sets"),
    ("docs/guides/launch.md", "up to 30 s, rather than", "the launcher's wait for a preparing generation, a constant"),
    ("docs/guides/launch.md", "one write per 100 ms per host", "the kernel's rate limit on autogroup writes"),
    ("docs/guides/launch.md", "within the peer timeout + 5 s", "a bound the launcher sets"),
    ("docs/guides/launch.md", "10 minutes for NCCL", "NCCL's default timeout, PyTorch's setting"),
    ("docs/guides/launch.md", "at least 60 s and at most 30 min", "the stall bound's floor and ceiling, settings"),
    ("docs/guides/launch.md", "(5 s when the first to end lost a peer", "the launcher's grace period, a constant"),
    ("docs/guides/launch.md", "or 5 s when the report", "the launcher's grace period, a constant"),
    ("docs/guides/launch.md", "has not answered for 5 s", "the launchers' patience with node 0's service, a constant"),
    ("docs/guides/launch.md", "all of them have waited 3 s", "the host collectives' wait before naming a mismatch"),
    (
        "docs/guides/goodput.md",
        "A run that trains for 12 s of a 30 s wall time has a goodput of 40%; the other 18 s",
        "a worked example of the definition",
    ),
    ("docs/guides/goodput.md", "never sum past 100%", "the ledger's promise, which tests/test_goodput.py holds"),
    ("docs/guides/checkpoints.md", "(60 s)", "lease_timeout_s's default"),
    ("docs/guides/checkpoints.md", "`preemption_check_s`, 1 s", "preemption_check_s's default"),
    ("docs/jax_notes.md", "(100 s by", "JAX's heartbeat timeout default, JAX's setting"),
    ("docs/jax_notes.md", "waits 40 s", "the CPU rendezvous' fixed wait in XLA's source"),
    ("docs/jax_notes.md", "`initialization_timeout` + 5 s", "a bound jddp sets"),
)


@dataclass(frozen=True)
class Passage:
    page: str
    line: int
    text: str
    header: tuple[str, ...] = ()  # a table's column names
    rows: tuple[tuple[str, ...], ...] = ()  # a table's cells


def _paragraphs(lines: list[str]) -> list[tuple[int, list[str], str]]:
    """``(first line, lines, kind)``: kind ``code``, ``table``, ``heading`` or ``prose``; list items apart."""
    out: list[tuple[int, list[str], str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        fence = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence[1]):
                j += 1
            out.append((i + 1, lines[i : j + 1], "code"))
            i = j + 1
            continue
        if line.lstrip().startswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out.append((i + 1, lines[i:j], "table"))
            i = j
            continue
        if line.startswith("#"):
            out.append((i + 1, [line], "heading"))
            i += 1
            continue
        j = i + 1
        item = re.compile(r"\s*(?:[-*]|\d+\.) ")
        while (
            j < len(lines)
            and lines[j].strip()
            and not item.match(lines[j])
            and not lines[j].lstrip().startswith(("|", "```", "#"))
        ):
            j += 1
        out.append((i + 1, lines[i:j], "prose"))
        i = j
    return out


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", text)


def passages(path: Path) -> list[Passage]:
    """The page cut into what a figure's source must be within (see the module's docstring)."""
    page = str(path.relative_to(ROOT))
    found, lead = [], ""
    for line, block, kind in _paragraphs(path.read_text().splitlines()):
        text = "\n".join(block)
        if kind == "prose":
            found += [Passage(page, line, s) for s in _sentences(" ".join(x.strip() for x in block))]
            lead = _sentences(" ".join(x.strip() for x in block))[-1]
        elif kind == "table":
            cells = [tuple(c.strip() for c in row.strip().strip("|").split("|")) for row in block]
            found.append(Passage(page, line, lead + "\n" + text, cells[0], tuple(cells[2:])))
            lead = ""
        elif kind == "code":
            found.append(Passage(page, line, lead + "\n" + text))
            lead = ""
        else:
            found.append(Passage(page, line, text))
            lead = ""
    return found


ALL = [p for page in PAGES for p in passages(page)]


def sourced(passage: Passage) -> bool:
    text = passage.text
    return bool(BENCHMARK_SOURCE.search(text) or (DATE.search(text) and MACHINE.search(text)))


def defined(passage: Passage, match: re.Match) -> bool:
    """Whether the figure is a definition: its clause says default, its table column is a default, or it is listed."""
    text = passage.text
    start = max(text.rfind(c, 0, match.start()) for c in ",;:(")
    ends = [e for e in (text.find(c, match.end()) for c in ",;:)") if e >= 0]
    clause = text[start + 1 : min(ends) if ends else len(text)]
    if DEFAULT.search(clause):
        return True
    for column, name in enumerate(passage.header):
        if DEFAULT.search(name) and any(column < len(row) and match.group(0) in row[column] for row in passage.rows):
            return True
    for page, words, _ in DEFINITIONS:
        if page == passage.page:
            for at in (m.start() for m in re.finditer(re.escape(words), text)):
                if at <= match.start() and match.end() <= at + len(words):
                    return True
    return False


def unsourced() -> list[str]:
    problems = []
    for passage in ALL:
        if sourced(passage):
            continue
        for match in FIGURE.finditer(passage.text):
            if not defined(passage, match):
                where = passage.text.replace("\n", " ")[:160]
                problems.append(f"{passage.page}:{passage.line}: {match.group(0)!r} in: {where}")
    return problems


def test_every_figure_of_the_docs_has_its_source():
    problems = unsourced()
    assert not problems, (
        f"{len(problems)} figure(s) without a source: link BENCHMARKS.md or the benchmark script, or say what "
        "it was measured on and when (a machine and a date), or, for a definition, say it is the default or list it "
        "in DEFINITIONS with the reason:\n" + "\n".join(problems)
    )


def test_no_figure_is_from_this_machine():
    found = [f"{p.page}:{p.line}: {m.group(0)!r}" for p in ALL for m in NOWHERE.finditer(p.text)]
    assert not found, "Say which machine and when, not 'this machine':\n" + "\n".join(found)


def test_every_claim_of_equality_says_how_equal():
    found = [
        f"{p.page}:{p.line}: {p.text[:160]}" for p in ALL if EQUALITY.search(p.text) and not TOLERANCE.search(p.text)
    ]
    assert not found, "Say how equal (bitwise with its test, ulp, or a tolerance):\n" + "\n".join(found)


def test_every_definition_listed_is_still_in_its_page():
    texts = {}
    for p in ALL:
        texts.setdefault(p.page, []).append(p.text)
    stale = [(page, words) for page, words, _ in DEFINITIONS if not any(words in t for t in texts.get(page, []))]
    assert not stale, f"DEFINITIONS names figures its pages no longer hold: {stale}"


@pytest.mark.parametrize(
    ("text", "figures", "ok"),
    [
        ("The step took 4.05 ms and 1.5x the time.", ["4.05 ms", "1.5x"], False),
        ("On a 2-core VM (25 Nov 2026) it took 23 s.", ["23 s"], True),
        ("It took 23 s (BENCHMARKS.md section 2).", ["23 s"], True),
        ("The peer timeout (30 s by default) ends it.", ["30 s"], True),
        ("The peer timeout is 30 s, a 3 s wait by default.", ["30 s", "3 s"], False),
        ("The mask of 1s and 0s, 2 x 2 devices, 1/N, 0.911 accuracy.", [], True),
    ],
    ids=["bare", "machine-and-date", "benchmarks-link", "default", "default-elsewhere", "not-figures"],
)
def test_the_scanner_on_sentences(text, figures, ok):
    """The scanner itself: what it takes for a figure, and what passes."""
    passage = Passage("x.md", 1, text)
    assert [m.group(0) for m in FIGURE.finditer(text)] == figures
    passes = sourced(passage) or all(defined(passage, m) for m in FIGURE.finditer(text))
    assert passes == ok


# --- The engine guide's ZeRO-1 figures, measured again ------------------------------------------------------------

ENGINE = ROOT / "docs/guides/engine.md"
N = 8


def _transformer():
    """The engine guide's one-block transformer (vocabulary 37, width 24, 2 heads, MLP 72, 8 tokens), as a jddp
    ``loss_fn``, its params and model state, and batches of 64 sequences."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jddp

    vocab, width, tokens = 37, 24, 8

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(vocab, width, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (tokens, width)) * 0.02)
            self.ln1, self.ln2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
            self.att = nnx.MultiHeadAttention(2, width, decode=False, rngs=rngs)
            self.f1, self.f2 = nnx.Linear(width, 72, rngs=rngs), nnx.Linear(72, width, rngs=rngs)
            self.head = nnx.Linear(width, vocab, rngs=rngs)

        def __call__(self, x):
            h = self.emb(x) + self.pos[...][None]
            h = h + self.att(self.ln1(h), mask=nnx.make_causal_mask(x))
            return self.head(h + self.f2(nnx.gelu(self.f1(self.ln2(h)))))

    def loss(model, batch, rng):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    graphdef, params, model_state = jddp.models.nnx_split(Block(nnx.Rngs(0)))

    def batch(i):
        x = np.random.default_rng(i).integers(0, vocab, (64, tokens)).astype(np.int32)
        return {"x": x, "y": np.roll(x, -1, 1)}

    host = jddp.models.to_host
    return jddp.models.nnx_loss(graphdef, loss), host(params), host(model_state), batch


def _train(loss_fn, params, model_state, batch, optimizer, steps, *, shard, clip=None):
    import jddp

    dp = jddp.DataParallel(loss_fn, optimizer, mesh=jddp.data_mesh(), shard_optimizer=shard, clip_grad_norm=clip)
    state = dp.init(params, model_state, rng=0)
    for i in range(steps):
        state, _ = dp.step(state, batch(i))
    return jddp.models.to_host(state.params)


def _ulps(a, b) -> int:
    import numpy as np

    ints = [np.asarray(x, np.float32).view(np.int32).astype(np.int64) for x in (a, b)]
    return int(np.abs(ints[0] - ints[1]).max())


def _quoted(pattern: str) -> float:
    found = re.search(pattern, " ".join(ENGINE.read_text().split()))
    assert found, f"docs/guides/engine.md no longer says {pattern!r}"
    return float(found[1])


@pytest.mark.slow
def test_the_engine_guides_agreement_of_the_two_engines_holds():
    """The replicated engine is the reference: one SGD step within the quoted ulp (and not bitwise, as the guide
    says), 20 AdamW steps within the quoted tolerance on every leaf but the key bias, which differs by more."""
    import jax
    import numpy as np
    import optax

    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    model = _transformer()
    ulp = _quoted(r"one SGD step left the parameters at most (\d+) ulp apart")
    ulp_clipped = _quoted(r"without clipping, (\d+) ulp with it")
    for clip, bound in ((None, ulp), (0.5, ulp_clipped)):
        a, b = (_train(*model, optax.sgd(0.1), 1, shard=shard, clip=clip) for shard in (False, True))
        measured = max(_ulps(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
        assert 0 < measured <= bound, (clip, measured, bound)
    tolerance = _quoted(r"every leaf was within (\S+) but one")
    low, high = _quoted(r"it differed by (\d\.\de-\d) to"), _quoted(r"it differed by \S+ to (\d\.\de-\d)")
    a, b = (_train(*model, optax.adamw(1e-3), 20, shard=shard) for shard in (False, True))
    diffs = {
        jax.tree_util.keystr(path): float(np.abs(x - y).max())
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True)
    }
    key = next(k for k in diffs if "key" in k and "bias" in k)
    assert max(v for k, v in diffs.items() if k != key) <= tolerance, diffs
    assert 0.95 * low <= diffs[key] <= 1.05 * high, (diffs[key], low, high)  # noise, of the size quoted


@pytest.mark.slow
def test_the_engine_guides_optimizer_memory_of_the_small_transformer_holds():
    """Bytes of AdamW's state per device, from the live buffers, times N over the replicated engine's: the guide's
    figures for the transformer at N = 2, 4, 8."""
    import jax
    import optax

    import jddp
    from jddp.engine import zero

    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    loss_fn, params, model_state, _ = _transformer()
    quoted = re.search(
        r"and (\d\.\d+), (\d\.\d+) and (\d\.\d+) x `1/N` on the small transformer", " ".join(ENGINE.read_text().split())
    )
    assert quoted, "docs/guides/engine.md no longer quotes the transformer's ratios"
    for n, figure in zip((2, 4, 8), quoted.groups(), strict=True):
        mesh = jddp.data_mesh(jax.devices()[:n])
        sizes = [
            zero.state_bytes(
                jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=mesh, shard_optimizer=shard)
                .init(params, model_state)
                .opt_state
            )
            for shard in (False, True)
        ]
        replicated, sharded = max(sizes[0].values()), max(sizes[1].values())
        assert len(set(sizes[1].values())) == 1
        assert f"{sharded * n / replicated:.4f}" == figure, (n, sharded * n / replicated)


# --- Figures quoted from a file a benchmark writes ---------------------------------------------------------------


def test_the_readmes_timing_of_its_command_is_the_benchmarks_file():
    """README.md quotes benchmarks/results/readme_command.json (written by ``python -m benchmarks readme_command``)
    as written there: the wall time, steps, test accuracy, date and load average."""
    import json

    figures = json.loads((ROOT / "benchmarks/results/readme_command.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    result, loads = figures["result"], figures["load_average_before"] + figures["load_average_after"]
    quoted = (
        f"({figures['date']}, load average {min(loads):.0f} to {max(loads):.0f}): {figures['wall_s']:.0f} s, "
        f"{result['steps']:.0f} steps, test accuracy {result['test_accuracy']:.3f}"
    )
    assert quoted in readme, f"README.md should say {quoted!r}, as benchmarks/results/readme_command.json holds"
    assert figures["command"] in readme  # the command timed is the README's

"""The documentation's code, run as written: every ```python block and every command that starts jddp or an example.

Generated at import time from README.md and docs/**/*.md; each test is named by the block's or the command's place
(``README.md:L39``, ``docs/guides/launch.md:L5``), and a failure shows the traceback in the Markdown file's lines.

Python blocks. Every block runs alone, in a fresh namespace and a temporary directory of its own, unless its first
line says which block it continues: ``# continues: <page>#<heading>`` (``# continues: #<heading>`` on its own page)
names the last block under that heading (before it, on its own page), and the block runs after that one, in one
namespace, after whatever that one continues in turn. ``# continues the quickstart`` is the same as
``# continues: docs/index.md#Quickstart``. So a reader who copies one block gets a program that runs, or is told
which one to copy first. A block whose first line is ``# fragment: <reason>`` is skipped with that reason, and so is
a command listed in ``SKIPPED_COMMANDS``. The blocks run in pytest's process, whose JAX already has the 8 CPU
devices they ask for (``jddp.simulate_cpu_devices(8)`` returns at once then).

Commands. Each runs in a fresh process in a temporary directory (``configs/`` linked into it), with the overrides of
``SMALL`` appended so that it trains a few steps: ``key=value`` for the examples' configs and a repeated flag for
argparse, where the last one wins.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import jddp
from tests import multiprocess

ROOT = multiprocess.ROOT
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
FRAGMENT = re.compile(r"#\s*fragment:\s*(?P<reason>.+)")
CONTINUES = re.compile(r"#\s*continues:\s*(?P<page>[^#\s]*)#(?P<rest>.+)$")  # <heading>, then a note if any
CONTINUES_QUICKSTART = "# continues the quickstart"  # the same as "# continues: docs/index.md#Quickstart"
QUICKSTART = ("docs/index.md", "Quickstart")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. "docs/guides/fit.md"
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    heading: str = ""  # the heading of the section that holds the block ("" before the first)

    @property
    def name(self) -> str:
        return f"{self.page}:L{self.line}"

    @property
    def fragment(self) -> str | None:
        """The reason given by a ``# fragment: <reason>`` first line, if any."""
        first = self.text.lstrip().partition("\n")[0]
        match = FRAGMENT.match(first)
        return match["reason"].strip() if match else None

    @property
    def continues(self) -> tuple[str, str] | None:
        """The ``(page, what follows "#")`` its first line names (``# continues: <page>#<heading> (a note)``), else
        None; ``named`` finds the heading in it."""
        first = self.text.lstrip().partition("\n")[0]
        if first.startswith(CONTINUES_QUICKSTART):
            return QUICKSTART
        match = CONTINUES.match(first)
        if match is None:
            assert not re.match(r"#\s*continues", first), f"{self.name}: write `# continues: <page>#<heading>`"
            return None
        return (match["page"] or self.page, match["rest"].strip())

    def compiled(self):
        """The block as code whose line numbers are the Markdown file's, so tracebacks point into the page."""
        # dont_inherit: the block is compiled as a page of its own, not under this module's __future__ imports
        return compile("\n" * self.line + self.text, str(ROOT / self.page), "exec", dont_inherit=True)


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, indented ones (in lists) dedented."""
    found, lines, i, heading = [], path.read_text().splitlines(), 0, ""
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            title = HEADING.match(lines[i])
            heading = title["text"] if title else heading
            i += 1
            continue
        indent, fence, start = len(opening["indent"]), opening["fence"], i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        text = "\n".join(body) + "\n"
        found.append(Block(str(path.relative_to(ROOT)), start + 1, opening["lang"].lower(), text, heading))
        i += 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


# --- Python blocks ---------------------------------------------------------------------------------------------


def named(block: Block) -> Block:
    """The block ``block`` continues: the last block under the heading it names, before it on its own page."""
    assert block.continues is not None
    page, rest = block.continues
    headings = sorted({b.heading for b in PYTHON if b.page == page and b.fragment is None})
    heading = max((h for h in headings if rest == h or rest.startswith(h + " ")), key=len, default=rest)
    candidates = [b for b in PYTHON if b.page == page and b.heading == heading and b.fragment is None]
    if page == block.page:
        candidates = [b for b in candidates if b.line < block.line]
    assert candidates, (
        f"{block.name} continues {page}#{heading}, which holds no runnable python block before it; "
        f"headings with one: {headings}"
    )
    return candidates[-1]


def chain(block: Block) -> list[Block]:
    """What runs, in order and in one namespace, for ``block``: the blocks it continues, then itself."""
    run = [block]
    while run[0].continues is not None:
        before = named(run[0])
        assert before not in run, f"{block.name}: a circle of blocks that continue each other: {[b.name for b in run]}"
        run.insert(0, before)
    return run


def close_checkpointers(namespace: dict) -> None:
    """A block may leave a Checkpointer open (to save on), holding its lease and threads in pytest's process."""
    for value in namespace.values():
        if isinstance(value, jddp.Checkpointer):
            value.close()


# Blocks that need an earlier one and do not say so yet, by their page and first line (their owners add the line;
# strict: the test fails here as soon as the block runs, and test_every_unmarked_block_is_in_the_docs once its first
# line changes, so that the entry goes).
NOT_YET_MARKED = {}


def _first_line(block: Block) -> str:
    return block.text.lstrip().partition("\n")[0]


def test_every_unmarked_block_is_in_the_docs():
    assert set(NOT_YET_MARKED) <= {(b.page, _first_line(b)) for b in PYTHON}


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block(block: Block, tmp_path, monkeypatch):
    """The block alone in a fresh namespace, or after the blocks it says it continues."""
    if block.fragment is not None:
        pytest.skip(f"fragment: {block.fragment}")
    unmarked = NOT_YET_MARKED.get((block.page, _first_line(block)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [block.name])  # a script run without arguments
    namespace = {"__name__": "__docs__"}
    try:
        for b in chain(block):
            try:
                exec(b.compiled(), namespace)
            except Exception as e:
                if unmarked is not None:
                    pytest.xfail(f"does not say what it continues yet ({type(e).__name__}): {unmarked}")
                if b is not block:
                    e.add_note(f"in {b.name}, which {block.name} continues (its first line says so)")
                else:
                    e.add_note(
                        f"{block.name} runs alone: if it needs an earlier block, its first line must say which "
                        "(# continues: <page>#<heading>)"
                    )
                raise
    finally:
        close_checkpointers(namespace)
    assert unmarked is None, f"{block.name} runs alone now: take it out of NOT_YET_MARKED"


@pytest.mark.parametrize("block", [b for b in PYTHON if b.continues], ids=[b.name for b in PYTHON if b.continues])
def test_each_continued_block_is_named_by_a_heading_that_holds_it(block: Block):
    """Every ``# continues:`` line names a runnable block, and no block continues itself through others."""
    assert chain(block)[-1] is block and len(chain(block)) >= 2


# --- Commands ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # one command, as written (without a trailing comment)

    @property
    def name(self) -> str:
        return f"{self.page}:L{self.line}"

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)


def commands(block: Block) -> list[Command]:
    """The commands of a shell block that start jddp or an example (or a user's ``train.py``), one per ``&&`` part."""
    found = []
    for offset, line in enumerate(block.text.splitlines(), start=1):
        words = shlex.split(line, comments=True)
        ends = [i for i, w in enumerate(words) if w == "&&"]
        for start, end in zip([-1, *ends], [*ends, len(words)], strict=True):
            part = words[start + 1 : end]
            if part and (part[0] == "jddp" or any(w.startswith("examples.") for w in part) or "train.py" in part):
                found.append(Command(block.page, block.line + offset, shlex.join(part)))
    return found


COMMANDS = [c for b in ALL_BLOCKS if b.lang in SHELL for c in commands(b)]

# Appended to a command that runs this program (argparse takes the last of a repeated flag).
SMALL = {
    "examples.mnist1d.train": ["epochs=1", "num_samples=1000", "progress=false"],  # the data its tests cached
    "examples.digits.train": ["epochs=1", "progress=false"],
    # jddp's top-level modules in place of the standard library: a corpus of about 15 files, a third held out
    "examples.lm.train": [
        "steps=2",
        "warmup_steps=1",
        "progress=false",
        f"corpus_dir={ROOT / 'jddp'}",
        "test_modulus=3",
    ],
    "examples.flax_port.train": ["--steps", "2"],
    # the 1-device baseline and 2 processes x 1 device; --processes 1,2 would add 1 process x 2 devices
    "bench": ["--devices", "1,2", "--processes", "2", "--steps", "2", "--warmup", "1", "--rounds", "1"],
}

# Commands that cannot run here, by their text (a line number would move with every edit above it), with the reason.
SKIPPED_COMMANDS = {
    "jddp launch -n 2 --max-restarts 3 train.py lr=1e-3": "train.py stands for the user's script",
    "jddp launch -n 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 train.py": (
        "needs a second host, and the coordinator's address 10.0.0.1"
    ),
    "jddp launch --transport mpi -n 2 train.py": "needs jddp[mpi], not installed here; train.py is the user's",
    "mpiexec -n 2 python train.py": "needs mpiexec (the jddp[mpi] extra), not installed here; train.py is the user's",
    "srun --mpi=pmi2 -n 2 python train.py": "needs mpi4py over SLURM's PMI2, not set up here; train.py is the user's",
    "srun -n 2 python -m examples.mnist1d.train": "needs a SLURM cluster: tests/test_slurm.py starts one and runs it",
    "srun -N 3 --ntasks-per-node=1 python -m examples.mnist1d.train": (
        "needs a SLURM cluster of three nodes: tests/test_slurm_hosts.py starts one in network namespaces"
    ),
    "srun -N 3 --ntasks-per-node=1 --no-kill jddp launch --nnodes 2:3 --coordinator node1:29500 -n 1 train.py": (
        "needs a SLURM cluster of three nodes: tests/test_slurm_hosts.py runs it with tests/workers/fit_train.py"
    ),
    "srun -N 1 -w node3 jddp launch --nnodes 2:3 --coordinator node1:29500 -n 1 train.py": (
        "needs a SLURM cluster of three nodes: tests/test_slurm_hosts.py runs it with tests/workers/fit_train.py"
    ),
    "jddp launch train.py": "needs a GPU or TPU host (tests/test_placement.py checks what each process gets)",
    "jddp launch -n host train.py": "needs a GPU host (tests/test_placement.py checks what each process gets)",
    "jddp launch -n 4 train.py": "needs a host of 4 or 8 GPUs (tests/test_placement.py checks the placement)",
    "srun -N 2 --ntasks-per-node=1 jddp launch --nnodes 2 --node-rank '$SLURM_NODEID' --coordinator node1:29500 "
    "train.py": "needs a SLURM cluster of GPU hosts",
    "srun -N 2 --ntasks-per-node=8 --gpus-per-task=1 python train.py": "needs a SLURM cluster of GPU hosts",
    "jddp launch --nnodes 2:3 --coordinator 10.0.0.1:29500 -n 4 train.py": (
        "needs the hosts and the address 10.0.0.1; tests/test_elastic.py runs three launchers on loopback"
    ),
}


def first_of_each(cmds: list[Command]) -> dict[str, str]:
    """The name of the first command with the same text as each later one, which runs it for both."""
    first: dict[str, str] = {}
    same = {}
    for c in cmds:
        if c.text in first:
            same[c.name] = first[c.text]
        else:
            first[c.text] = c.name
    return same


SAME_AS = first_of_each(COMMANDS)


def program(argv: list[str]) -> str:
    """``examples.<name>.train`` for a command that runs an example, else the jddp subcommand."""
    module = next((w for w in argv if w.startswith("examples.")), None)
    return module or argv[1]


def runnable(argv: list[str]) -> list[str]:
    """The command with this interpreter and this venv's ``jddp``, and the overrides that keep it small."""
    if argv[0] == "jddp":
        argv = [str(Path(sys.executable).with_name("jddp")), *argv[1:]]
    elif argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    return [*argv, *SMALL[program(argv)]]


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[c.name for c in COMMANDS])
def test_command(command: Command, tmp_path):
    if command.text in SKIPPED_COMMANDS:
        pytest.skip(SKIPPED_COMMANDS[command.text])
    if command.name in SAME_AS:
        pytest.skip(f"the same command as {SAME_AS[command.name]}, which runs it")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    argv = runnable(command.argv)
    done = subprocess.run(
        argv, cwd=tmp_path, env=multiprocess.environment(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_every_skip_names_a_command_of_the_docs():
    """A skip outlives its command only by mistake: a renamed or moved command must be skipped (or run) anew."""
    assert set(SKIPPED_COMMANDS) <= {c.text for c in COMMANDS}
    assert all(program(c.argv) in SMALL for c in COMMANDS if c.text not in SKIPPED_COMMANDS)


def test_the_docs_have_code():
    """The parser finds the blocks (a change of fence style would otherwise leave nothing to test)."""
    assert len(PYTHON) >= 10 and len(COMMANDS) >= 5

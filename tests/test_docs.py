"""The documentation's code, run as written: every ```python block and every command that starts jddp or an example.

Generated at import time from README.md and docs/**/*.md; each test is named by the block's or the command's place
(``README.md:L39``, ``docs/guides/launch.md:L5``), and a failure shows the traceback in the Markdown file's lines.

Python blocks. The blocks of one page run in order in one namespace, as the page reads (a block may use what the
page's earlier blocks defined): a test continues the namespace its page's previous block left on this xdist worker,
or runs the page's earlier blocks first, so that it stands alone. A page whose first block starts with
``# continues the quickstart`` starts from the namespace of the quickstart (docs/index.md), as the guides read. A
block whose first line is ``# fragment: <reason>`` is skipped with that reason, and so is a command listed in
``SKIPPED_COMMANDS``. The blocks run in pytest's process, whose JAX already has the 8 CPU devices they ask for
(``jddp.simulate_cpu_devices(8)`` returns at once then), in a temporary directory.

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
CONTINUES_QUICKSTART = "# continues the quickstart"
QUICKSTART_PAGE = "docs/index.md"
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. "docs/guides/fit.md"
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.page}:L{self.line}"

    @property
    def fragment(self) -> str | None:
        """The reason given by a ``# fragment: <reason>`` first line, if any."""
        first = self.text.lstrip().partition("\n")[0]
        match = FRAGMENT.match(first)
        return match["reason"].strip() if match else None

    def compiled(self):
        """The block as code whose line numbers are the Markdown file's, so tracebacks point into the page."""
        # dont_inherit: the block is compiled as a page of its own, not under this module's __future__ imports
        return compile("\n" * self.line + self.text, str(ROOT / self.page), "exec", dont_inherit=True)


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, indented ones (in lists) dedented."""
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, start = len(opening["indent"]), opening["fence"], i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        found.append(Block(str(path.relative_to(ROOT)), start + 1, opening["lang"].lower(), "\n".join(body) + "\n"))
        i += 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


# --- Python blocks ---------------------------------------------------------------------------------------------


def page_blocks(block: Block) -> list[Block]:
    """What runs in ``block``'s namespace, in order, up to ``block``: the quickstart if its page continues it, then
    the page's blocks that are not fragments."""
    page = [b for b in PYTHON if b.page == block.page and b.fragment is None]
    if page and page[0].text.startswith(CONTINUES_QUICKSTART):
        quickstart = [b for b in PYTHON if b.page == QUICKSTART_PAGE]
        assert len(quickstart) == 1, f"{QUICKSTART_PAGE} should hold one python block, the quickstart"
        page = quickstart + page
    return page[: page.index(block) + 1]


@dataclass
class Page:
    """A page's namespace and working directory after its blocks up to ``done`` ran."""

    done: Block
    namespace: dict
    cwd: Path


PAGES_RUN: dict[str, Page] = {}  # on this xdist worker: a test continues the page its previous test left


def close_checkpointers(namespace: dict) -> None:
    """A page may leave a Checkpointer open (to save on), holding its lease and threads in pytest's process."""
    for value in namespace.values():
        if isinstance(value, jddp.Checkpointer):
            value.close()


@pytest.fixture(scope="module", autouse=True)
def _close_pages():
    yield
    for page in PAGES_RUN.values():
        close_checkpointers(page.namespace)
    PAGES_RUN.clear()


@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_python_block(block: Block, tmp_path, monkeypatch):
    if block.fragment is not None:
        pytest.skip(f"fragment: {block.fragment}")
    run = page_blocks(block)
    page = PAGES_RUN.pop(block.page, None)
    if page is not None and len(run) > 1 and page.done is run[-2]:
        run = run[-1:]  # the blocks before ran in this namespace, in the previous test
    else:
        if page is not None:
            close_checkpointers(page.namespace)
        page = Page(block, {"__name__": "__docs__"}, tmp_path)
    monkeypatch.chdir(page.cwd)
    monkeypatch.setattr(sys, "argv", [block.name])  # a script run without arguments
    for b in run:
        try:
            exec(b.compiled(), page.namespace)
        except Exception as e:
            if b is not block:
                e.add_note(f"in {b.name}, which runs before {block.name} in one namespace")
            close_checkpointers(page.namespace)
            raise
    page.done = block
    PAGES_RUN[block.page] = page


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

"""Lists the collectives of a step: as compiled (optimised HLO) and as the program asks for them (StableHLO).

The two differ where the backend rewrites collectives: XLA combines the
per-leaf all-reduces into one op and, on CPU, widens a bf16 all-reduce to f32.
The lowered program shows what jddp asked for (the dtype on the wire where the
backend keeps it); the compiled one shows what runs here.

For another platform (``lower_for``: ``cuda``, ``rocm``, ``tpu``), JAX lowers the
program on this machine with no device; nothing can be compiled, so the report
holds the lowered collectives and the program's custom calls, and names each
host callback (Python run on the host every step) and each custom call of
another platform (``CommReport.portability``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jddp import validate
from jddp.engine import checks

COLLECTIVES = (
    "all-reduce",
    "all-reduce-start",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented header
_LOWERED_OP = re.compile(r'"stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all|collective_permute)"')
_SIGNATURE = re.compile(r":\s*\(([^()]*)\)\s*->")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_MLIR_DTYPES = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64", "ui8": "u8", "ui16": "u16",
                "ui32": "u32", "ui64": "u64"}  # fmt: skip
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")

_CUSTOM_CALL = re.compile(r'(?:stablehlo\.custom_call|custom_call)\s*@([\w.$\-]+)|call_target_name\s*=\s*"([^"]+)"')
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# Custom calls that are part of how JAX lowers portable programs (sharding annotations, shard_map's boundaries).
PORTABLE_CUSTOM_CALLS = frozenset(
    {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
     "xla.sdy.GlobalToLocalShape", "xla.sdy.LocalToGlobalShape", "xla.sdy.FuncResultSharding",
     "local_sharding_constraint"}
)  # fmt: skip

MSG_CPU_BF16 = (
    "XLA:CPU widens a bf16 all-reduce to f32: the gradients are rounded to bf16, "
    "but the bytes moved are those of f32. GPU backends keep bf16 on the wire."
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the compiled program.

    Attributes:
      op: the HLO op, such as ``"all-reduce"``.
      computation: the HLO computation holding it (``main...`` for the entry).
      in_loop: whether it runs inside a while loop (once per iteration).
      operands: ``(dtype, shape)`` of each operand (XLA combines many leaves into one op).
      nbytes: bytes of the result: an all-reduce's payload, a reduce-scatter's
        slice, an all-gather's whole array.
      group_size: the devices in each of its replica groups (None if the HLO does not say).
    """

    op: str
    computation: str
    in_loop: bool
    operands: tuple[tuple[str, tuple[int, ...]], ...]
    nbytes: int
    group_size: int | None = None

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({d for d, _ in self.operands}))

    @property
    def wire_bytes(self) -> float | None:
        """Bytes each device sends by the ring algorithm, for a group of ``n``: an all-reduce ``2 (n-1)/n`` of
        its payload (a reduce-scatter then an all-gather), a reduce-scatter ``n - 1`` slices, an all-gather or an
        all-to-all ``(n-1)/n`` of its result, a permute its payload. None when the group size is unknown."""
        n = self.group_size
        if n is None:
            return None
        kind = self.op.removesuffix("-start")
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "all-gather": (n - 1) / n,
                  "all-to-all": (n - 1) / n, "collective-permute": 1.0}[kind]  # fmt: skip
        return factor * self.nbytes


@dataclasses.dataclass(frozen=True)
class CommReport:
    """The collectives of a compiled step, as data and as a table (``str(report)``)."""

    collectives: tuple[Collective, ...]
    notes: tuple[str, ...] = ()
    lowered: tuple[Collective, ...] = ()
    custom_calls: tuple[str, ...] = ()  # the lowered program's custom-call targets, in order of appearance
    platform: str | None = None  # what it was lowered for (None: this machine's, compiled)

    @classmethod
    def from_lowered(cls, lowered_text: str, *, platform: str) -> CommReport:
        """The report of a program lowered for ``platform`` (``lower_for``), which cannot be compiled here: its
        ``collectives`` are the lowered ones, and ``notes`` name what would not run as well there (``portability``).

        Raises:
          TypeError: if ``lowered_text`` is not a str.
          ValueError: if ``platform`` is not one of ``PLATFORMS``.
        """
        validate.check_str("lowered_text", lowered_text, empty=True)
        check_platform(platform)
        lowered = _lowered_collectives(lowered_text)
        calls = tuple(a or b for a, b in _CUSTOM_CALL.findall(lowered_text))
        report = cls(lowered, (), lowered, calls, platform)
        return dataclasses.replace(report, notes=report.portability())

    def portability(self) -> tuple[str, ...]:
        """What in the program would not run on ``platform`` as it runs here: each host callback (Python on the
        host every step: a device-to-host copy and a wait, per call) and each custom call outside JAX's portable
        ones (a kernel written for one platform: ``mpi4jax``'s, Pallas's, a CPU-only library's)."""
        found = []
        for target in dict.fromkeys(self.custom_calls):
            if target in PORTABLE_CUSTOM_CALLS:
                continue
            if "callback" in target:
                found.append(
                    f"host callback `{target}`: the step runs Python on the host each time (a device-to-host copy "
                    "and a wait); move it out of the step or behind `jax.debug` flags."
                )
            else:
                found.append(
                    f"custom call `{target}`: a kernel of one platform's; check that {self.platform or 'the target'} "
                    "has it before running there."
                )
        return tuple(found)

    @classmethod
    def from_hlo(cls, hlo_text: str, *, reduce_dtype=None, lowered_text: str | None = None) -> CommReport:
        """Parses optimised HLO (``compiled.as_text()``) and, if given, the StableHLO it came from.

        Args:
          hlo_text: ``compiled.as_text()``: the collectives that run, in ``collectives``.
          reduce_dtype: the engine's ``reduce_dtype``; a narrower dtype widened by
            the backend adds a note.
          lowered_text: ``lowered.as_text()``: the collectives the program asks
            for, before the backend's passes, in ``lowered`` (``computation`` is
            ``"lowered"``, ``in_loop`` False).

        Raises:
          TypeError: if a text is not a str (one without collectives, empty too, gives none), or
            ``reduce_dtype`` not a float dtype or None.
        """
        validate.check_str("hlo_text", hlo_text, empty=True)
        validate.check_str("lowered_text", lowered_text, empty=True, optional=True)
        if reduce_dtype is not None and not checks.is_float_dtype(reduce_dtype):
            raise TypeError(
                f"`reduce_dtype` must be a float dtype such as jnp.bfloat16 (the engine's) or None, got "
                f"reduce_dtype={reduce_dtype!r}."
            )
        computation, found, calls = "", [], {}
        for line in hlo_text.splitlines():
            m = _COMPUTATION.match(line)
            if m and not line[:1].isspace():
                computation = m.group(1)
                calls.setdefault(computation, set())
                continue
            for group in _CALLS.findall(line):
                calls.setdefault(computation, set()).update(n.strip().lstrip("%") for n in group.split(","))
            m = _INSTR.match(line)
            if m:
                operands = tuple(
                    (d, tuple(int(s) for s in dims.split(",") if s)) for d, dims in _ARRAY.findall(m.group(1))
                )
                nbytes = sum(_DTYPE_BYTES.get(d, 4) * int(np.prod(shape, dtype=np.int64)) for d, shape in operands)
                found.append((m.group(2), computation, operands, nbytes, _group_size(line)))
        looped = _loop_computations(hlo_text, calls)
        collectives = tuple(Collective(op, c, c in looped, ops, nb, n) for op, c, ops, nb, n in found)
        lowered = _lowered_collectives(lowered_text) if lowered_text is not None else ()
        notes = ()
        if reduce_dtype is not None and np.dtype(reduce_dtype).itemsize < 4:
            if any(c.op.startswith("all-reduce") and "f32" in c.dtypes for c in collectives):
                notes = (MSG_CPU_BF16,)
        return cls(collectives, notes, lowered)

    def count(self, op: str = "all-reduce") -> int:
        """The number of ops named ``op`` (one of ``COLLECTIVES``; async ``-start`` forms included)."""
        _check_op(op)
        return sum(c.op in (op, f"{op}-start") for c in self.collectives)

    def nbytes(self, op: str = "all-reduce") -> int:
        """The bytes moved per device by ops named ``op`` (one of ``COLLECTIVES``; per execution of each op)."""
        _check_op(op)
        return sum(c.nbytes for c in self.collectives if c.op in (op, f"{op}-start"))

    def wire_bytes(self, op: str | None = None) -> float:
        """Bytes each device sends, by the ring algorithm (``Collective.wire_bytes``), over the ops named ``op``
        or all ops; a reduce-scatter and an all-gather of ``S`` bytes send together what an all-reduce of ``S``
        sends.

        Raises:
          ValueError: if an op's group size is not in the HLO, or ``op`` is not one of ``COLLECTIVES`` or None.
        """
        if op is not None:
            _check_op(op)
        chosen = [c for c in self.collectives if op is None or c.op in (op, f"{op}-start")]
        unknown = [c.op for c in chosen if c.wire_bytes is None]
        if unknown:
            raise ValueError(f"The HLO gives no replica groups for {unknown[0]}, so its bytes sent are unknown.")
        return float(sum(c.wire_bytes or 0.0 for c in chosen))

    def table(self) -> str:
        rows = [("op", "where", "operands", "dtypes", "bytes", "group", "sent (ring)")]
        for c in self.collectives:
            where = f"{c.computation}{' (loop)' if c.in_loop else ''}"
            sent = "?" if c.wire_bytes is None else f"{c.wire_bytes:,.0f}"
            group = "?" if c.group_size is None else str(c.group_size)
            rows.append((c.op, where, str(len(c.operands)), ",".join(c.dtypes), f"{c.nbytes:,}", group, sent))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        sent = sum(c.wire_bytes or 0.0 for c in self.collectives)
        lines.append(
            f"total: {len(self.collectives)} collective(s), {sum(c.nbytes for c in self.collectives):,} bytes, "
            f"{sent:,.0f} bytes sent per device"
        )
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def __str__(self) -> str:
        return self.table()


def check_platform(platform: object) -> None:
    if not isinstance(platform, str) or platform not in PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {', '.join(repr(p) for p in PLATFORMS)} (JAX's names; 'gpu' is 'cuda' or "
            f"'rocm'), got platform={platform!r}."
        )


def lower_for(jitted, args: tuple, platform: str):
    """``jitted`` (a ``jax.jit`` function) traced on ``args`` and lowered for ``platform``, with no device of it
    here (``jax.stages.Lowered``; ``as_text()`` is its StableHLO).

    Raises:
      ValueError: if ``platform`` is unknown, or the program holds an operation with no lowering for it (a
        CPU-only primitive such as ``mpi4jax``'s), naming both.
    """
    check_platform(platform)
    traced = jitted.trace(*args)  # the user's errors in tracing are theirs, raised as they are
    try:
        return traced.lower(lowering_platforms=(platform,))
    except (NotImplementedError, ValueError) as error:
        # JAX: "MLIR translation rule for primitive 'x' not found for platform y" (NotImplementedError); a host
        # callback lowered for another platform than this machine's: "the platform for the specified backend cpu
        # is different from the lowering platform cuda" (ValueError).
        raise ValueError(
            f"The program cannot be lowered for platform={platform!r}: {error}. An operation in it (the loss, a "
            "hook, a transport) exists only for another platform."
        ) from error


def _check_op(op: object) -> None:
    if not isinstance(op, str) or op not in COLLECTIVES:
        raise ValueError(f"`op` must be one of {', '.join(repr(c) for c in COLLECTIVES)}, got op={op!r}.")


def _lowered_collectives(text: str) -> tuple[Collective, ...]:
    """The collective ops of StableHLO text with their operand types (from each op's signature)."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = _LOWERED_OP.search(line)
        if not m:
            continue
        signature = _SIGNATURE.search(line[m.end() :])
        if signature is None:  # an op with a region (all_reduce): the signature follows the region's `})`
            indent = len(line) - len(line.lstrip())
            closing = next(
                (x for x in lines[i + 1 :] if len(x) - len(x.lstrip()) == indent and x.lstrip().startswith("})")), ""
            )
            signature = _SIGNATURE.search(closing)
        operands = []
        for dims, dtype in _TENSOR.findall(signature.group(1) if signature else ""):
            operands.append((_MLIR_DTYPES.get(dtype, dtype), tuple(int(d) for d in dims.split("x") if d)))
        nbytes = sum(_DTYPE_BYTES.get(d, 4) * int(np.prod(shape, dtype=np.int64)) for d, shape in operands)
        found.append(Collective(m.group(1).replace("_", "-"), "lowered", False, tuple(operands), nbytes))
    return tuple(found)


def _group_size(line: str) -> int | None:
    """The size of a collective's replica groups, from any of XLA's three spellings (a list of groups, an iota
    ``[groups,size]<=[...]``, or mesh axes ``mesh['a'=8,'b'=1] {'a'}``)."""
    m = _GROUPS_LIST.search(line)
    if m:
        return len([d for d in m.group(1).split(",") if d])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in (a.split("=") for a in m.group(1).split(",") if "=" in a)}
        names = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
        return int(np.prod([sizes[a] for a in names], dtype=np.int64)) if all(a in sizes for a in names) else None
    return None


def _loop_computations(hlo_text: str, calls: dict[str, set[str]]) -> set[str]:
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo_text))
    looped, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name not in looped:
            looped.add(name)
            todo.extend(calls.get(name, ()))
    return looped

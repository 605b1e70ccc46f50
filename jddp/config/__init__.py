"""Typed run configs: a dataclass schema, a YAML file and ``key=value`` overrides, checked before any JAX work.

    @dataclasses.dataclass(frozen=True)
    class Config:
        epochs: int = 30          # passes over the training set
        learning_rate: float = 3e-3

    config = jddp.config.parse(Config, sys.argv[1:], path="configs/mnist1d.yaml")

Sources, later wins: the dataclass defaults, the YAML file (``path``, or
``config=FILE`` on the command line), then ``key=value`` overrides (dotted
keys reach nested dataclasses: ``model.hidden=128``). OmegaConf structured
configs check every value against the field's type (``"3"`` becomes ``3`` for
an ``int`` field, ``3.5`` does not). Unknown keys, wrong types, a missing or
unreadable file and a malformed override raise ``ConfigError`` naming the key,
the value, the expected type and where it came from (the file, or "command
line"); no OmegaConf exception (``ValidationError``, ``ConfigKeyError``, ...) and
no YAML error reaches the caller. This module imports no JAX, so a bad config
fails in a fraction of a second, before devices, processes or compilation.

Field types: ``int``, ``float``, ``bool``, ``str``, an ``Enum`` (a member's
name, or its value), ``Literal[...]``, a nested dataclass, ``list``/``tuple``/
``dict`` of those, and ``X | None`` / ``Optional[X]`` of any of them. A field
with a non-Optional type and a ``None`` default (minGPT's ``block_size: int =
None``) is read as ``int | None``: the dataclass itself holds None there, so the
config does too.

None is spelled as in YAML: ``key=null`` (or ``~``, or an empty ``key=``) on the
command line, ``key: null`` in a file. The Python spelling ``None`` is the string
``"None"``: the value of a ``str`` field, and a ``ConfigError`` (that says to
write ``null``) for any other type. ``nan``, ``inf`` are floats.

This package's modules hold one job each: ``parsing`` (``parse``: the sources in order, each checked), ``merging``
(the merge into the schema's OmegaConf config, and the key a failed merge blames), ``files`` (the YAML file read,
``to_yaml`` and ``save``), ``schema`` (the fields' types as OmegaConf checks them), ``fields`` (``run_field`` and
the ``FINGERPRINT`` metadata key) and ``errors`` (``ConfigError`` and what its messages share).
"""

from jddp.config.errors import COMMAND_LINE, ConfigError
from jddp.config.fields import FINGERPRINT, run_field
from jddp.config.files import save, to_yaml
from jddp.config.parsing import FILE_KEY, parse

__all__ = [
    "COMMAND_LINE",
    "FILE_KEY",
    "FINGERPRINT",
    "ConfigError",
    "parse",
    "run_field",
    "save",
    "to_yaml",
]

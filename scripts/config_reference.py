"""Writes the reference of every cluster config key from the config dataclasses, so it cannot drift:
`python scripts/config_reference.py [--check FILE | --write FILE]`.

Each key of `ClusterConfig` (common/config.py) is listed with its dotted name, type, default and
description; nested sections (prefill / decode pools, router, admission, controller, planner) are
walked field by field, and `decode.speculative_config` lists the keys of `SpeculativeConfig`
(engine/speculative/config.py). Defaults are the plain-data form `ClusterConfig.from_dict` reads
(what a YAML file holds). A key's description is the source's own comment on that field: the
comment lines directly above it and the trailing `# comment` on its line, joined; a field without a
comment gets an empty description. Where a comment names a module constant of choices
(`one of ROUTING_POLICIES`), the choices follow the name.

With no option the markdown goes to stdout. `--check FILE` exits 1, naming the difference, when the
block of FILE between the two marker lines below is not what this script generates; `--write FILE`
replaces that block.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/config_reference.py` from anywhere
    sys.path.insert(0, str(ROOT))

from common.config import ClusterConfig  # noqa: E402

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
# Optional sections that are not walked: the loader refuses any value but null there.
NOT_EXPANDED = frozenset({"prefill.speculative_config"})  # speculative decoding runs on the decode pool
# Annotations whose plain-data (YAML) form differs from the Python type.
TYPE_WORDS = {
    "int": "int",
    "float": "float",
    "str": "string",
    "bool": "bool",
    "None": "null",
    "tuple[PrioritySlo, ...]": "mapping: priority → {ttft_ms, tpot_ms}",
}


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted, e.g. "router.port"
    type: str
    default: typing.Any  # plain data, as from_dict reads it
    description: str
    section: bool = False  # a nested mapping whose keys follow


def field_comments(cls) -> dict[str, str]:
    """Each field's comment in the class source: the comment lines right above it, then the trailing
    comment of its line(s), joined with a space."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    own_line: dict[int, str] = {}  # row → text of a comment alone on its line
    trailing: dict[int, str] = {}  # row → text of a comment after code
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            text = tok.string.lstrip("#").strip()
            (own_line if not lines[row - 1][:col].strip() else trailing)[row] = text
    found: dict[str, tuple[int, int, int]] = {}  # name → (column, first row, last row)
    line_start = True
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            line_start = line_start or tok.type != tokenize.COMMENT
            continue
        starts, line_start = line_start, False
        if not (starts and tok.type == tokenize.NAME and tok.string in names):
            continue
        if i + 1 >= len(tokens) or tokens[i + 1].string != ":":
            continue
        end = next(t.start[0] for t in tokens[i:] if t.type == tokenize.NEWLINE)
        known = found.get(tok.string)
        if known is None or tok.start[1] < known[0]:  # the class body's own level, not a method's
            found[tok.string] = (tok.start[1], tok.start[0], end)
    comments = {}
    for name, (_, first, last) in found.items():
        above = []
        row = first - 1
        while row in own_line:
            above.insert(0, own_line[row])
            row -= 1
        after = [trailing[r] for r in range(first, last + 1) if r in trailing]
        text = " ".join(above + after)
        comments[name] = _with_constants(text, cls)
    return comments


def _dataclass_of(hint) -> type | None:
    """The dataclass a field holds (also through `X | None`), else None. A tuple of dataclasses
    (`admission.priority_slos`) is a leaf: its plain-data form is a mapping of its own."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _with_constants(text: str, cls) -> str:
    """A comment naming a module constant of choices (`one of ROUTING_POLICIES`) gets its values."""
    module = sys.modules[cls.__module__]

    def spell(match: re.Match) -> str:
        value = getattr(module, match.group(0), None)
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            return f"{match.group(0)} ({', '.join(value)})"
        return match.group(0)

    return re.sub(r"\b[A-Z][A-Z0-9_]{2,}\b", spell, text)


def _type_words(annotation: str) -> str:
    if annotation in TYPE_WORDS:
        return TYPE_WORDS[annotation]
    parts = [part.strip() for part in annotation.split("|")]
    if len(parts) > 1:
        return " | ".join(_type_words(part) for part in parts)
    return annotation


def walk(cls, plain: dict, prefix: str = "") -> list[Key]:
    """Keys of `cls` (a config dataclass) and of its nested sections, in field order; `plain` holds the
    defaults as plain data."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    keys: list[Key] = []
    sections: list[tuple[str, type, dict]] = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        nested = _dataclass_of(hints[f.name])
        default = plain.get(f.name)
        if nested is not None and name not in NOT_EXPANDED:
            if default is None:  # an optional section, off by default: its keys take the class's defaults
                inner = nested()
                shown = inner.to_dict() if hasattr(inner, "to_dict") else dataclasses.asdict(inner)
                type_words = "mapping | null"
            else:
                shown, type_words = default, "mapping"
            keys.append(Key(name, type_words, default, comments.get(f.name, ""), section=True))
            sections.append((name, nested, shown))
            continue
        annotation = str(f.type)
        type_words = "mapping | null" if nested is not None else _type_words(annotation)
        keys.append(Key(name, type_words, default, comments.get(f.name, "")))
    for name, nested, shown in sections:
        keys.extend(walk(nested, shown, name + "."))
    return keys


def all_keys() -> list[Key]:
    """Every key of the cluster config, sections first-level keys included."""
    return walk(ClusterConfig, ClusterConfig().to_dict())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(key: Key) -> str:
    if key.section and key.default is not None:
        return "(section)"
    return "`" + json.dumps(key.default, ensure_ascii=False) + "`"


def render(keys: list[Key] | None = None) -> str:
    """The markdown reference: one table of the top-level keys, then one per section."""
    keys = all_keys() if keys is None else keys
    groups: dict[str, list[Key]] = {"": []}
    headings: dict[str, Key] = {}
    for key in keys:
        if key.section:
            headings[key.name] = key
        parent = key.name.rsplit(".", 1)[0] if "." in key.name else ""
        groups.setdefault(parent, []).append(key)
    out = [
        "<!-- generated by scripts/config_reference.py from the config dataclasses: do not edit by hand -->",
        "",
    ]
    for group, members in groups.items():
        if group:
            section = headings[group]
            out.append(f"#### `{group}`")
            out.append("")
            if section.description:  # a sentence of its own here
                text = section.description
                out.append(text[:1].upper() + text[1:] + ("" if text.endswith(".") else "."))
                out.append("")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        out.extend(
            f"| `{key.name}` | {_cell(key.type)} | {_cell(_default(key))} | {_cell(key.description)} |"
            for key in members
        )
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _split(text: str, path: Path) -> tuple[str, str, str]:
    """(before, block, after) around the markers; ValueError naming what is missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"{path}: needs the marker lines {START} and {END}, in that order")
    head = text[: start + len(START)]
    return head, text[len(head) : end], text[end:]


def check(path: Path) -> int:
    try:
        _, block, _ = _split(path.read_text(encoding="utf-8"), path)
    except (OSError, ValueError) as err:
        print(f"config_reference: {err}", file=sys.stderr)
        return 1
    want = "\n" + render() + "\n"
    if block == want:
        return 0
    diff = difflib.unified_diff(
        block.splitlines(), want.splitlines(), f"{path} (in the file)", "generated", lineterm="", n=0
    )
    print(f"config_reference: the config reference in {path} is stale; the difference:", file=sys.stderr)
    print("\n".join(diff), file=sys.stderr)
    print(f"run: python scripts/config_reference.py --write {path}", file=sys.stderr)
    return 1


def write(path: Path) -> int:
    try:
        head, _, tail = _split(path.read_text(encoding="utf-8"), path)
    except (OSError, ValueError) as err:
        print(f"config_reference: {err}", file=sys.stderr)
        return 1
    path.write_text(head + "\n" + render() + "\n" + tail, encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", type=Path, metavar="FILE", help="exit 1 when FILE's generated block is stale")
    mode.add_argument("--write", type=Path, metavar="FILE", help="rewrite FILE's generated block")
    args = parser.parse_args(argv)
    if args.check is not None:
        return check(args.check)
    if args.write is not None:
        return write(args.write)
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The user docs (README.md, CONTRIBUTING.md, docs/*.md) hold up against the repository: their shell and
Python blocks parse, their relative links and anchors resolve, and the repository paths and dotted
module names they quote in backticks exist. Nothing heavy is imported: modules are found on disk and
their attributes read from the source with `ast`."""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "CONTRIBUTING.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

PACKAGES = (
    "engine",
    "cluster",
    "common",
    "router",
    "policies",
    "sim",
    "prefix_index",
    "splitserve_client",
    "kvtransfer",
    "prefill_worker",
    "decode_worker",
    "loadtest",
    "splitserve",
    "benchmarks",
)
FILE_SUFFIXES = (
    ".py",
    ".pyi",
    ".md",
    ".yaml",
    ".yml",
    ".json",
    ".jsonl",
    ".proto",
    ".sh",
    ".txt",
    ".tpl",
    ".toml",
    ".c",
    ".h",
    ".csv",
    ".gz",
    ".cfg",
    ".ini",
)
SHELL_LANGS = {"sh", "bash", "shell", "console"}
PLACEHOLDER = re.compile(r"[<>*{}]|\.\.\.")

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+(?:\(\))?$")


@dataclass(frozen=True)
class Block:
    path: str
    line: int  # of the opening fence
    lang: str
    text: str


@dataclass(frozen=True)
class Doc:
    path: str
    blocks: tuple[Block, ...]
    prose: tuple[tuple[int, str], ...]  # (line number, text) outside fenced blocks


@functools.cache
def parse(path: str) -> Doc:
    blocks, prose = [], []
    fence = None  # (marker, lang, start line, lines)
    for number, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            opened = FENCE.match(line)
            if opened:
                fence = (opened["fence"], opened["lang"].lower(), number, [])
            else:
                prose.append((number, line))
        elif line.strip().startswith(fence[0][0] * len(fence[0])) and not line.strip().strip(fence[0][0]):
            blocks.append(Block(path, fence[2], fence[1], "\n".join(fence[3]) + "\n"))
            fence = None
        else:
            fence[3].append(line)
    assert fence is None, f"{path}:{fence[2]}: unclosed code block"
    return Doc(path, tuple(blocks), tuple(prose))


def code_spans(doc: Doc):
    for number, line in doc.prose:
        for match in CODE_SPAN.finditer(line):
            yield number, match.group(2).strip()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation but `-` and `_` dropped,
    spaces to `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(path: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in parse(path).prose:
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def strip_prompts(text: str, always: bool) -> str:
    """A console transcript's commands: lines after a `$ ` prompt (and their `\\` continuations)."""
    lines = text.splitlines()
    if not always and not any(line.startswith("$ ") for line in lines):
        return text
    kept, continued = [], False
    for line in lines:
        if line.startswith("$ ") or continued:
            kept.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.rstrip().endswith("\\")
        else:
            kept.append("")  # output: keeps line numbers
    return "\n".join(kept) + "\n"


def test_shell_blocks_parse():
    failures = []
    for path in DOCS:
        for block in parse(path).blocks:
            if block.lang not in SHELL_LANGS:
                continue
            script = strip_prompts(block.text, always=block.lang == "console")
            result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
            if result.returncode != 0:
                failures.append(f"{path}:{block.line}: ```{block.lang} block: {result.stderr.strip()}")
    assert not failures, "\n".join(failures)


def test_python_blocks_parse():
    failures = []
    for path in DOCS:
        for block in parse(path).blocks:
            if block.lang not in {"python", "py", "pycon"}:
                continue
            text = block.text
            if block.lang == "pycon" or text.lstrip().startswith(">>>"):
                text = "\n".join(line[4:] for line in text.splitlines() if line.startswith((">>> ", "... ")))
            try:
                ast.parse(text)
            except SyntaxError as err:
                failures.append(f"{path}:{block.line + (err.lineno or 0)}: ```python block: {err.msg}")
    assert not failures, "\n".join(failures)


def _check_target(source: str, target: str) -> str | None:
    """Why a relative `target` (a path, `path#anchor` or `#anchor`) quoted in `source` is broken, or None."""
    file_part, _, anchor = target.partition("#")
    file = (ROOT / source).parent / file_part if file_part else ROOT / source
    if not file.exists():
        return f"{file_part} does not exist"
    if anchor and file.suffix == ".md":
        relative = str(file.resolve().relative_to(ROOT))
        if anchor not in anchors(relative):
            return f"{relative} has no heading #{anchor}"
    return None


def test_relative_links_resolve():
    failures = []
    for path in DOCS:
        for number, line in parse(path).prose:
            line = CODE_SPAN.sub("", line)
            for match in LINK.finditer(line):
                target = match["target"].strip("<>")
                if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto: ...
                    continue
                problem = _check_target(path, target)
                if problem:
                    failures.append(f"{path}:{number}: link ({target}): {problem}")
    assert not failures, "\n".join(failures)


@functools.cache
def top_level() -> frozenset[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(line.split("/")[0] for line in out.splitlines() if "/" in line)


def looks_like_repo_path(token: str) -> bool:
    if "/" not in token or PLACEHOLDER.search(token) or "://" in token or token.startswith(("/", "~", "$", "-")):
        return False
    bare = token.partition("#")[0]
    return bare.endswith("/") or bare.endswith(FILE_SUFFIXES) or bare.split("/")[0] in top_level()


def test_backticked_paths_exist():
    failures = []
    for path in DOCS:
        for number, span in code_spans(parse(path)):
            for token in span.split():
                token = token.strip("'\",;()")
                if looks_like_repo_path(token):
                    anchor = token.partition("#")[2]
                    problem = _check_target("README.md", token.lstrip("./") if token.startswith("./") else token)
                    if problem and not anchor:
                        problem = f"`{token}` does not exist"
                    if problem:
                        failures.append(f"{path}:{number}: {problem}")
    assert not failures, "\n".join(failures)


# --- dotted names -----------------------------------------------------------------------------------


def find_module(dotted: str) -> Path | None:
    """The file of module `dotted` in this repository, found without importing anything."""
    search, origin = [str(ROOT)], None
    for part in dotted.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None or spec.origin is None:
            return None
        origin = Path(spec.origin)
        search = list(spec.submodule_search_locations or [])
        if ROOT not in origin.parents:
            return None
    return origin


@functools.cache
def module_tree(file: Path) -> ast.Module:
    return ast.parse(file.read_text(encoding="utf-8"))


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound by a module or class body, with the node that binds each."""
    found: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                found[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            found.update(_names(node.body + node.orelse + getattr(node, "finalbody", [])))
    return found


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }


def resolves(dotted: str, depth: int = 0) -> bool:
    """Whether `dotted` names a module of the repository or an attribute defined in one (followed through
    `from x import y` re-exports; a class's inherited attributes cannot be told without importing)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        file = find_module(".".join(parts[:cut]))
        if file is not None:
            break
    else:
        return False
    rest = parts[cut:]
    body: list[ast.stmt] = module_tree(file).body
    owner: ast.ClassDef | None = None
    for index, name in enumerate(rest):
        last = index == len(rest) - 1
        node = _names(body).get(name)
        if node is None:
            if owner is None:
                return False
            return (last and name in _instance_attributes(owner)) or bool(owner.bases)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and depth < 5:
            imported = next(a.name for a in node.names if (a.asname or a.name) == name)
            return resolves(".".join([node.module, imported, *rest[index + 1 :]]), depth + 1)
        if not isinstance(node, ast.ClassDef):
            return True  # a function or a value: its own attributes are past what the source tells
        owner, body = node, node.body
    return True


@functools.cache
def config_keys() -> frozenset[str]:
    """The dotted cluster config keys of docs/serving.md's generated reference (held to the config classes
    by tests/test_config_reference.py)."""
    text = (ROOT / "docs/serving.md").read_text(encoding="utf-8")
    reference = text.partition("<!-- config-reference:start -->")[2].partition("<!-- config-reference:end -->")[0]
    return frozenset(re.findall(r"^\| `([\w.]+)` \|", reference, re.M))


@functools.cache
def chart_values() -> dict:
    return yaml.safe_load((ROOT / "deploy/helm/splitserve/values.yaml").read_text(encoding="utf-8"))


def is_chart_value(dotted: str) -> bool:
    node = chart_values()
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@functools.cache
def proto_packages() -> frozenset[str]:
    return frozenset(
        match
        for file in ROOT.glob("splitserve_client/protocol/*.proto")
        for match in re.findall(r"^package\s+([\w.]+);", file.read_text(encoding="utf-8"), re.M)
    )


def names_something(dotted: str) -> bool:
    return dotted in config_keys() or is_chart_value(dotted) or dotted in proto_packages() or resolves(dotted)


def test_backticked_module_names_resolve():
    failures = []
    for path in DOCS:
        for number, span in code_spans(parse(path)):
            tokens = span.split()
            candidates = [span] if DOTTED.match(span) else []
            # `python -m module ...` in an inline command; `-m benchmarks.NAME`: a placeholder, like `--config FILE`
            candidates += [
                tokens[i + 1]
                for i, token in enumerate(tokens[:-1])
                if token == "-m" and not any(part.isupper() for part in tokens[i + 1].split("."))
            ]
            for dotted in candidates:
                dotted = dotted.removesuffix("()")
                if dotted.endswith(FILE_SUFFIXES) or PLACEHOLDER.search(dotted):
                    continue
                if not names_something(dotted):
                    failures.append(f"{path}:{number}: `{dotted}` is no module, attribute or config key")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("## KV hand-off", "kv-hand-off"),
        ("### The `splitserve` command", "the-splitserve-command"),
        (
            "### Serving processes: flags shared by serve, controller and router",
            "serving-processes-flags-shared-by-serve-controller-and-router",
        ),
        ("#### `decode.speculative_config`", "decodespeculative_config"),
    ],
)
def test_slug_follows_github(heading, anchor):
    assert slug(HEADING.match(heading)[2]) == anchor


def test_the_resolvers_tell_real_names_from_made_up_ones():
    assert resolves("kvtransfer.session.HandoffSession")
    assert resolves("kvtransfer.session.HandoffSession.run")
    assert resolves("kvtransfer.handoff.MESSAGE_BYTES")
    assert not resolves("kvtransfer.session.NoSuchThing")
    assert not resolves("kvtransfer.no_such_module")
    assert names_something("router.migration_limit")  # a config key
    assert names_something("router.service.port")  # a Helm value
    assert not names_something("router.no_such_key")
    assert looks_like_repo_path("deploy/helm/splitserve") and not looks_like_repo_path("nvidia.com/gpu")

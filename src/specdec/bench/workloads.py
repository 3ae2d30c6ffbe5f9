"""Benchmark prompts: built-in workloads cut from held-out stdlib files, or the user's own.

* ``code``: continue a held-out file from a cut point at a line start (`heldout_prompts`). The answer is
  new code, so only a draft model that predicts the target well helps.
* ``edit``: a function from a held-out file, then an instruction comment asking for the same function with
  one argument renamed, then the renamed ``def`` line. The right continuation is the function body again
  with one name changed: most of it is a copy of the prompt, which is where prompt lookup shines.

* ``agent``: an agent's sessions of tool calls on held-out functions. Every request starts with the same tool
  preamble, then a task (rename one argument of a function), the log of the earlier attempts (their
  `run_tests` failures), the `read_function` call and its result, and this attempt's `write_function` call and
  renamed ``def`` line. A session is AGENT_TURNS attempts at one task: each request repeats the one before with one more log
  line, as an agent's retries do, so the answer repeats the earlier answers, which are not in the prompt. The
  bench runs the requests in order: a drafter that keeps earlier requests (SuffixDecoding's cache) sees them.

Held-out files are never seen in training (`specdec.training.corpus`). Everything here is deterministic
for a given tokenizer, count and seed.
"""

from __future__ import annotations

import ast
import io
import json
import random
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.errors import ConfigError, PromptError

BUILTIN_WORKLOADS = ("code", "edit", "agent")

#: Token length of ``code`` prompts unless told otherwise.
DEFAULT_PROMPT_TOKENS = 128
#: Function sizes (in source lines) eligible for ``edit`` prompts.
EDIT_MIN_LINES, EDIT_MAX_LINES = 6, 40


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt. `expected` is the text the continuation should contain, when known
    (for ``edit``: the renamed function after its first line)."""

    name: str
    ids: list[int]
    text: str
    source: str = ""
    expected: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "num_tokens": len(self.ids), "text": self.text,
                "expected": self.expected, **({"meta": self.meta} if self.meta else {})}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except Exception:  # noqa: BLE001 (a duck-typed tokenizer without that keyword)
        return tokenizer.decode(ids)


# --------------------------------------------------------------------------------------------- code


def code_prompts(tokenizer: Any, n: int, prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
                 seed: int = 0) -> list[BenchPrompt]:
    """`n` prompts of exactly `prompt_tokens` tokens, each a held-out file cut at a line start."""
    from specdec.training.corpus import heldout_prompts

    id_lists = heldout_prompts(tokenizer, n, prompt_tokens, seed)
    return [BenchPrompt(name=f"code-{i}", ids=list(ids), text=_decode(tokenizer, list(ids)),
                        source="held-out stdlib file, cut at a line start") for i, ids in enumerate(id_lists)]


# --------------------------------------------------------------------------------------------- edit


def rename_identifier(source: str, old: str, new: str) -> str:
    """`source` with every name token `old` (not an attribute ``.old``, not a keyword argument ``old=`` in
    a call) replaced by `new`; strings and comments are left alone."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out = []
    depth = 0  # bracket depth, to tell a keyword argument `f(old=1)` from an assignment `old = 1`
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type == tokenize.NAME and tok.string == old:
            prev = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.COMMENT)), None)
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            is_attr = prev is not None and prev.type == tokenize.OP and prev.string == "."
            is_kwarg = (depth > 0 and nxt is not None and nxt.type == tokenize.OP and nxt.string == "="
                        and prev is not None and prev.string in ("(", ",") and not _in_def_header(tokens, i))
            if not is_attr and not is_kwarg:
                tok = tok._replace(string=new)
        out.append(tok)
    return tokenize.untokenize(out) if out else source


def _in_def_header(tokens: list, i: int) -> bool:
    """True when token i sits in the parameter list of a `def` (where `old=default` is the parameter)."""
    for t in reversed(tokens[:i]):
        if t.type == tokenize.NAME and t.string in ("def", "lambda"):
            return True
        if t.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) or (
                t.type == tokenize.OP and t.string == ":"):
            return False
    return False


def _edit_candidates(path: Path) -> list[tuple[str, str, str, int]]:
    """(function source dedented, argument name, renamed source, line number) for each eligible function."""
    from specdec.training.corpus import read_text

    text = read_text(path)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        size = node.end_lineno - node.lineno + 1
        if not EDIT_MIN_LINES <= size <= EDIT_MAX_LINES:
            continue
        source = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno]))
        if "\t" in source or not source.strip():
            continue
        args = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
                if a.arg not in ("self", "cls") and len(a.arg) >= 2]
        uses = {a: sum(isinstance(n, ast.Name) and n.id == a for n in ast.walk(node)) for a in args}
        args = [a for a in args if uses[a] >= 2]  # renaming must change the body, not just the header
        if not args:
            continue
        arg = max(args, key=lambda a: (uses[a], a))
        try:
            renamed = rename_identifier(source, arg, f"new_{arg}")
        except (tokenize.TokenError, IndentationError, SyntaxError):
            continue
        if renamed == source:
            continue
        found.append((source, arg, renamed, node.lineno))
    return found


def edit_prompt_text(source: str, old: str, new: str, renamed: str) -> tuple[str, str]:
    """(prompt, expected continuation) for one function: the source, an instruction comment, and the
    first line of the renamed function; the expected answer is the rest of the renamed function."""
    first, _, rest = renamed.partition("\n")
    prompt = f"{source.rstrip()}\n\n\n# The same function, with the argument `{old}` renamed to `{new}`:\n{first}\n"
    return prompt, rest


def edit_prompts(tokenizer: Any, n: int, seed: int = 0, max_prompt_tokens: int = 512,
                 root: Path | None = None) -> list[BenchPrompt]:
    """`n` edit-style prompts from held-out files (one function per file before reusing a file)."""
    if root is None:
        from specdec.training.corpus import stdlib_files, stdlib_root

        files, base = stdlib_files("heldout"), stdlib_root()
    else:
        files, base = sorted(root.rglob("*.py")), root
    per_file = []
    for path in files:
        candidates = _edit_candidates(path)
        if candidates:
            per_file.append((path.relative_to(base).as_posix(), candidates))
    rng = random.Random(seed)
    for _, candidates in per_file:
        rng.shuffle(candidates)
    rng.shuffle(per_file)
    # Round-robin over files so n prompts come from as many different files as possible.
    ordered = [(rel, c) for i in range(max((len(c) for _, c in per_file), default=0))
               for rel, cands in per_file if i < len(cands) for c in [cands[i]]]
    prompts: list[BenchPrompt] = []
    for rel, (source, arg, renamed, lineno) in ordered:
        if len(prompts) == n:
            break
        text, expected = edit_prompt_text(source, arg, f"new_{arg}", renamed)
        ids = _encode(tokenizer, text)
        if not ids or len(ids) > max_prompt_tokens:
            continue
        prompts.append(BenchPrompt(name=f"edit-{len(prompts)}", ids=ids, text=text, source=f"{rel}:{lineno}",
                                   expected=expected, meta={"renamed": [arg, f"new_{arg}"]}))
    if len(prompts) < n:
        raise ConfigError(
            f"only {len(prompts)} edit prompts of at most {max_prompt_tokens} tokens could be built from the "
            f"held-out files; ask for fewer (--num-prompts {len(prompts)})"
        )
    return prompts


# --------------------------------------------------------------------------------------------- agent

#: Turns per ``agent`` session (requests on one task), the longest function a task edits (source lines), and the
#: preamble every request starts with.
AGENT_TURNS = 4
AGENT_MAX_LINES = 24
AGENT_PREAMBLE = """\
# Agent log. Tools:
#   read_function(path, name) -> the function's source
#   write_function(path, name) followed by the new source: replaces the function
#   run_tests(path) -> "ok" or the failures
# The agent writes the function until the tests pass.
"""


def agent_turn_text(rel: str, name: str, source: str, old: str, new: str, renamed: str,
                    failures: list[str]) -> str:
    """One request of a session: the preamble, the task, the log of the earlier attempts (one line each, their
    test failures), the `read_function` call and its result, and this attempt's `write_function` call and
    renamed ``def`` line."""
    first = renamed.partition("\n")[0]
    log = "".join(f"# attempt {i}: write_function({rel!r}, {name!r}); run_tests({rel!r}) -> {failure}\n"
                  for i, failure in enumerate(failures, 1))
    return (f"{AGENT_PREAMBLE}# Task: rename argument `{old}` to `{new}` in {name}() of {rel}\n{log}"
            f"read_function({rel!r}, {name!r})\n{source.rstrip()}\n\n"
            f"write_function({rel!r}, {name!r})\n{first}")  # no newline: the tokenizer joins it with the indent


def agent_prompts(tokenizer: Any, n: int, seed: int = 0, max_prompt_tokens: int = 512,
                  root: Path | None = None) -> list[BenchPrompt]:
    """`n` requests, AGENT_TURNS per session in session order: one function of a held-out file per session (one
    session per file), turn k its k-th attempt, the failures of attempts 1..k-1 in its log."""
    if root is None:
        from specdec.training.corpus import stdlib_files, stdlib_root

        files, base = stdlib_files("heldout"), stdlib_root()
    else:
        files, base = sorted(root.rglob("*.py")), root
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    prompts: list[BenchPrompt] = []
    for path in files:
        if len(prompts) >= n:
            break
        candidates = [c for c in _edit_candidates(path) if c[0].count("\n") <= AGENT_MAX_LINES]
        if not candidates:
            continue
        source, arg, renamed, lineno = rng.choice(candidates)
        rel = path.relative_to(base).as_posix()
        name = source.split("(", 1)[0].split()[-1]
        tests = [f"test_{name.strip('_')}", f"test_{arg}", "test_defaults", "test_roundtrip"]
        failures: list[str] = []
        session = []
        for turn in range(1, AGENT_TURNS + 1):
            text = agent_turn_text(rel, name, source, arg, f"new_{arg}", renamed, failures)
            ids = _encode(tokenizer, text)
            if len(ids) > max_prompt_tokens:
                break
            session.append(BenchPrompt(name=f"agent-{len(prompts) + len(session)}", ids=ids, text=text,
                                       source=f"{rel}:{lineno} (turn {turn})",
                                       expected=renamed.partition("\n")[2],
                                       meta={"renamed": [arg, f"new_{arg}"], "turn": turn}))
            failures.append(f"FAILED {rng.choice(tests)} ({rng.randint(1, 3)} of {rng.randint(8, 40)})")
        if len(session) == AGENT_TURNS:
            prompts.extend(session[: n - len(prompts)])
    if len(prompts) < n:
        raise ConfigError(f"only {len(prompts)} agent requests of at most {max_prompt_tokens} tokens could be built "
                          f"from the held-out files; ask for fewer (--num-prompts {len(prompts)})")
    return prompts


# --------------------------------------------------------------------------------------------- user files


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL (objects with a "prompt" field; for multi-line prompts) when the file ends
    in .jsonl or its first non-blank line starts with "{", otherwise one prompt per non-blank line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts from {str(path)!r}: {exc.strerror or exc}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix == ".jsonl" or (lines and lines[0].lstrip().startswith("{")):
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f'{path}:{number}: each JSONL line needs a string field "prompt"')
            prompts.append(obj["prompt"])
    else:
        prompts = lines
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def user_prompts(tokenizer: Any, texts: list[str], source: str = "user") -> list[BenchPrompt]:
    from specdec.engine.text import encode_prompt

    out = []
    for i, text in enumerate(texts):
        ids = encode_prompt(tokenizer, text)
        if not ids:
            raise PromptError(f"prompt {i} of {source} encodes to no tokens")
        out.append(BenchPrompt(name=f"prompt-{i}", ids=list(ids), text=text, source=f"{source}:{i + 1}"))
    return out


def load_workload(spec: str, tokenizer: Any, num_prompts: int, seed: int = 0,
                  prompt_tokens: int = DEFAULT_PROMPT_TOKENS, max_prompt_tokens: int = 512) -> list[BenchPrompt]:
    """`spec`: "code", "edit", "agent", or a path to a prompt file (then the first `num_prompts` prompts)."""
    if tokenizer is None:
        raise ConfigError("the benchmark prompts are text: the target needs a tokenizer (a directory with "
                          "tokenizer files, or the default pair)")
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {num_prompts}")
    if spec == "code":
        return code_prompts(tokenizer, num_prompts, prompt_tokens, seed)
    if spec == "edit":
        return edit_prompts(tokenizer, num_prompts, seed, max_prompt_tokens)
    if spec == "agent":
        return agent_prompts(tokenizer, num_prompts, seed, max_prompt_tokens)
    if not Path(spec).is_file():
        raise ConfigError(f"--prompts {spec!r} is neither a built-in workload ({', '.join(BUILTIN_WORKLOADS)}) "
                          "nor an existing file")
    return user_prompts(tokenizer, read_prompt_file(spec)[:num_prompts], source=Path(spec).name)

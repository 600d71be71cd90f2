"""The documentation works from a fresh clone: every relative link in README.md, docs/*.md and
cluster/README.md points to a file that exists (and its `#anchor` to a heading in it), and every
`gptrun ...` line in their bash code blocks parses with the real argument parser, with its
`--set` overrides applied to the shipped config it names. Every docs page is linked from the
README, and the README's Layout names every module. Fast: no Ray, no training.

The checkers take a page's text, so the tests at the bottom can show that they do fail on a
broken link, a missing anchor, a misspelled flag and an unknown config key.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from experiments.cli import build_parser
from experiments.ray_config import load_experiment
from experiments.space import parse_space
from gptcore.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "cluster" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh", "shell", "console")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def split_markdown(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The prose (fenced blocks blanked out, line numbers kept) and the fenced blocks as
    (language, body)."""
    prose, blocks = [], []
    fence, lang, body = "", "", []
    for line in text.splitlines():
        match = FENCE.match(line)
        if not fence and match:
            fence, lang, body = match.group(1), match.group(2).lower(), []
            prose.append("")
        elif fence and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((lang, "\n".join(body)))
            fence = ""
            prose.append("")
        elif fence:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, and a
    `-1`, `-2`, ... suffix on repeats."""
    prose, _ = split_markdown(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def link_targets(text: str) -> list[str]:
    """Every link and image target in the prose (not in code blocks or code spans)."""
    prose, _ = split_markdown(text)
    prose = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), prose)
    return [m.group(1) for m in LINK.finditer(prose)] + REFERENCE_LINK.findall(prose)


def broken_links(page: Path, text: str) -> list[str]:
    """The relative links of `page` (whose text is `text`) that lead nowhere."""
    problems = []
    for target in link_targets(text):
        if SCHEME.match(target):  # https:, mailto: ... are not checked here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if path_part and not dest.exists():
            shown = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
            problems.append(f"{target}: {shown} does not exist")
            continue
        if anchor and dest.suffix == ".md":
            dest_text = text if dest == page else dest.read_text(encoding="utf-8")
            if anchor not in anchors(dest_text):
                problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def command_lines(text: str) -> list[str]:
    """The logical lines of the shell code blocks: `\\` continuations joined."""
    _, blocks = split_markdown(text)
    lines = []
    for lang, body in blocks:
        if lang not in SHELL_LANGS:
            continue
        for line in re.sub(r"\\\n", " ", body).splitlines():
            if line.strip():
                lines.append(line.strip().removeprefix("$ "))
    return lines


def gptrun_args(line: str) -> list[list[str]]:
    """The arguments of every gptrun call on a shell line: `gptrun ...`, `.venv/bin/gptrun ...`,
    `VAR=x gptrun ...`, `cmd1 && gptrun ...`, and `ray job submit ... -- gptrun ...`."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)  # comments (#...) are dropped by the lexer
    calls, segment = [], []
    for token in [*tokens, ";"]:
        if token and all(c in lexer.punctuation_chars for c in token):  # ;, &&, |, ...
            while segment and ENV_ASSIGNMENT.match(segment[0]):
                segment.pop(0)
            if "--" in segment and segment.index("--") + 1 < len(segment):
                segment = segment[segment.index("--") + 1 :]
            if segment and segment[0].rsplit("/", 1)[-1] == "gptrun":
                calls.append(segment[1:])
            segment = []
        else:
            segment.append(token)
    return calls


def strict_parser() -> argparse.ArgumentParser:
    """`build_parser()` with abbreviations refused in every subcommand, so that the docs spell
    each flag out (argparse would take `--temp` for `--temperature`)."""
    parser = build_parser()
    parser.allow_abbrev = False
    for action in parser._actions:  # argparse keeps subcommand parsers in this action's choices
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.allow_abbrev = False
    return parser


def bad_commands(text: str) -> list[str]:
    """The gptrun calls in `text`'s shell blocks that the parser rejects, or whose `--set`
    overrides do not apply to the shipped config (experiments/...) they name."""
    problems = []
    for line in command_lines(text):
        for args in gptrun_args(line):
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                    parsed = strict_parser().parse_args(args)
            except SystemExit as exit_:
                if exit_.code:
                    message = stderr.getvalue().strip().splitlines()[-1:] or ["(no message)"]
                    problems.append(f"gptrun {shlex.join(args)}: {message[0]}")
                continue
            problem = config_problem(parsed)
            if problem:
                problems.append(f"gptrun {shlex.join(args)}: {problem}")
    return problems


def config_problem(parsed: argparse.Namespace) -> str:
    """A shipped config named by a command must exist and take its overrides (keys and values
    checked as `gptrun` checks them). Configs that an earlier step writes (best.toml) are not here
    yet, and an override made of a shell variable has no value to check."""
    config = getattr(parsed, "config", None)
    if not config or not config.startswith("experiments/"):
        return ""
    if not (REPO / config).is_file():
        return f"{config} does not exist"
    overrides = [o for o in getattr(parsed, "overrides", []) if "$" not in o]
    try:
        cfg = load_experiment(REPO / config, overrides)
        if parsed.command in ("sweep", "plan"):
            parse_space(cfg)
    except UserError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    problems = broken_links(page, page.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_gptrun_commands_parse(page: Path) -> None:
    problems = bad_commands(page.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_every_page_is_linked_from_the_readme() -> None:
    readme = link_targets((REPO / "README.md").read_text(encoding="utf-8"))
    linked = {(REPO / target.partition("#")[0]).resolve() for target in readme}
    assert [p.name for p in PAGES if p.name != "README.md" and p.resolve() not in linked] == []


def test_the_readme_tour_has_a_command_per_step() -> None:
    """The checks above see the commands at all: the README's tour has one per step."""
    lines = command_lines((REPO / "README.md").read_text(encoding="utf-8"))
    calls = {args[0] for line in lines for args in gptrun_args(line)}
    assert calls >= {"prepare", "train", "sweep", "resume", "report", "sample", "export"}


def layout(readme: str) -> dict[str, str]:
    """The README's Layout block, split by top-level folder: {"gptcore/": its lines, ...}."""
    _, blocks = split_markdown(readme[readme.index("## Layout") :])
    sections: dict[str, str] = {}
    folder = ""
    for line in blocks[0][1].splitlines():
        if line[:1].strip():
            folder = line.split()[0]
        sections[folder] = sections.get(folder, "") + line + "\n"
    return sections


def test_layout_lists_every_module() -> None:
    """README's Layout names every module of gptcore and experiments under its own folder (a
    subpackage's modules on its line), and every shipped config."""
    sections = layout((REPO / "README.md").read_text(encoding="utf-8"))
    missing = []
    for path in [*(REPO / "gptcore").rglob("*.py"), *(REPO / "experiments").rglob("*.py")]:
        parts = path.relative_to(REPO).parts
        if path.name in ("__init__.py", "__main__.py"):
            continue
        text = sections.get(parts[0] + "/", "")
        if len(parts) > 2:  # a subpackage: its line names its modules
            text = "".join(line for line in text.splitlines() if f" {parts[1]}/ " in f" {line} ")
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", text):
            missing.append("/".join(parts))
    for config in (REPO / "experiments" / "configs").glob("*.toml"):
        if not re.search(rf"(?<![\w-]){re.escape(config.stem)}(?![\w-])", sections.get("experiments/", "")):
            missing.append(f"experiments/configs/{config.name}")
    assert missing == []


def test_checkers_find_broken_links_and_anchors() -> None:
    page = REPO / "docs" / "example.md"
    text = (
        "# A page\n\n## Section two\n\n"
        "[ok](../README.md) [ok](#section-two) [ok](../cluster/README.md#security) "
        "[web](https://example.com/x) `[code](nowhere.md)`\n\n"
        "[gone](missing.md) [no anchor](#section-three) ![img](../docs/nope.png)\n"
        "[far](../cluster/README.md#no-such-heading)\n\n"
        "```bash\n# [not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page, text) == [
        "missing.md: docs/missing.md does not exist",
        "#section-three: no heading with anchor #section-three in example.md",
        "../docs/nope.png: docs/nope.png does not exist",
        "../cluster/README.md#no-such-heading: no heading with anchor #no-such-heading in README.md",
    ]


def test_anchors_follow_github() -> None:
    text = "# gptrun\n## Fine-tuning: SFT and LoRA\n## `gptrun report`\n## Notes\n## Notes\n```\n# x\n```\n"
    assert anchors(text) == {"gptrun", "fine-tuning-sft-and-lora", "gptrun-report", "notes", "notes-1"}


def test_checkers_find_bad_commands() -> None:
    text = (
        "```bash\n"
        "gptrun sample run/best.pt --temprature 0.8                # misspelled flag\n"
        "gptrun sample run/best.pt --temp 0.8                      # an abbreviation\n"
        "gptrun train experiments/configs/quickstart.toml --local \\\n"
        "    --set optim.lrr=1e-3                                  # unknown key\n"
        "gptrun train experiments/configs/nope.toml --local\n"
        "gptrun swep x.toml\n"
        "make demo && gptrun report sweeps/demo --out r            # fine\n"
        "ray job submit --address http://h:8265 -- \\\n"
        '    gptrun sweep experiments/configs/quickstart.toml --set "$URL"  # fine\n'
        "```\n"
    )
    problems = bad_commands(text)
    assert len(problems) == 5, problems
    assert "unrecognized arguments: --temprature 0.8" in problems[0]
    assert "unrecognized arguments: --temp 0.8" in problems[1]
    assert "optim.lrr" in problems[2] and "did you mean optim.lr" in problems[2]
    assert "experiments/configs/nope.toml does not exist" in problems[3]
    assert "invalid choice: 'swep'" in problems[4]

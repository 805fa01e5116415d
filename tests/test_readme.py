"""The README as a new user reads it: its Python blocks run as written (in one session, in
order, on the bundled model) and answer their prompts; each command in its shell blocks
names a script that exists or parses with the real CLI parser; the bundled model's
example prompts are answered."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import refusion
from refusion.cli.dispatch import VERBS, build_parser, main
from refusion.decode import EngineConfig
from refusion.settings.recommended import recommended_of

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


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
    assert re.search(r"^req-1 \S", out, flags=re.M)  # the engine's AR request says something


def _commands() -> list[list[str]]:
    """Every command line of the shell blocks (comments, continuations and `#` notes removed)."""
    lines = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(shlex.split(line))
    return lines


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
            assert words[0] in ("scripts/demo.sh", "scripts/test.sh", "source", "accelerate", "torchrun"), (
                words
            )
            continue
        if "..." in argv:  # a placeholder for the flags shown in the line above
            assert argv[0] in VERBS, words  # the verb exists
            continue
        argv = [a.replace("BASE", "some-model").replace("OUT", "out") for a in argv]
        build_parser(argv).parse_args(argv)  # raises SystemExit on an unknown flag


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


def _source_tree() -> str:
    """The annotated tree under the README's "The source" heading."""
    section = README.split("## The source", 1)[1]
    return re.search(r"```\n(.*?)```", section, flags=re.S).group(1)


def test_the_source_tree_names_every_package_and_only_files_that_exist():
    tree = _source_tree()
    package = ROOT / "refusion"
    for sub in sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"  {sub}/" in tree, f"refusion/{sub}/ is missing from the README's source tree"
    for stage in ("model", "decode"):  # the stages whose modules the tree lists one by one
        for module in sorted((package / stage).glob("*.py")):
            if module.name != "__init__.py":
                missing = f"refusion/{stage}/{module.name} is missing from the README's source tree"
                assert module.name in tree, missing
    named = set(re.findall(r"\b([a-z_]+\.py)\b", tree))
    existing = {
        p.name
        for p in [*package.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    }
    unknown = sorted(named - existing)
    assert not unknown, f"the README's source tree names files that do not exist: {unknown}"

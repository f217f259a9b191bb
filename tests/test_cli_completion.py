"""Shell completion (``dpml completion bash|zsh``) in a real bash, and each command's --help: a description line,
and help text on every option (``--json`` included). The expectations are derived from the parser itself, so a
command or option added later is checked without editing this file."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from dpml.cli import STAGE_NAMES, build_parser

PARSER = build_parser()
SUBCOMMANDS: dict[str, argparse.ArgumentParser] = next(
    dict(a.choices) for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)
)


def script(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "completion", shell],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


@pytest.fixture(scope="module")
def bash_script() -> str:
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    return script("bash")


def complete(bash_script: str, *words: str) -> list[str]:
    """What bash offers for the command line ``words`` (the last one being completed), through the function the
    script registered with ``complete``."""
    program = f"""{bash_script}
COMP_WORDS=({" ".join(repr(w) for w in words)})
COMP_CWORD={len(words) - 1}
function=$(complete -p dpml | sed -E 's/.* -F ([^ ]+) .*/\\1/')
"$function"
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_the_commands_complete_from_any_prefix(bash_script: str) -> None:
    assert set(complete(bash_script, "dpml", "")) >= set(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        offered = complete(bash_script, "dpml", name[:2])
        assert name in offered and all(word.startswith(name[:2]) for word in offered), (name, offered)
    assert complete(bash_script, "dpml", "--verbose", "ru") == ["run"]  # a global option before the command


def test_every_option_of_every_command_completes(bash_script: str) -> None:
    for name, sub in SUBCOMMANDS.items():
        options = {s for action in sub._actions for s in action.option_strings if s.startswith("--")}
        assert set(complete(bash_script, "dpml", name, "--")) == options, name


def test_choices_complete_for_positionals_and_option_values(bash_script: str) -> None:
    assert set(complete(bash_script, "dpml", "stage", "")) >= set(STAGE_NAMES)
    assert complete(bash_script, "dpml", "stage", "tr") == ["train"]
    assert complete(bash_script, "dpml", "run", "--engine", "l") == ["local"]
    assert set(complete(bash_script, "dpml", "epsilon", "--neighbouring", "")) == {"add-remove", "replace-one"}
    assert set(complete(bash_script, "dpml", "completion", "")) >= {"bash", "zsh"}


def test_an_option_that_takes_a_path_leaves_it_to_the_shells_file_names(bash_script: str) -> None:
    """No words offered after --params or --out: ``complete -o default`` then completes file names."""
    assert complete(bash_script, "dpml", "run", "--params", "") == []
    assert complete(bash_script, "dpml", "schema", "data.csv", "--out", "") == []
    assert "-o default" in bash_script


def test_zsh_loads_the_script_through_bashcompinit() -> None:
    text = script("zsh")
    assert text.startswith("autoload -U +X bashcompinit && bashcompinit\n") and "complete -o default -F" in text
    if shutil.which("zsh") is None:
        pytest.skip("no zsh on this machine: the script was checked as text only")
    done = subprocess.run(["zsh", "-f", "-c", text + "\ncomplete -p dpml"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "dpml" in done.stdout, done.stderr


def test_an_unknown_shell_is_refused_naming_the_shells() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "completion", "fish"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "fish" in done.stderr and "bash" in done.stderr and "zsh" in done.stderr


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_command_has_a_description_line_and_every_option_a_help_text(name: str) -> None:
    sub = SUBCOMMANDS[name]
    assert sub.description and sub.description.endswith(".") and "\n" not in sub.description
    assert sub.format_help().split("\n\n")[1].strip().startswith(sub.description[:20])
    for action in sub._actions:
        assert action.help, (name, action.option_strings or action.dest)

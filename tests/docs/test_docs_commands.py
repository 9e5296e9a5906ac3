"""The commands the docs show are the commands' own: every flag that README.md and docs/
give ``matrixfsdp train``, ``plan``, ``calibrate``, ``bench`` (and its ``--link``, ``--tp``,
``--ep`` modes), a ``python -m benchmarks.<tool>`` or a ``python -m studies.<study>`` appears
in that command's ``--help``, each option there with its default; and the messages the pages
quote for the rough edges are the ones the command prints. No rank is started."""

from __future__ import annotations

import re

import pytest
from helpers.docs_pages import PAGES, documented, help_options, help_text, refused

from matrixfsdp.__main__ import main


@pytest.mark.parametrize("command", sorted(documented()))
def test_documented_flags_are_in_help_with_defaults(command):
    options = help_options(help_text(command))
    missing = {f: page for f, page in documented()[command].items() if f not in options}
    assert not missing, f"{command} --help lacks flags the docs use: {missing}"
    if not command.startswith(("benchmarks.", "studies.")):  # the tools' own help is theirs
        bare = [o for o, h in options.items() if o != "--help" and "default" not in h]
        assert not bare, f"{command} --help shows no default for {bare}"


def test_rank_count_is_ranks_everywhere_world_size_an_alias():
    """One spelling for the rank count of every command (``--ranks``); the
    other (``--world-size``) still accepted, and said in the help."""
    for command, argv in (("train", ["train", "--world-size", "0"]),
                          ("bench", ["bench", "--world-size", "2", "--replicas", "3"]),
                          ("bench --link", ["bench", "--link", "1", "--world-size", "1"]),
                          ("plan", ["plan", "--world-size", "0"])):
        options = help_options(help_text(command))
        assert "--world-size is another name" in options["--ranks"], command
        with pytest.raises(SystemExit):  # refused by the checks of the value: the alias parsed
            main(argv)


def test_resume_without_checkpoint_names_the_directory_once(tmp_path, capsys):
    out = tmp_path / "empty"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--ranks", "1", "--steps", "2", "--resume", "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--resume: no complete checkpoint in {out}/checkpoints (" in err, err
    assert "checkpoints/checkpoints" not in err


def test_a_misspelt_flag_is_refused_as_the_pages_say(capsys):
    """troubleshooting.md's misspelt flag (``--step 5``): refused by the subcommand's own
    parser, exit 2, with the line the page quotes; never taken for ``--steps`` (argparse's
    abbreviations are off)."""
    shown = refused()
    assert ("troubleshooting.md", "train", "--step 5") in shown, shown
    for page, cmd, args in shown:
        with pytest.raises(SystemExit) as stop:
            main([cmd, *args.split()])
        assert stop.value.code == 2, (page, cmd, args)
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith(f"usage: matrixfsdp {cmd} ")
        assert err[-1] == f"matrixfsdp {cmd}: error: unrecognized arguments: {args}", (page, err[-1])


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/ names a file that exists and, with a
    '#', a heading of that page."""
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)

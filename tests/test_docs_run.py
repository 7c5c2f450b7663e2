"""The user's pages run as written: every shell and Python block of each page, in order, as a reader
runs them, against a real `tandem serve` on a fresh home (tests/docs_runner.py says how, and what it
normalises). Each page is one test; a block that cannot run here is marked on the page and listed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_runner import (
    REPO,
    SLOW_BLOCK_TIMEOUT_S,
    Machine,
    PageError,
    Reader,
    output_matches,
    page_blocks,
    run_page,
    start_machine,
)

PAGES = [
    "README.md",
    "docs/quickstart.md",
    "docs/using.md",
    "docs/dashboard.md",
    "docs/tinker.md",
    "docs/troubleshooting.md",
    "docs/guides/agents.md",
    "docs/guides/custom-reward.md",
    "docs/guides/environments.md",
    "docs/guides/multi-turn.md",
    "docs/guides/sft-then-grpo.md",
    "docs/guides/lora.md",
    "docs/guides/trackers.md",
    "docs/guides/cluster.md",
    "docs/guides/gpus.md",
    "docs/guides/offline.md",
    "docs/guides/not-yet.md",
    "docs/guides/openenv.md",
    "docs/guides/reasoning-gym.md",
    "docs/guides/verifiers.md",
]
# A Tinker session's host holds a CPU for as long as its service runs: on a 2-core machine a later
# page's job would wait for it (saying so), so this page gets a service of its own.
OWN_SERVICE = {"docs/tinker.md"}
SLOW_PAGES = [p for p in PAGES if any(b.slow for b in page_blocks(REPO / p))]
VENV = Path(sys.prefix)  # what the pages' `.venv` is: the virtualenv running these tests


def reader_machine(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Machine]:
    machine = start_machine(tmp_path_factory.mktemp(name), VENV)
    yield machine
    machine.stop()


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> Iterator[Machine]:
    """The service the pages share, one after another, as one reader's."""
    yield from reader_machine(tmp_path_factory, "reader")


@pytest.fixture(scope="module")
def own_machine(tmp_path_factory) -> Iterator[Machine]:
    yield from reader_machine(tmp_path_factory, "own-reader")


def machine_for(request: pytest.FixtureRequest, page: str) -> Machine:
    return request.getfixturevalue("own_machine" if page in OWN_SERVICE else "machine")


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs_as_written(request: pytest.FixtureRequest, page: str) -> None:
    skipped = run_page(machine_for(request, page), REPO / page)
    print("\n".join(["not run here:", *skipped]) if skipped else "every block ran")


@pytest.mark.slow
@pytest.mark.timeout(3 * SLOW_BLOCK_TIMEOUT_S)  # beyond pyproject's 600 s: each slow block has its own limit
@pytest.mark.parametrize("page", SLOW_PAGES)
def test_the_page_runs_with_its_long_trainings(request: pytest.FixtureRequest, page: str) -> None:
    skipped = run_page(machine_for(request, page), REPO / page, slow=True)
    print("\n".join(["not run here:", *skipped]) if skipped else "every block ran")


def test_every_user_page_is_run() -> None:
    user_pages = {"README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))}
    user_pages |= {f"docs/guides/{p.name}" for p in (REPO / "docs" / "guides").glob("*.md")}
    contributors = {"docs/ARCHITECTURE.md", "docs/concepts.md", "docs/index.md"}  # no commands to run
    assert user_pages - contributors == set(PAGES)


def test_a_marker_must_say_why_a_block_is_not_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n")
    (block,) = page_blocks(page)
    assert block.not_run == "needs a GPU"
    page.write_text("text\n<!-- not-run -->\n```bash\nnvidia-smi\n```\n")
    with pytest.raises(PageError, match="line 2: a `not-run` marker must say why"):
        page_blocks(page)
    page.write_text("<!-- slow:   -->\n```console\n$ make run\n```\n")
    with pytest.raises(PageError, match="must say why"):
        page_blocks(page)


def test_shown_output_is_compared_with_ids_numbers_and_blanks_normalised() -> None:
    shown = "ID                STATUS     STEP   REWARD\njob-3f9a0c21d4e7  succeeded  30/30  0.231\n"
    actual = "ID                STATUS      STEP    REWARD\njob-09d76fa7d532  succeeded   30/30   -0.012\n\n"
    assert output_matches(shown, actual)
    assert not output_matches(shown, actual.replace("succeeded", "failed"))
    assert not output_matches(shown, actual + "job-09d76fa7d533  failed  3/30  0.0\n")
    assert output_matches(shown + "...\n", actual + "another line\nand one more\n")
    assert output_matches("step 30/30 |...| 100%", "step 1/30 |#  | 3%\rstep 30/30 |####| 100%\n")
    assert output_matches(
        "tandem: error: ... greater than 0", "tandem: error: trainer.x: Input should be greater than 0"
    )


@pytest.fixture
def bare_reader(tmp_path: Path) -> Reader:
    """A reader's terminal without a service: the shell and PATH rules alone."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    machine = Machine(
        tmp_path, tmp_path, VENV, REPO, "http://127.0.0.1:1", env, None, tmp_path / "log", tmp_path
    )  # type: ignore[arg-type]
    reader = Reader(machine, tmp_path / "reader")
    yield reader
    reader.close()


def test_tandem_is_on_path_only_after_the_page_activates_the_virtualenv(bare_reader: Reader) -> None:
    before = bare_reader.shell("tandem --help")
    assert before.rc == 127 and "tandem: command not found" in before.output
    assert bare_reader.shell("source .venv/bin/activate").rc == 0
    after = bare_reader.shell("tandem models --help")
    assert after.rc == 0, after.output
    assert "built-in models" in after.output


def test_a_terminals_variables_and_folder_carry_from_block_to_block(bare_reader: Reader) -> None:
    assert bare_reader.shell("export A=1; B=2; cd examples; f() { echo from-f; }").rc == 0
    ran = bare_reader.shell(
        'echo "$A $B $(basename $PWD)"; f; python3 -c "import os; print(os.environ.get(\'B\'))"'
    )
    assert ran.output.split() == ["1", "2", "examples", "from-f", "None"]
    failed = bare_reader.shell("false\necho not reached")
    assert failed.rc == 1 and "not reached" not in failed.output
    assert bare_reader.run_python("x = 40", "one").rc == 0
    shown = bare_reader.run_python("import os\nprint(x + 2, os.environ['A'], os.getcwd())", "two")
    assert shown.rc == 0 and shown.output.split() == ["42", "1", str(REPO / "examples")]

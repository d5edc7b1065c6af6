"""Every shell command the docs print runs as printed: the fenced ``bash`` blocks of README.md,
docs/user-guide.md, docs/getting-started.md and examples/*/README.md. Also: every
``parallel.*`` key has one row in the user guide's table generated from ``PassConfig``, and
``nox -l`` describes each session in one sentence.

Each command that starts with ``gm-train``, ``nox`` or ``python`` (also after ``torchrun`` /
``msrun`` options, and each part of an ``a && b`` line) is checked without training anything:

- ``gm-train ARGS`` and ``nox -s train -- ARGS``: gm-train's own parser takes ARGS, and the
  configuration they name loads (the config file and every override through the same loader,
  with its cross-section checks) for the ranks they ask for; ``--resume`` names a folder
  (placeholders such as ``runs/<timestamp>`` pass).
- ``nox -s NAME`` / ``nox -t TAG``: a session of that name, or a session with that tag, is
  declared in noxfile.py; ``nox`` options are nox's.
- ``python SCRIPT --flag ...``: the script exists (from the block's ``cd``) and declares each
  flag (``add_argument``); ``python -m MODULE``: the module can be found.

A block's ``cd DIR`` line sets the folder of the commands after it. The checks are static or
load a configuration: about a second for all the docs.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from gm_config import ConfigError
from gm_trainer.job.cli import build_parser
from gm_trainer.job.config.job_config import load_config

ROOT = Path(__file__).resolve().parents[4]
DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "user-guide.md",
    ROOT / "docs" / "getting-started.md",
    *sorted((ROOT / "examples").glob("*/README.md")),
]
FENCE = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: Config files the docs name as a stand-in for the reader's own.
PLACEHOLDER_CONFIGS = {"my.yaml"}
#: nox's own options that take a value, and those that take none (nox --help).
NOX_VALUED = {"-s", "--session", "--sessions", "-t", "--tags", "-k", "-p", "--python", "-f"}
NOX_FLAGS = {"-l", "--list", "-R", "-r", "--reuse-existing-virtualenvs", "--no-install", "-x"}


@dataclass(frozen=True)
class Command:
    """One command of a doc: its words, the folder it runs in, and where it is printed."""

    words: tuple[str, ...]
    cwd: Path
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def doc_commands(path: Path) -> list[Command]:
    """The commands of ``path``'s fenced shell blocks that start with gm-train, nox or python."""
    return commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


def commands_in(text: str, name: str) -> list[Command]:
    """The commands of the fenced shell blocks of the markdown ``text`` (the doc ``name``),
    each run from the repository root or the folder a ``cd`` of its block moved to."""
    found = []
    for block in FENCE.finditer(text):
        first_line = text[: block.start(2)].count("\n") + 1
        cwd = ROOT
        body = block.group(2).replace("\\\n", " ")
        for offset, line in enumerate(body.splitlines()):
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            where = f"{name}:{first_line + offset}"
            for part in _parts(words):
                if part[0] == "cd" and len(part) == 2:
                    cwd = (cwd / part[1]).resolve()
                    continue
                part = _launched(part)
                if part and (part[0] in ("gm-train", "nox") or part[0].startswith("python")):
                    found.append(Command(tuple(part), cwd, where))
    return found


def _parts(words: list[str]) -> list[list[str]]:
    """``a && b ; c > out`` -> ``[a, b, c]`` (redirections left out)."""
    parts: list[list[str]] = [[]]
    redirect = False
    for word in words:
        if redirect:
            redirect = False
        elif word in ("&&", ";", "||"):
            parts.append([])
        elif word in (">", ">>", "<", "2>"):
            redirect = True  # the next word is the file
        elif word != "2>&1":
            parts[-1].append(word)
    return [p for p in parts if p]


def _launched(words: list[str]) -> list[str]:
    """The command a launcher runs: ``torchrun --nproc-per-node 4 x.py`` -> ``python x.py``,
    ``torchrun ... -m gm_trainer.job.cli ARGS`` -> ``gm-train ARGS``."""
    if words[0] not in ("torchrun", "msrun", "srun"):
        return words
    rest = words[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        option = rest.pop(0)
        if "=" not in option and rest and not rest[0].startswith("-") and words[0] == "torchrun":
            rest.pop(0)  # torchrun's options take a value
    if rest[:2] == ["-m", "gm_trainer.job.cli"]:
        return ["gm-train", *rest[2:]]
    if words[0] == "srun":
        return rest
    return ["python", *rest] if rest else []


ALL = [c for doc in DOCS for c in doc_commands(doc)]
#: Folders whose commands read what a cheap script of theirs writes first: the script runs
#: for real (on a smaller corpus) in a copy of the folder, where those commands are checked.
PREPARE = {ROOT / "examples" / "hf_llama": ["prepare.py", "--max-bytes", "100000"]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """Each folder of :data:`PREPARE` -> its copy, with the script run in it."""
    import shutil
    import subprocess
    import sys

    copies = {}
    for folder, script in PREPARE.items():
        copy = tmp_path_factory.mktemp(folder.name) / folder.name
        shutil.copytree(folder, copy)
        subprocess.run([sys.executable, *script], cwd=copy, check=True, capture_output=True)
        copies[folder] = copy
    return copies


def test_the_docs_print_commands_to_check() -> None:
    kinds = {c.words[0] for c in ALL}
    assert {"gm-train", "nox"} <= kinds and any(k.startswith("python") for k in kinds), kinds
    assert len(ALL) > 30, [str(c) for c in ALL]
    assert (ROOT / "docs" / "getting-started.md") in DOCS


@pytest.mark.parametrize("command", ALL, ids=str)
def test_each_command_runs_as_printed(
    command: Command,
    tmp_path: Path,
    prepared: dict[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if command.cwd in prepared:
        command = Command(command.words, prepared[command.cwd], command.where)
    monkeypatch.chdir(command.cwd)  # gm-train reads relative paths from where it runs
    check_command(command, tmp_path)


def check_command(command: Command, tmp_path: Path) -> None:
    """Raise ``AssertionError`` (naming the doc line) when ``command`` would not run."""
    words = list(command.words)
    if words[0] == "gm-train":
        check_gm_train(words[1:], command, tmp_path)
    elif words[0] == "nox":
        check_nox(words[1:], command, tmp_path)
    else:
        check_python(words[1:], command)


def check_gm_train(args: list[str], command: Command, tmp_path: Path) -> None:
    parser = build_parser()
    parser.exit_on_error = False
    try:
        parsed = parser.parse_intermixed_args(args)
    except (SystemExit, Exception) as e:  # argparse reports a bad option by exiting
        raise AssertionError(f"{command}: gm-train's parser refuses it ({e})") from None
    paths = [a for a in parsed.args if "=" not in a]
    overrides = [a for a in parsed.args if "=" in a]
    assert len(paths) <= 1, f"{command}: more than one config file {paths}"
    config_path = command.cwd / paths[0] if paths else None
    if config_path is not None and not config_path.is_file():
        assert paths[0] in PLACEHOLDER_CONFIGS, f"{command}: no config file {config_path}"
        config_path = None
    if parsed.resume is not None and parsed.resume != "auto":
        assert parsed.resume.startswith("runs/") or "<" in parsed.resume, (
            f"{command}: --resume {parsed.resume} is neither a run folder nor a placeholder"
        )
    try:
        config = load_config(config_path, [_in(tmp_path, o) for o in overrides])
        world = (parsed.nproc or 2) * parsed.nnodes
        if not parsed.plan or parsed.nnodes == 1:
            config.check_world_size(world)
    except ConfigError as e:
        raise AssertionError(f"{command}: the configuration is refused: {e}") from None


def _in(tmp_path: Path, override: str) -> str:
    """A run folder override keeps the check from touching the checkout's runs/."""
    key, _, value = override.partition("=")
    if key == "logging.run_dir":
        return f"{key}={tmp_path / value}"
    return override


def nox_sessions() -> tuple[list[re.Pattern[str]], set[str]]:
    """The session names noxfile.py declares (a name built from a loop variable becomes a
    pattern) and the tags."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    names, tags = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and ast.unparse(deco.func) == "nox.session"):
                continue
            keywords = {k.arg: k.value for k in deco.keywords}
            name = keywords.get("name")
            if isinstance(name, ast.JoinedStr):
                pattern = "".join(
                    re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in name.values
                )
            else:
                pattern = re.escape(name.value if isinstance(name, ast.Constant) else node.name)
            names.append(re.compile(pattern))
            if isinstance(keywords.get("tags"), ast.List):
                tags |= {t.value for t in keywords["tags"].elts if isinstance(t, ast.Constant)}
    return names, tags


def test_each_nox_session_is_described_by_one_complete_sentence() -> None:
    # ``nox -l`` shows a session docstring's first line: it must say the whole thing.
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    sessions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d).startswith("nox.session") for d in node.decorator_list)
    ]
    assert len(sessions) > 10
    for node in sessions:
        doc = ast.get_docstring(node) or ""
        first = doc.split("\n")[0]
        assert first.endswith(".") and first.count(". ") == 0, f"{node.name}: {first!r}"
        assert not re.search(r"\bissues? #?\d", doc), f"{node.name} cites an issue: {doc!r}"


def check_nox(args: list[str], command: Command, tmp_path: Path) -> None:
    names, tags = nox_sessions()
    posargs = args[args.index("--") + 1 :] if "--" in args else []
    options = args[: args.index("--")] if "--" in args else args
    sessions = []
    i = 0
    while i < len(options):
        option = options[i]
        if option in NOX_VALUED:
            assert i + 1 < len(options), f"{command}: {option} needs a value"
            value = options[i + 1]
            if option in ("-s", "--session", "--sessions"):
                sessions.append(value)
                assert any(p.fullmatch(value) for p in names), (
                    f"{command}: noxfile.py has no session {value!r}"
                )
            elif option in ("-t", "--tags"):
                assert value in tags, f"{command}: no nox session is tagged {value!r}"
            i += 2
            continue
        assert option in NOX_FLAGS, f"{command}: {option!r} is not a nox option the docs use"
        i += 1
    if sessions == ["train"]:  # the arguments are gm-train's
        check_gm_train(posargs, command, tmp_path)


def declared_flags(script: Path) -> set[str]:
    """The options ``script`` gives ``add_argument``."""
    tree = ast.parse(script.read_text(encoding="utf-8"))
    flags = {"-h", "--help"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return {f for f in flags if isinstance(f, str) and f.startswith("-")}


def check_python(args: list[str], command: Command) -> None:
    if args[:1] == ["-m"]:
        import importlib.util

        module = args[1]
        if module in ("venv", "pip"):
            return
        assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
        return
    assert args and not args[0].startswith("-"), f"{command}: no script to run"
    script = command.cwd / args[0]
    assert script.is_file(), f"{command}: no script {script}"
    flags = declared_flags(script)
    for word in args[1:]:
        if word.startswith("-"):
            name = word.partition("=")[0]
            assert name in flags, f"{command}: {script.name} declares no option {name}"


@pytest.mark.parametrize(
    "bad",
    [
        "gm-train train.stepz=5",
        "gm-train --nprocs 4",
        "gm-train missing.yaml",
        "gm-train --nproc 3 parallel.pp_degree=2",
        "nox -s trian",
        "nox -t no-such-tag",
        "nox -s train -- model.n_layers=two",
        "python examples/simple_model/train.py --steps 5",
        "python examples/no_such_example.py",
        "torchrun --nproc-per-node 4 examples/automodel_tp/train.py --tensor 2",
    ],
)
def test_a_bad_command_fails_the_check(bad: str, tmp_path: Path) -> None:
    commands = commands_in(f"# a doc\n\n```bash\n{bad}\n```\n", "bad.md")
    assert len(commands) == 1
    with pytest.raises(AssertionError):
        check_command(commands[0], tmp_path)


def _config_reference():
    import importlib.util

    tool = ROOT / "tools" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_parallel_key_has_one_row_in_the_generated_reference() -> None:
    import dataclasses

    from gm_config import PassConfig
    from gm_trainer.job.config.job_config import JobConfig

    reference = _config_reference()
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    block = reference.block(guide)
    assert block is not None, "docs/user-guide.md has no generated PassConfig table"
    assert block == reference.reference_markdown(), (
        "docs/user-guide.md's PassConfig table differs from the dataclass: run "
        "python tools/config_reference.py --write"
    )
    fields = [f.name for f in dataclasses.fields(PassConfig)]
    keys = set(JobConfig().to_dict()["parallel"])
    assert keys == {*fields, "tp_plan"}, keys ^ {*fields, "tp_plan"}
    for name in fields:  # one row in the table, and no other row anywhere in the guide
        rows = re.findall(rf"^\| `(?:parallel\.)?{name}` \|", guide, re.MULTILINE)
        assert len(rows) == 1, f"parallel.{name}: {len(rows)} rows in docs/user-guide.md"
        assert re.search(rf"^\| `{name}` \| `", block, re.MULTILINE), name
    assert len(re.findall(r"^\| `parallel\.tp_plan` \|", guide, re.MULTILINE)) == 1

"""Graph Mode's test matrix. ``nox`` runs everything CI needs; ``nox -t TAG`` selects a layer.

Each layer's session installs only that distribution and the layers below it. The torch-free
layers run twice: in an environment where torch is not installed at all, and with torch.
The opt-in sessions (``full``, ``zoo``, ``moe``, ...) set one variable, ``GM_TESTS``, to the
opt-in sets of tests they add (gm_trace.testing.opt_in); a matrix's session runs its files
whole (its set and ``full``).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PACKAGES = {  # distribution -> the distributions it needs, bottom layer first
    "gm-config": ["gm-config"],
    "gm-passes": ["gm-config", "gm-passes"],
    "gm-trace": ["gm-config", "gm-passes", "gm-trace"],
    "gm-trainer": ["gm-config", "gm-passes", "gm-trace", "gm-trainer"],
}
TORCH_FREE = ("gm-config", "gm-passes")
#: The one variable that adds opt-in sets of tests (gm_trace.testing.opt_in.ENV).
OPT_IN = "GM_TESTS"

TORCH_VERSION = "2.13.0"


def default_torch_spec() -> str:
    """``torch==2.13.0+cpu`` when a local wheel folder (PIP_FIND_LINKS / UV_FIND_LINKS) holds
    that wheel, so CI never downloads a multi-GB CUDA build; else ``torch==2.13.*`` from the
    index, which resolves anywhere (on a GPU machine PyPI's default build is the CUDA one)."""
    for var in ("UV_FIND_LINKS", "PIP_FIND_LINKS"):
        for entry in os.environ.get(var, "").replace(",", " ").split():
            folder = Path(entry.removeprefix("file://"))
            if folder.is_dir() and any(folder.glob(f"torch-{TORCH_VERSION}+cpu-*.whl")):
                return f"torch=={TORCH_VERSION}+cpu"
    return f"torch=={TORCH_VERSION.rsplit('.', 1)[0]}.*"


TORCH_SPEC = os.environ.get("GM_TORCH_SPEC") or default_torch_spec()

# pip finds the local CPU wheel through PIP_FIND_LINKS; give uv the same place.
if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]

NO_TORCH_CHECK = """
try:
    import torch
except ImportError:
    print("torch is not installed in this session: OK")
else:
    raise SystemExit("torch must not be importable in a no-torch session")
"""


def _paths(*names: str) -> list[str]:
    return [str(ROOT / "packages" / name) for name in names]


# Test-only dependencies per layer: the model zoo builds tiny configurations of real
# architectures offline (transformers); gm-train's HF models and data sources (datasets).
# Neither depends on torch, so they never pull another torch build.
TEST_DEPS = {
    "gm-trace": ("transformers>=5.0,<6",),
    "gm-trainer": ("transformers>=5.0,<6", "datasets>=3.0"),
}
# Optional extras of a layer that its tests need: the run-folder tests check loss.png.
TEST_EXTRAS = {"gm-trainer": ("plot",)}


def _install_layer(
    session: nox.Session,
    dist: str,
    *,
    torch: bool,
    tests: bool = True,
    extras: tuple[str, ...] = (),
) -> None:
    """``dist`` with ``extras`` (and its tests' extras when ``tests``), and the layers below."""
    if torch:
        session.install(TORCH_SPEC)
    if tests:
        extras = (*extras, *TEST_EXTRAS.get(dist, ()))
    *below, top = _paths(*PACKAGES[dist])
    if extras:
        top += f"[{','.join(dict.fromkeys(extras))}]"  # e.g. packages/gm-trainer[plot]
    session.install(*below, top, *(("pytest>=8",) if tests else ()))
    if tests and dist in TEST_DEPS:
        session.install(*TEST_DEPS[dist])


def _test_file(dist: str, name: str) -> str:
    """The test file ``name`` of ``dist``'s suite, in the folder that mirrors its sources."""
    found = sorted((ROOT / "packages" / dist / "tests").rglob(name))
    if len(found) != 1:
        raise ValueError(f"{dist}'s tests hold {len(found)} files named {name}")
    return str(found[0])


def _pytest(session: nox.Session, dist: str, env: dict[str, str] | None = None) -> None:
    session.run(
        "pytest",
        str(ROOT / "packages" / dist / "tests"),
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=env,
    )


for _dist in TORCH_FREE:

    @nox.session(name=f"{_dist}(no-torch)", tags=[_dist, "no-torch"])
    def _no_torch(session: nox.Session, dist: str = _dist) -> None:
        """The torch-free layer's suite in an environment where torch is not installed."""
        _install_layer(session, dist, torch=False)
        session.run("python", "-c", NO_TORCH_CHECK)
        _pytest(session, dist)

    @nox.session(name=f"{_dist}(torch)", tags=[_dist, "torch"])
    def _with_torch(session: nox.Session, dist: str = _dist) -> None:
        """The torch-free layer's suite beside torch, so its passes also run on torch.fx graphs."""
        _install_layer(session, dist, torch=True)
        _pytest(session, dist)


for _dist in ("gm-trace", "gm-trainer"):

    @nox.session(name=_dist, tags=[_dist, "torch"])
    def _torch_layer(session: nox.Session, dist: str = _dist) -> None:
        """A torch layer's default suite, with the layers below it installed."""
        _install_layer(session, dist, torch=True)
        _pytest(session, dist)


@nox.session(tags=["boundary", "no-torch"])
def boundary(session: nox.Session) -> None:
    """The import-linter contracts, and every torch-free module imported without torch."""
    session.install("import-linter>=2.6", "pyyaml>=6.0")
    # Sources only: the contracts read import statements, so the torch layers need no torch.
    session.install("--no-deps", *_paths(*PACKAGES["gm-trainer"]))
    session.run("python", "-c", NO_TORCH_CHECK)
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"))
    session.run("python", str(ROOT / "tools" / "check_torch_free.py"), *TORCH_FREE)


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """Ruff's lint and format checks, and a warning for a source module over 450 lines."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))
    session.run("python", str(ROOT / "tools" / "check_module_size.py"), "450")


@nox.session(tags=["wheels"])
def wheels(session: nox.Session) -> None:
    """Each distribution builds alone, and its wheel installs alone with its declared deps."""
    dist_dir = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    for dist in PACKAGES:
        session.run("uv", "build", "--package", dist, "--out-dir", str(dist_dir), external=True)
    for dist, needs in PACKAGES.items():
        venv = Path(session.create_tmp()) / f"venv-{dist}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "--quiet", str(venv), external=True)
        pip = ("uv", "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"))
        if dist not in TORCH_FREE:
            session.run(*pip, TORCH_SPEC, external=True)
        # Pin the layers to the wheels just built, never to a same-named index package.
        wheels_needed = [str(next(dist_dir.glob(f"{d.replace('-', '_')}-*.whl"))) for d in needs]
        session.run(*pip, *wheels_needed, external=True)
        session.run("uv", "pip", "check", "--python", str(venv / "bin" / "python"), external=True)
        module = dist.replace("-", "_")
        session.run(str(venv / "bin" / "python"), "-c", f"import {module}", external=True)
    for wheel in sorted(dist_dir.glob("*.whl")):
        session.log(f"{wheel.name}: {wheel.stat().st_size / 1024:.1f} KiB")


@nox.session(tags=["full"], default=False)
def full(session: nox.Session) -> None:
    """The torch layers' whole suites, the tests that full_only.txt leaves out included.

    Every test a package's ``tests/full_only.txt`` leaves out of the default run (multi-rank
    jobs, resumes, parity grids) runs too: tens of minutes on 2 cores."""
    _install_layer(session, "gm-trainer", torch=True)
    for dist in ("gm-trace", "gm-trainer"):
        _pytest(session, dist, env={OPT_IN: "full"})


@nox.session(tags=["zoo"], default=False)
def zoo(session: nox.Session) -> None:
    """The whole model zoo (every architecture, every row); rewrites docs/zoo.md."""
    _install_layer(session, "gm-trace", torch=True)
    session.run(
        "pytest",
        str(ROOT / "packages" / "gm-trace" / "tests" / "zoo"),
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={OPT_IN: "zoo", "GM_ZOO_REPORT": str(ROOT / "docs" / "zoo.md")},
    )


@nox.session(tags=["composability"], default=False)
def composability(session: nox.Session) -> None:
    """Every pair of graph mode's features against eager PyTorch; rewrites composability.md.

    Pairs and some triples, on real gloo ranks, Inductor included. ``-- --cell pp,in_graph``
    runs only the cells named (and then writes nothing unless ``--out`` is given too)."""
    _install_layer(session, "gm-trainer", torch=True)
    tests = ROOT / "packages" / "gm-trainer" / "tests"
    args = session.posargs or ["--out", str(ROOT / "docs" / "composability.md")]
    session.run("python", str(tests / "composability_report.py"), *args)


@nox.session(tags=["memory"], default=False)
def memory(session: nox.Session) -> None:
    """The activation memory budgets' whole acceptance, offload and pipelines included.

    The own 4-layer GPT and the zoo's Llama at sequence 512, budgets 1 / 0.5 / 0.25 / 0 and
    the presets, one process, FSDP on 2 gloo ranks, PP and dynamic dims."""
    _install_layer(session, "gm-trainer", torch=True)
    session.run(
        "pytest",
        _test_file("gm-trainer", "test_memory_budget.py"),
        # activation offload forced on CPU (the memory plan's third choice)
        _test_file("gm-trainer", "test_offload_training.py"),
        # measure_activations mid-training in a pipeline leaves the stages' generators
        _test_file("gm-trainer", "test_inspection_leaves_the_run.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={OPT_IN: "memory,full"},
    )


@nox.session(tags=["cp"], default=False)
def cp(session: nox.Session) -> None:
    """Context parallelism's whole matrix against one eager process.

    HF Llama and Qwen3 at sequence 256, cp 2 on 2 gloo ranks and cp 2 x FSDP 2 on 4, causal
    and padded, and the checkpoint round trip (the default suite runs one cell)."""
    _install_layer(session, "gm-trainer", torch=True)
    session.env[OPT_IN] = "cp,full"
    session.run(
        "pytest",
        _test_file("gm-trainer", "test_cp.py"),
        _test_file("gm-trace", "test_cp_accelerator.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


@nox.session(tags=["bench"], default=False)
def bench(session: nox.Session) -> None:
    """The benchmarks, which CI does not run.

    Graph mode vs eager and FSDP2, trace time, the symbolic graph vs the static one, the
    pipeline schedules, context parallelism and activation memory budgets."""
    _install_layer(session, "gm-trainer", torch=True)
    session.run("python", str(ROOT / "bench" / "fsdp_bench.py"), *session.posargs)
    session.run("python", str(ROOT / "bench" / "trace_time.py"))
    session.run("python", str(ROOT / "bench" / "dynamic_bench.py"), "--backend", "none")
    session.run("python", str(ROOT / "bench" / "pipeline_bench.py"))
    session.run("python", str(ROOT / "bench" / "memory_bench.py"))
    session.run("python", str(ROOT / "bench" / "memory_bench.py"), "--model", "llama")
    session.run("python", str(ROOT / "bench" / "moe_bench.py"))
    session.run("python", str(ROOT / "bench" / "cp_bench.py"))


@nox.session(tags=["gpu"], default=False)
def gpu(session: nox.Session) -> None:
    """The prepared check on one GPU, under 8 minutes; without a GPU it says so and passes.

    Eager vs graph vs graph + Inductor vs + CUDA graphs vs torch.compile (step time, peak
    memory, MFU, parity against eager), and CP / offload planning on the device
    (``bench/gpu_check.py``). Set GM_TORCH_SPEC to pick the CUDA build."""
    _install_layer(session, "gm-trainer", torch=True, tests=False)
    session.run("python", str(ROOT / "bench" / "gpu_check.py"), *session.posargs)


@nox.session(tags=["moe"], default=False)
def moe(session: nox.Session) -> None:
    """Expert parallelism's whole acceptance on real gloo ranks.

    Every architecture, 4 ranks, accumulation, in_graph, checkpoints, gm-train, EP inside
    pipeline stages; the default suite runs one of each file."""
    _opt_in_trainer_tests(session, ("test_moe.py", "test_moe_pipeline.py"), "moe")


def _opt_in_trainer_tests(session: nox.Session, files: tuple[str, ...], name: str) -> None:
    """gm-trainer's test ``files`` with the opt-in set ``name`` (the whole matrix)."""
    _install_layer(session, "gm-trainer", torch=True)
    paths = [_test_file("gm-trainer", name) for name in files]
    env = {OPT_IN: f"{name},full"}  # these files whole, their slow tests too
    session.run("pytest", *paths, "-q", "-p", "no:cacheprovider", *session.posargs, env=env)


@nox.session(tags=["pipelines"], default=False)
def pipelines(session: nox.Session) -> None:
    """The zero-bubble pipeline schedules' whole acceptance on real gloo ranks.

    zb1p, zbv and dualpipev on 2 ranks, zb1p bitwise against 1F1B, PP x FSDP on 4 ranks and a
    zbv checkpoint resumed under 1F1B and without a pipeline (the default suite runs zbv)."""
    files = (
        "test_pipeline_zero_bubble.py",
        "test_checkpoint_pipeline.py",
        "test_pipeline_contracts.py",
    )
    _opt_in_trainer_tests(session, files, "pipelines")


@nox.session(tags=["train"], default=False)
def train(session: nox.Session) -> None:
    """The main job: gm-train with the arguments given after --, see docs/getting-started.md.

    ``nox -s train -- [CONFIG.yaml] [--nproc N] [section.key=value ...]``."""
    _install_layer(session, "gm-trainer", torch=True, tests=False, extras=("plot",))  # loss.png
    session.run("gm-train", *session.posargs)


@nox.session(tags=["jobs"], default=False)
def jobs(session: nox.Session) -> None:
    """gm-train's multi-process acceptance runs, minutes each on 2 cores.

    TP 1 vs TP 2 vs PP 2 x TP 2 on 4 ranks, the resumes, the plan against measured peaks,
    restarts with the compile cache: not in the default suite."""
    _install_layer(session, "gm-trainer", torch=True)
    session.run(
        "pytest",
        *(
            _test_file("gm-trainer", name)
            for name in ("test_job_tp.py", "test_job_plan.py", "test_job_compile_cache.py")
        ),
        "-q",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env={OPT_IN: "jobs,full"},
    )


@nox.session(tags=["mindspore"], default=False)
def mindspore(session: nox.Session) -> None:
    """The MindSpore backend in an environment without torch.

    gm-config, gm-passes, gm-mindspore and the MindSpore wheel: its no-torch contract, its
    tests (2 CPU workers under msrun) and the example that trains from the YAML plan
    train_torch.py reads too."""
    backend = ROOT / "backends" / "mindspore"
    session.install(*_paths("gm-config", "gm-passes"), str(backend), "pytest>=8")
    session.install("import-linter>=2.6")
    session.run("python", "-c", NO_TORCH_CHECK)
    session.run("lint-imports", "--config", str(backend / "pyproject.toml"))
    session.run("pytest", str(backend / "tests"), "-q", "-p", "no:cacheprovider", *session.posargs)
    logs = Path(session.create_tmp()) / "msrun-logs"
    session.log(f"the example's worker logs: {logs}")
    with socket.socket() as s:  # a free port for msrun's scheduler
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # msrun's workers run the `python` first on PATH: this session's.
    session.run(
        "msrun",
        "--worker_num=2",
        "--local_worker_num=2",
        f"--master_port={port}",
        f"--log_dir={logs}",
        "--join=True",
        "--cluster_time_out=60",
        str(ROOT / "examples" / "mindspore_fsdp" / "train_mindspore.py"),
        "--steps",
        "10",
        env={"OMP_NUM_THREADS": "1"},
    )

